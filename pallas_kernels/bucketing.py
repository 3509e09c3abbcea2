"""Power-of-two bucketing, the one helper behind every padded size (token and sequence buckets,
kernel tiles, sampler widths, the dense reference's lengths). Pure Python, no dependencies."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    """True when ``n`` is 1, 2, 4, 8, ... (False for ``n <= 0``)."""
    return n >= 1 and (n & (n - 1)) == 0
