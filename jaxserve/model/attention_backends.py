"""Attention backend names and their resolution per platform (``--attention-backend``).

Backends: "xla" (attention in plain jnp, compiled by XLA for any platform: the key-chunked
``jaxserve.model.chunked_attention``; what CPUs run), "pallas-gpu" (our Pallas Triton kernel),
"pallas-tpu" (our Pallas Mosaic-TPU kernel). "auto" and "pallas" resolve per platform;
"reference", the old name of "xla", is still accepted (deprecated).

Jax-free, so the engine config (``jaxserve.config``) validates the flag with the names defined
here and the engine refuses a kernel for the wrong platform before it loads any weight;
``jaxserve.model.attention`` runs the resolved backend.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("xla", "pallas-gpu", "pallas-tpu")
"""Resolved backends (what ``PagedAttentionMetadata.backend`` holds)."""
DEPRECATED_ATTENTION_BACKENDS = {"reference": "xla"}
"""Old names still accepted -> the backend they mean."""
ATTENTION_BACKEND_CHOICES = ("auto", "pallas", *ATTENTION_BACKENDS, *DEPRECATED_ATTENTION_BACKENDS)
"""What ``--attention-backend`` accepts."""
_KERNEL_PLATFORM = {"pallas-gpu": "gpu", "pallas-tpu": "tpu"}


def canonical_attention_backend(name: str) -> str:
    """``name`` with a deprecated alias replaced by its backend ("reference" -> "xla"), logging
    a warning once per alias; any other name unchanged (not checked)."""
    if name in DEPRECATED_ATTENTION_BACKENDS:
        _warn_deprecated(name)
        return DEPRECATED_ATTENTION_BACKENDS[name]
    return name


@functools.cache
def _warn_deprecated(name: str) -> None:
    logger.warning(
        "--attention-backend %s is deprecated; use %s (the same backend)",
        name,
        DEPRECATED_ATTENTION_BACKENDS[name],
    )


def resolve_attention_backend(name: str, platform: str, *, interpret: bool = False) -> str:
    """The backend to run, one of ``ATTENTION_BACKENDS``.

    "auto" is "pallas-tpu" on TPU, "pallas-gpu" on GPU and "xla" elsewhere (CPU); with
    ``interpret`` it stays "xla" on CPU (name a kernel to interpret it). "pallas" is the
    platform's kernel; "reference" is "xla" (deprecated).

    Args:
      name: one of ``ATTENTION_BACKEND_CHOICES``.
      platform: ``jax.Device.platform`` of the device that runs the model ("cpu", "gpu", "tpu").
      interpret: the kernel will run in Pallas interpret mode (any platform).

    Raises:
      ValueError: an unknown name (naming ``attention_backend``); a Pallas kernel on a platform
        it cannot compile for, without ``interpret`` (naming both platforms), e.g.
        "pallas-gpu" on a TPU, or "pallas" on CPU.
    """
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(
            f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, got {name!r}"
        )
    name = canonical_attention_backend(name)
    by_platform = {"tpu": "pallas-tpu", "gpu": "pallas-gpu"}
    if name == "auto":
        return by_platform.get(platform, "xla")
    if name == "pallas":
        if platform not in by_platform:
            raise ValueError(
                f"attention_backend 'pallas' has no kernel for platform {platform!r}; on CPU name "
                "one, pallas-gpu or pallas-tpu, with --pallas-interpret (slow; for tests), or use "
                "xla"
            )
        return by_platform[platform]
    want = _KERNEL_PLATFORM.get(name)
    if want is not None and platform != want and not interpret:
        raise ValueError(
            f"attention_backend {name!r} compiles only for platform {want!r}, but this process "
            f"runs on {platform!r}; use --attention-backend auto (picks "
            f"{by_platform.get(platform, 'xla')!r} here), or --pallas-interpret to "
            "interpret the kernel (slow; for tests)"
        )
    return name
