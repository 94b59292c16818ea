"""Chat templates rendered by FastTokenizer against transformers' `apply_chat_template`.

The expected text (or the expected error) is always what transformers produces for the same
tokenizer files, messages and arguments: the production template (DeepSeek-R1's, shipped with
both the Llama 3 and the Qwen2.5 tokenizer) and hand-written templates that use every helper
transformers gives templates (tojson, loop controls, namespace, dict, strftime_now, generation
blocks, raise_exception).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from engine_core.worker.default_model import DEFAULT, TINY_QWEN2, TinySpec, write_tokenizer
from frontend.text.chat_template import compile_template, pick_template, render_chat_template
from frontend.text.tokenizer import FastTokenizer
from frontend.text.tokenizer_loader import load_tokenizer

SPECS: dict[str, TinySpec] = {"llama3": DEFAULT, "qwen2": TINY_QWEN2}


@pytest.fixture(scope="session", params=list(SPECS))
def shipped(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[FastTokenizer, Any]:
    """(ours, transformers') for each production tokenizer, written as the project writes it."""
    folder = tmp_path_factory.mktemp(f"chat-template-{request.param}")
    write_tokenizer(SPECS[request.param], folder)
    ours = load_tokenizer(str(folder))
    assert isinstance(ours, FastTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(folder))


def outcome(tokenizer: Any, messages: Any, **kwargs: Any) -> tuple[str, str]:
    """("text", the rendered text) or ("error", the exception's type, with the message of the
    errors that come from jinja or the template itself)."""
    try:
        return "text", tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateError as exc:
        return "error", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return "error", type(exc).__name__


def assert_renders_alike(
    pair: tuple[FastTokenizer, Any], messages: Any, **kwargs: Any
) -> tuple[str, str]:
    """Both render the same text (or fail alike); returns the outcome."""
    ours, ref = pair
    expected = outcome(ref, messages, **kwargs)
    assert outcome(ours, messages, **kwargs) == expected
    return expected


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'later' in a city: ü",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

TOOL_CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    },
    {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "東京", "days": 2}'},
    },
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello!"}],
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "And 日本 + 🚀?"},
        {"role": "assistant", "content": "No idea.", "reasoning_content": "hmm"},
        {"role": "user", "content": "  spaces\n\nand newlines  "},
    ],
    "developer": [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": "", "tool_calls": TOOL_CALLS},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": '{"temp": 25}', "tool_call_id": "call_2"},
        {"role": "assistant", "content": "Paris 21, Tokyo 25."},
        {"role": "user", "content": "Thanks"},
    ],
    # content None is dropped before rendering, which this template does not survive: the
    # error must be the same one
    "tool_calls_content_none": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS[:1]},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    "ends_with_tool": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": TOOL_CALLS[:1]},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_shipped_template_renders_as_transformers(
    shipped: tuple[FastTokenizer, Any], name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    assert_renders_alike(shipped, messages, add_generation_prompt=add_generation_prompt)
    assert_renders_alike(
        shipped, messages, tools=TOOLS, add_generation_prompt=add_generation_prompt
    )


def test_shipped_template_outcomes_are_text_where_expected(
    shipped: tuple[FastTokenizer, Any],
) -> None:
    """Guard the comparisons above: most conversations render, and the BOS comes first."""
    ours, _ = shipped
    for name in ("system_user", "multi_turn", "tool_calls", "developer"):
        text = ours.apply_chat_template(CONVERSATIONS[name], tokenize=False)
        assert text.startswith(str(ours.bos_token)), name
    kind, error = outcome(ours, CONVERSATIONS["tool_calls_content_none"])
    assert kind == "error" and error.startswith("UndefinedError")


