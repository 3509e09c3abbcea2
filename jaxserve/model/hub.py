"""Hugging Face Hub model ids (``jaxserve serve org/name``): the step before loading that turns
an id into a local directory, with ``huggingface_hub`` (vLLM's behaviour and flag names).

    resolve_hub_model("HuggingFaceTB/SmolLM2-135M-Instruct", revision=None, download_dir=None)
        -> ".../models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/<commit>"

Online, the repository's config, tokenizer and safetensors files are downloaded into the Hub's
cache (``HF_HUB_CACHE``, ``HF_HOME``; or ``--download-dir``) unless they are there already; with
``HF_HUB_OFFLINE=1`` only the cache is read. A failure (not cached while offline, no network,
an unknown repository or revision, a gated model without ``HF_TOKEN``) is a
:class:`~jaxserve.model.arch_config.ModelLoadError` with one line that says what to do. Everything
after this step (the preflight checks, the loader) sees a plain model directory.
"""

from __future__ import annotations

import functools
import os
import re

from jaxserve.model.arch_config import ModelLoadError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
"""``org/name`` as the Hub spells repository ids."""

ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)
"""What a model needs from its repository (config, weights, tokenizer, chat template); other
formats' weights (``*.bin``, ``*.pth``, ``*.gguf``, ONNX) are left on the Hub."""

_TRUE = {"1", "on", "true", "yes"}


def is_hub_id(name: str | None) -> bool:
    """True when ``name`` is not a local path and reads as a Hub repository id ``org/name``."""
    return bool(
        name
        and HUB_ID.fullmatch(name)
        and not name.startswith((".", "~"))
        and not os.path.exists(name)
    )


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the environment says now (``huggingface_hub`` reads it once, at
    import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_hub_model(
    repo_id: str, revision: str | None = None, download_dir: str | None = None
) -> str:
    """The local directory holding ``repo_id`` at ``revision``: its cached snapshot, downloaded
    first when online (only the files in :data:`ALLOW_PATTERNS`).

    Args:
      repo_id: ``org/name``.
      revision: a branch, tag or commit hash; None: the default branch (``main``).
      download_dir: the cache directory to use instead of the Hub's (``--download-dir``).

    Raises:
      ModelLoadError: one line saying what failed and what to do.
    """
    return _resolve(repo_id, revision, download_dir, hub_offline())


@functools.lru_cache(maxsize=16)
def _resolve(repo_id: str, revision: str | None, download_dir: str | None, offline: bool) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    where = f"--download-dir {download_dir}" if download_dir else "the Hugging Face cache"
    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            local_files_only=offline,
            allow_patterns=list(ALLOW_PATTERNS),
        )
    except GatedRepoError:
        raise ModelLoadError(
            f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on the Hub and "
            "set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r} has no revision {revision!r} on the Hugging Face Hub"
        ) from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"model {repo_id!r} is neither a local path nor a model on the Hugging Face Hub "
            "(a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelLoadError(
                f"model {repo_id!r}{at} is not in {where} and HF_HUB_OFFLINE=1 forbids "
                "downloading it: run once without HF_HUB_OFFLINE, or pass a local directory"
            ) from None
        raise ModelLoadError(
            f"model {repo_id!r}{at} could not be downloaded (the Hugging Face Hub is not "
            f"reachable) and is not in {where}: check the network, or pass a local directory"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(
            f"model {repo_id!r}{at} could not be downloaded from the Hugging Face Hub: {reason}"
        ) from None
