"""Tokenizers (sentencepiece and Hugging Face ``tokenizers``), chat templates, and the
incremental detokenizer with stop strings that turns generated ids into streamed text."""

from jaxserve.tokenizer.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplateError,
    normalize_messages,
    render_chat_template,
)
from jaxserve.tokenizer.detokenizer import IncrementalDetokenizer
from jaxserve.tokenizer.loading import get_tokenizer
from jaxserve.tokenizer.stop_strings import StopChecker
from jaxserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopChecker",
    "Tokenizer",
    "get_tokenizer",
    "normalize_messages",
    "render_chat_template",
]