def test_tokenized_chat_matches(shipped: tuple[FastTokenizer, Any]) -> None:
    ours, ref = shipped
    messages = CONVERSATIONS["multi_turn"]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == {
        "input_ids": list(expected["input_ids"]),
        "attention_mask": list(expected["attention_mask"]),
    }
    assert ours.apply_chat_template(messages, return_dict=False) == ref.apply_chat_template(
        messages, return_dict=False
    )
    text = ours.apply_chat_template(messages, tokenize=False)
    assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_continue_final_message(shipped: tuple[FastTokenizer, Any]) -> None:
    prefill = [*CONVERSATIONS["system_user"], {"role": "assistant", "content": "It is  "}]
    assert_renders_alike(shipped, prefill, continue_final_message=True)
    assert_renders_alike(
        shipped, prefill, continue_final_message=True, add_generation_prompt=True
    )  # an error in both


# A template using every helper and construct transformers gives templates.
FEATURES_TEMPLATE = """
{%- set ns = namespace(turns=0, system=none) -%}
{{ bos_token }}
{%- if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>
{% endif -%}
{%- if documents %}{% for doc in documents %}[{{ loop.index }}/{{ loop.length }}] {{ doc.title }}
{% endfor %}{% endif -%}
{%- for message in messages -%}
  {%- if message.role in ('system', 'developer') -%}
    {%- set ns.system = message.content -%}
    {%- continue -%}
  {%- endif -%}
  {%- if message.role == 'stop' %}{% break %}{% endif -%}
  {%- set ns.turns = ns.turns + 1 %}
  <|{{ message.role }}|>{{ message.content | tojson }}
  {%- for key, value in message.items() if key not in ('role', 'content') %}
 {{ key }}={{ value | tojson(sort_keys=true) }}
  {%- endfor %}
  {%- if message.tool_calls is defined -%}
    {%- for call in message.tool_calls -%}
<call>{{ call.function.name }}({{ call.function.arguments | tojson(separators=(',', ':')) }})</call>
    {%- endfor -%}
  {%- endif -%}
  {%- if message.role == 'assistant' -%}
    {% generation %}[{{ message.content }}]{% endgeneration %}
  {%- endif %}
{% endfor -%}
system={{ ns.system | tojson }} turns={{ ns.turns }} year={{ strftime_now('%Y') }}
{%- set d = dict(a=1, b=[1, 2]) %} {{ d | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}
{%- if enable_thinking is defined and not enable_thinking %} no-think{% endif %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}
"""

FEATURE_MESSAGES: list[Any] = [
    {"role": "developer", "content": "Be <b>bold</b> & 'clear'"},
    {"role": "user", "content": 'ü 🚀 "quoted" </script>', "name": None, "score": 1.5},
    {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
        "thinking": "because",
    },
    {"role": "tool", "content": "[1, 2]", "extra": {"z": 1, "a": [True, None]}},
    {"role": "stop", "content": "everything after this is cut by {% break %}"},
    {"role": "user", "content": "unseen"},
]


@dataclasses.dataclass
class Message:
    role: str
    content: str | None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_template_features_render_as_transformers(
    shipped: tuple[FastTokenizer, Any], add_generation_prompt: bool
) -> None:
    documents = [{"title": "Doc <1>", "text": "x"}, {"title": "Doc 2", "text": "y"}]
    calls: list[dict[str, Any]] = [
        {},
        {"tools": TOOLS},
        {"documents": documents},
        {"enable_thinking": False, "bos_token": "<override>"},
    ]
    for kwargs in calls:
        kind, text = assert_renders_alike(
            shipped,
            FEATURE_MESSAGES,
            chat_template=FEATURES_TEMPLATE,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        assert kind == "text", text
        assert "unseen" not in text and "ü" in text and "\\u00fc" not in text


def test_message_objects_render_as_dicts(shipped: tuple[FastTokenizer, Any]) -> None:
    messages = [Message("system", "S"), Message("user", "Hi"), Message("assistant", "A")]
    assert assert_renders_alike(shipped, messages, chat_template=FEATURES_TEMPLATE)[0] == "text"
    # content=None is dropped, so tojson gets an undefined value: the same TypeError
    assert assert_renders_alike(
        shipped, [Message("user", None)], chat_template=FEATURES_TEMPLATE
    ) == ("error", "TypeError")


def test_continue_final_message_with_content_blocks_and_reasoning(
    shipped: tuple[FastTokenizer, Any],
) -> None:
    blocks = "{% for m in messages %}{% for b in m.content %}{{ b.text }}|{% endfor %}{% endfor %}"
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "b "}, {"type": "image"}]},
    ]
    assert_renders_alike(shipped, messages, chat_template=blocks, continue_final_message=True)
    reasoning = "{% for m in messages %}<{{ m.reasoning_content }}>{{ m.content }}{% endfor %}"
    partial = [{"role": "user", "content": "q"}, {"role": "assistant", "thinking": "so far"}]
    for field in ("reasoning_content", "thinking"):
        assert_renders_alike(
            shipped, partial, chat_template=reasoning, continue_final_message=field
        )


