"""Attention backend names and their resolution per platform (``--attention-backend``).

Jax-free, so the engine config (``jaxserve.config``) validates the flag with the names defined
here and the engine refuses a kernel for the wrong platform before it loads any weight;
``jaxserve.model.attention`` runs the resolved backend.
"""

from __future__ import annotations

ATTENTION_BACKEND_CHOICES = ("auto", "pallas", "pallas-gpu", "pallas-tpu", "reference")
"""What ``--attention-backend`` accepts; "auto" and "pallas" resolve per platform."""
ATTENTION_BACKENDS = ("reference", "pallas-gpu", "pallas-tpu")
"""Resolved backends (what ``PagedAttentionMetadata.backend`` holds)."""
_KERNEL_PLATFORM = {"pallas-gpu": "gpu", "pallas-tpu": "tpu"}


def resolve_attention_backend(name: str, platform: str, *, interpret: bool = False) -> str:
    """The backend to run, one of ``ATTENTION_BACKENDS``.

    "auto" is "pallas-tpu" on TPU, "pallas-gpu" on GPU and "reference" elsewhere (CPU); with
    ``interpret`` it stays "reference" on CPU (name a kernel to interpret it). "pallas" is the
    platform's kernel.

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
    by_platform = {"tpu": "pallas-tpu", "gpu": "pallas-gpu"}
    if name == "auto":
        return by_platform.get(platform, "reference")
    if name == "pallas":
        if platform not in by_platform:
            raise ValueError(
                f"attention_backend 'pallas' has no kernel for platform {platform!r}; on CPU name "
                "one, pallas-gpu or pallas-tpu, with --pallas-interpret (slow; for tests), or use "
                "reference"
            )
        return by_platform[platform]
    want = _KERNEL_PLATFORM.get(name)
    if want is not None and platform != want and not interpret:
        raise ValueError(
            f"attention_backend {name!r} compiles only for platform {want!r}, but this process "
            f"runs on {platform!r}; use --attention-backend auto (picks "
            f"{by_platform.get(platform, 'reference')!r} here), or --pallas-interpret to "
            "interpret the kernel (slow; for tests)"
        )
    return name
