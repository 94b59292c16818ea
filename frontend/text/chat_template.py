"""Chat templates rendered with jinja2 the way transformers 5.x renders them.

Same environment (immutable sandbox, trim_blocks and lstrip_blocks, loop controls, a
`{% generation %}` block that just renders its body), same helpers (`raise_exception`,
`strftime_now`, a `tojson` filter that does not escape HTML, a guarded `dict` and `namespace`),
and the same preparation of the inputs (message objects turned into dicts, keys whose value is
None dropped, everything rebuilt from plain JSON types, reasoning fields aliased), so that a
template renders character for character as `apply_chat_template(..., tokenize=False)` does.

No torch, no transformers: only jinja2 and the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "CONTINUE_TAG",
    "compile_template",
    "pick_template",
    "prepare_messages",
    "render_chat_template",
]

# The names a message's reasoning may come under; templates read the first (gpt-oss: "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the message being continued so that the rendered text can be cut right after it.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Older jinja2 releases have known sandbox escapes, and chat templates from the Hub are untrusted.
_MIN_JINJA = (3, 1, 6)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here
    it only renders its body (assistant masks are not supported)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation; callers catch jinja2.TemplateError."""
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _DictFactory:
    """`dict(...)` inside templates: builds plain dicts without exposing the dict type itself
    (its attributes would be a way out of the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: object) -> None:
    # Underscore attributes on a namespace could reach CPython internals
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
            "Chat templates cannot store underscore-prefixed attributes on a namespace, "
            f"but got {name!r}. Please rename the attribute."
        )


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore-prefixed attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - `self` may be a keyword
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the chat-template sandbox (cached: templates are few and reused).
    Raises ImportError with a jinja2 older than 3.1.6, as transformers does."""
    version = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < _MIN_JINJA:
        raise ImportError(
            f"chat templates need jinja2>=3.1.6 (sandbox fixes), not {jinja2.__version__}"
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def pick_template(
    templates: Mapping[str, str], chosen: str | None = None, tools: object = None
) -> str:
    """The template to render, as transformers picks it from a tokenizer's named templates:
    `chosen` is a template name or a whole template; otherwise "tool_use" when tools are given
    and the model has one, else "default". Raises ValueError when there is none."""
    if chosen is not None:
        return templates.get(chosen, chosen)
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    if templates:
        raise ValueError(
            "This model has multiple chat templates with no default specified! Pass the name of "
            f"one as chat_template. Available template names are {sorted(templates)}."
        )
    raise ValueError("Cannot use chat template functions because this tokenizer has no template.")


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models such as the OpenAI SDK's) as dicts, at
    every depth; other values unchanged."""
    if isinstance(value, Mapping):
        return {key: _as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _is_numpy_scalar(value: Any) -> bool:
    # numpy is never imported here: a numpy value can only exist if the caller imported it
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.generic)


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so that a template only ever sees str, int,
    float, bool, None, dicts, lists and tuples (richer objects have methods the sandbox does not
    know to be unsafe). Anything else becomes a placeholder such as "<ndarray>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # str subclasses (enums...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if _is_numpy_scalar(value):
        return _plain(value.item())  # np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    # Templates read the reasoning as reasoning_content (gpt-oss: thinking); callers may give it
    # under any of the three names. Key order matters to templates that iterate over items().
    reasoning = next(
        (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def prepare_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as a template sees them: dicts of plain data without None-valued keys (many
    templates render a literal "None" or fail on `content=None`, but handle a missing key), with
    the reasoning aliases. Raises TypeError for a message that is not a dict-like object."""
    messages = _as_dicts(getattr(messages, "messages", messages))
    prepared = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(
                "Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {message!r}."
            )
        kept = _plain({key: value for key, value in message.items() if value is not None})
        prepared.append(_with_reasoning_aliases(kept))
    return prepared


def _plain_tools(tools: Any) -> Any:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            # transformers also turns Python functions into JSON schemas; not supported here
            raise ValueError("Tools should be JSON schemas (dicts).")
    return _plain(list(tools))


def _plain_documents(documents: Any) -> Any:
    if documents is None:
        return None
    for document in documents:
        if not isinstance(document, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    return _plain(documents)


def _continued_fields(template: str, final: dict[str, Any], field: str) -> list[str]:
    """The fields of the final message to tag for continuation: `field`, or every alias of it
    that carries the same reasoning. Raises ValueError when the template reads none of them."""
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [name for name in _REASONING_FIELDS if final.get(name) == final[field]]
    if not any(name in template for name in fields):
        raise ValueError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in '
            "the chat_template"
        )
    return fields


def _tag_final_message(template: str, messages: list[dict[str, Any]], field: str) -> str:
    """Append CONTINUE_TAG to the text being continued (in place); return that text as it was."""
    if not messages:
        raise ValueError("continue_final_message is set but the conversation is empty!")
    final = messages[-1]
    text = final.get(field)
    if text is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = _continued_fields(template, final, field)
    if isinstance(text, (list, tuple)):
        for block in reversed(text):  # the last text block is the one being continued
            if "text" in block:
                original = str(block["text"])
                block["text"] = original + CONTINUE_TAG
                return original
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the "
            "final message!"
        )
    for name in fields:
        final[name] = final[name] + CONTINUE_TAG
    return str(text)


def _cut_after_final_message(rendered: str, continued: str) -> str:
    """`rendered` cut right after the continued message's text, where CONTINUE_TAG was."""
    tag = CONTINUE_TAG.strip()
    if continued.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            f"portions of the final message. Final message to continue: {continued.strip()}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing spaces


def render_chat_template(
    template: str,
    messages: Any,
    /,
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **variables: Any,
) -> str:
    """`messages` rendered with the jinja `template`, as transformers renders one conversation.

    The template sees `messages`, `tools`, `documents`, `add_generation_prompt` and every entry of
    `variables` (the tokenizer's special tokens such as bos_token, then the caller's own keyword
    arguments). `continue_final_message` (True: the final message's "content", or a field name)
    leaves the final message open so that the model continues it.

    Raises jinja2.TemplateError (also what `raise_exception` raises), TypeError or ValueError.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible: use "
            "continue_final_message to continue the final message, add_generation_prompt to "
            "start a new assistant message."
        )
    compiled = compile_template(template)
    plain_tools = _plain_tools(tools)
    plain_documents = _plain_documents(documents)
    plain_variables = _plain(variables)
    chat = prepare_messages(messages)
    continued = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        continued = _tag_final_message(template, chat, field)
    rendered = compiled.render(
        messages=chat,
        tools=plain_tools,
        documents=plain_documents,
        add_generation_prompt=add_generation_prompt,
        **plain_variables,
    )
    if continued is not None:
        rendered = _cut_after_final_message(rendered, continued)
    return rendered
