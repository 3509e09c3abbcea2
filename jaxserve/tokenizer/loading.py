"""Loading a model directory's tokenizer: picks the backend the way transformers'
``AutoTokenizer`` does with ``use_fast=True`` (``tokenizer.json`` when present, else
``tokenizer.model``)."""

from __future__ import annotations

import os

from jaxserve.tokenizer.chat_template import load_chat_template
from jaxserve.tokenizer.tokenizer import Tokenizer, read_json_object


def load_served_tokenizer(model: str, tokenizer: str = "", chat_template: str = "") -> Tokenizer:
    """The tokenizer an engine serves with: ``tokenizer``'s (``--tokenizer``; "" = the
    model's), with ``chat_template``'s template (``--chat-template``, see
    ``load_chat_template``) in place of its own when given.

    Raises:
      ValueError: no tokenizer at the path, or a chat template that cannot be read or compiled
        (naming ``tokenizer`` / ``chat_template``).
    """
    try:
        served = get_tokenizer(tokenizer or model)
    except ValueError as e:
        if not tokenizer:
            raise
        raise ValueError(f"tokenizer: {e}") from None
    if chat_template:
        served.chat_template = load_chat_template(chat_template)
    return served


def get_tokenizer(model_path: str, backend: str = "auto") -> Tokenizer:
    """Loads the tokenizer of a model directory (or of a ``tokenizer.model`` /
    ``tokenizer.json`` file path, whose directory then holds the configs), or the one built
    into a ``.gguf`` file (``jaxserve.tokenizer.gguf_tokenizer``).

    Args:
      model_path: model directory or tokenizer file.
      backend: "auto" (tokenizer.json if present, else tokenizer.model), "hf" or
        "sentencepiece".

    Raises:
      ValueError: unknown ``backend``, or no tokenizer file at ``model_path`` (the message
        names the paths looked at).
    """
    # The backends import their libraries: on first use, so `import jaxserve.tokenizer` stays light.
    from jaxserve.tokenizer.hf_tokenizer import HFTokenizer
    from jaxserve.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

    if backend not in ("auto", "hf", "sentencepiece"):
        raise ValueError(f"backend must be 'auto', 'hf' or 'sentencepiece', got {backend!r}")
    if str(model_path).lower().endswith(".gguf"):
        from jaxserve.tokenizer.gguf_tokenizer import GGUFTokenizer

        return GGUFTokenizer(str(model_path))
    if os.path.isfile(model_path):
        model_dir = os.path.dirname(model_path) or "."
        if model_path.endswith(".json"):
            json_path, spm_path = model_path, None
        else:
            json_path, spm_path = None, model_path
    else:
        model_dir = model_path
        json_path = os.path.join(model_dir, "tokenizer.json")
        spm_path = os.path.join(model_dir, "tokenizer.model")
        json_path = json_path if os.path.isfile(json_path) else None
        spm_path = spm_path if os.path.isfile(spm_path) else None
    config = read_json_object(os.path.join(model_dir, "tokenizer_config.json"))
    if json_path and backend in ("auto", "hf"):
        return HFTokenizer(json_path, model_dir, config)
    if spm_path and backend in ("auto", "sentencepiece"):
        return SentencePieceTokenizer(spm_path, model_dir, config)
    wanted = {
        "auto": "tokenizer.json or tokenizer.model",
        "hf": "tokenizer.json",
        "sentencepiece": "tokenizer.model",
    }[backend]
    raise ValueError(f"no tokenizer found: {model_path!r} has no {wanted}")
