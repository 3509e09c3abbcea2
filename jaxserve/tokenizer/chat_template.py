"""Chat templates: Jinja2 templates from tokenizer_config.json, rendered as transformers does.

Follows transformers' ``utils/chat_template_utils.py`` (``_compile_jinja_template`` and
``render_jinja_template``): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII
characters (``ensure_ascii=False``), the globals ``raise_exception`` and ``strftime_now``, the
``{% generation %}`` block tag (rendered as its body), and the variables ``messages``,
``tools``, ``documents``, ``add_generation_prompt`` and the special tokens (``bos_token``,
``eos_token``, ``unk_token``, ``pad_token``).

Message content: OpenAI allows a string or a list of content parts; templates written for
text models expect a string, so text parts are joined with "\\n" (vLLM's "string" content
format). Other part types (images, audio) are rejected.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Used when neither the request nor the tokenizer gives a template: ChatML (OpenAI's
chat markup, used by Qwen; transformers' former class-level ``default_chat_template``).
For a model not trained on it the markers are plain text."""


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation (``raise_exception``) or failed to render."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' ``AssistantTracker``), which
    marks assistant text for training masks; for inference it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render", [])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles ``template`` in transformers' environment (cached per template string).

    Raises:
      ChatTemplateError: the template has a Jinja syntax error.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"chat template has a syntax error at line {e.lineno}: {e.message}"
        ) from e


JINJA_CHARS = "{}\n"
"""A ``--chat-template`` value holding one of these is the template itself, else a file path
(vLLM's rule)."""


def load_chat_template(value: str) -> str:
    """The template a ``--chat-template`` value names: the file's text, or ``value`` itself
    when it holds ``{``, ``}`` or a newline; compiled once to check it.

    Raises:
      ValueError: a path that cannot be read, or a template with a Jinja syntax error (the
        message starts with ``chat_template``).
    """
    if any(c in value for c in JINJA_CHARS):
        template = value
    else:
        try:
            with open(value, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(
                f"chat_template: {value!r} is neither a readable file ({e.strerror or e}) nor a "
                "Jinja template (a template holds {{ }}, {% %} or a newline)"
            ) from None
    try:
        compile_chat_template(template)
    except ChatTemplateError as e:
        raise ValueError(f"chat_template: {e}") from None
    return template


def select_chat_template(template: str | list | dict | None, tools: list | None = None) -> str:
    """Picks one template string, as transformers does for multi-template tokenizers.

    ``template`` may be a string, a list of ``{"name": ..., "template": ...}`` (the
    tokenizer_config.json form) or a dict name -> template. From several, "tool_use" is
    taken when ``tools`` is given and it exists, else "default". None gives
    :data:`DEFAULT_CHAT_TEMPLATE`.

    Raises:
      ValueError: malformed template list, or several templates and none named "default".
    """
    if template is None:
        return DEFAULT_CHAT_TEMPLATE
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        try:
            template = {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError) as e:
            raise ValueError(
                "chat_template list entries must be {'name': ..., 'template': ...}"
            ) from e
    if not isinstance(template, dict):
        raise ValueError(
            f"chat_template must be a string or a list of named templates, "
            f"got {type(template).__name__}"
        )
    if tools is not None and "tool_use" in template:
        return template["tool_use"]
    if "default" in template:
        return template["default"]
    raise ValueError(
        f"chat_template has several templates ({', '.join(template)}) and none named 'default'"
    )


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks an OpenAI-style message list and returns copies with string content.

    Each message is a dict with a non-empty string ``role`` and a ``content`` that is a
    string or a list of text parts ``{"type": "text", "text": str}`` (joined with "\\n").
    ``content`` may be missing or None only for an assistant message (e.g. one carrying
    ``tool_calls``); it then renders as "". Other keys (``name``, ``tool_calls``,
    ``tool_call_id``) are passed through.

    Raises:
      ValueError: naming the field at fault, e.g. ``messages[1].content[0].type``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}.role must be a non-empty string")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise ValueError(f"{where}.content is required for role {role!r}")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict):
                    raise ValueError(f"{where}.content[{j}] must be an object")
                if part.get("type") != "text":
                    raise ValueError(
                        f"{where}.content[{j}].type must be 'text', got {part.get('type')!r}"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{j}].text must be a string")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(
                f"{where}.content must be a string or a list of text parts, got "
                f"{type(content).__name__}"
            )
        out.append({**msg, "content": content})
    return out


def render_chat_template(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Renders ``messages`` with ``template``; ``kwargs`` become extra template variables
    (transformers' ``chat_template_kwargs``, e.g. ``enable_thinking``).

    Raises:
      ValueError: malformed ``messages`` (see :func:`normalize_messages`) or ``tools``.
      ChatTemplateError: the template raised or failed.
    """
    messages = normalize_messages(messages)
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise ValueError("tools must be a list of objects")
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
            **kwargs,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError) as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