ERROR_TEMPLATES = {
    "raise_exception": (
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok"
    ),
    "syntax": "{% for message in messages %}{{ message.content }}",
    "namespace_underscore": "{% set ns = namespace(_secret=1) %}{{ ns }}",
    "namespace_set_underscore": "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "mutation": "{{ messages.append(1) }}",
    "undefined_call": "{{ messages[0].content.nope() }}",
}


@pytest.mark.parametrize("name", list(ERROR_TEMPLATES))
def test_template_errors_match_and_are_catchable(
    shipped: tuple[FastTokenizer, Any], name: str
) -> None:
    ours, _ = shipped
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    template = ERROR_TEMPLATES[name]
    assert_renders_alike(shipped, messages, chat_template=template)
    with pytest.raises((jinja2.TemplateError, TypeError, ValueError)):
        ours.apply_chat_template(messages, chat_template=template, tokenize=False)


def test_raise_exception_is_a_template_error(shipped: tuple[FastTokenizer, Any]) -> None:
    ours, _ = shipped
    template = ERROR_TEMPLATES["raise_exception"]
    with pytest.raises(jinja2.TemplateError, match="must start with a user message"):
        ours.apply_chat_template([{"role": "system", "content": "S"}], chat_template=template)


def test_sandbox_hides_internals(shipped: tuple[FastTokenizer, Any]) -> None:
    template = "[{{ ''.__class__ }}][{{ messages.__class__.__mro__ }}][{{ cycler.__init__ }}]"
    _, text = assert_renders_alike(
        shipped, [{"role": "user", "content": "u"}], chat_template=template
    )
    assert "<class" not in text  # an error or empty attributes, never the class itself


def test_bad_inputs_fail_alike(shipped: tuple[FastTokenizer, Any]) -> None:
    user = [{"role": "user", "content": "u"}]
    assert_renders_alike(shipped, [])  # empty conversation
    assert_renders_alike(shipped, ["not a message"])
    assert_renders_alike(shipped, user, tools=["not a schema"])
    assert_renders_alike(shipped, user, documents=["not a document"])
    assert_renders_alike(shipped, user, chat_template="{{ tools }}|{{ documents }}")


def test_pick_template() -> None:
    named = {"default": "D", "tool_use": "T"}
    assert pick_template(named) == "D"
    assert pick_template(named, tools=[{}]) == "T"
    assert pick_template(named, "tool_use") == "T"
    assert pick_template(named, "{{ inline }}") == "{{ inline }}"
    with pytest.raises(ValueError):
        pick_template({"a": "A", "b": "B"})
    with pytest.raises(ValueError):
        pick_template({})


def test_render_chat_template_directly() -> None:
    """The renderer alone: variables reach the template, None-valued keys do not."""
    template = "{{ greeting }}{% for m in messages %} {{ m | tojson }}{% endfor %}"
    text = render_chat_template(
        template, [{"role": "user", "content": "é", "name": None}], greeting="hi"
    )
    assert text == 'hi {"role": "user", "content": "é"}'
    # any name can be a template variable, the renderer's own parameter names included
    assert render_chat_template("{{ template }}", [], template="t") == "t"
    assert compile_template(template) is compile_template(template)


def test_no_template_is_a_value_error(tmp_path: Path) -> None:
    """A tokenizer without a template refuses to render, as transformers does."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
    ours = load_tokenizer(str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template is None and ref.chat_template is None
    with pytest.raises(ValueError):
        ours.apply_chat_template([{"role": "user", "content": "u"}], tokenize=False)
