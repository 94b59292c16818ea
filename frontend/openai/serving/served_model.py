"""The model this frontend serves, as the OpenAI APIs see it: name, tokenizer, lengths.

`ServedModel` is settled once at start-up from the engine's Ready and the loaded tokenizer;
every API asks it, rather than the tokenizer or the engine, whether a model name, a token id or
a prompt is acceptable, and has it render chats. Its checks raise OpenAIError (4xx).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import msgspec

from frontend.errors import OpenAIError, bad_request
from frontend.openai.protocol.base import ModelCard
from frontend.openai.protocol.chat import ChatMessage, ContentPart, check_messages
from frontend.text.byte_pieces import BytePieces
from frontend.text.logprob_text import TokenTextCache
from shared.messages import LoRACard, Ready


class UnknownModelError(OpenAIError):
    """A request's `model` is neither the served model nor an adapter (a 404)."""


class ServedModel:
    """The served model name, its tokenizer and token strings, and the engine's limits."""

    def __init__(
        self, tokenizer: Any, name: str, max_model_len: int, engine_vocab_size: int,
        sampling_defaults: dict[str, int | float] | None = None,
        adapters: Sequence[LoRACard] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.max_model_len = max_model_len
        # the model's generation defaults, for the sampling fields a request leaves out
        self.sampling_defaults = dict(sampling_defaults or {})
        # --enable-lora: the adapters a request may name as its model, by name
        self.adapters = {card.name: card for card in adapters}
        # ids both sides know: a tokenizer may pad its vocabulary, a model may pad its head
        self.vocab_size = min(len(tokenizer), engine_vocab_size)
        self.token_text = TokenTextCache(tokenizer)  # shared by every request
        self.pieces = BytePieces.of(tokenizer)  # the detokenizer's fast path, when it applies

    @classmethod
    def from_ready(cls, tokenizer: Any, ready: Ready, name: str | None = None) -> ServedModel:
        """The model the engine announced, served as `name` (default: the engine's name)."""
        return cls(tokenizer, name or ready.model, ready.max_model_len, ready.vocab_size,
                   ready.sampling_defaults, ready.lora_adapters)

    def cards(self) -> list[ModelCard]:
        """/v1/models: the served model, then each LoRA adapter (its parent the base model,
        its root its folder, as vLLM lists them)."""
        return [ModelCard(id=self.name, root=self.name, max_model_len=self.max_model_len),
                *(ModelCard(id=c.name, root=c.path, max_model_len=self.max_model_len,
                            parent=c.base_model_name or self.name)
                  for c in self.adapters.values())]

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None for the served model; a 404
        for any other name."""
        if model is not None and model in self.adapters:
            return model
        self.check_model(model)
        return None

    def set_adapters(self, cards: Sequence[LoRACard]) -> None:
        """The adapters the engines serve now (loaded or unloaded at run time)."""
        self.adapters = {card.name: card for card in cards}

    def check_model(self, model: str | None) -> None:
        """A request naming another model than the one served (or an adapter) is a 404."""
        if model is not None and model != self.name and model not in self.adapters:
            raise UnknownModelError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """Every id must be in the vocabulary both the tokenizer and the model know."""
        if not ids or (min(ids) >= 0 and max(ids) < self.vocab_size):  # (no Python loop)
            return
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} in {param} is out of vocabulary "
                f"(valid ids are 0..{self.vocab_size - 1})",
                param,
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids (a string is encoded with the tokenizer's special tokens),
        checked: not empty, every id in the vocabulary."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        self.check_ids(ids, "prompt")
        return list(ids)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The messages, checked, rendered with the chat template (BOS included)."""
        check_messages(messages)
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools)

    def chat_prompt_ids(self, text: str) -> list[int]:
        """A rendered chat's token ids: special tokens are not added again."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """`messages` rendered with the tokenizer's chat template (BOS included); raises a 400."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("This model has no chat template: use /v1/completions.", "messages")
    dicts = template_messages(messages, has_developer_role="developer" in str(template))
    try:
        text = tokenizer.apply_chat_template(
            dicts, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        message = f"The chat template could not render these messages: {exc}"
        raise bad_request(message, "messages") from None
    return str(text)


def template_messages(
    messages: list[ChatMessage], has_developer_role: bool
) -> list[dict[str, Any]]:
    """The messages as dicts for `apply_chat_template`; developer becomes system where the
    template does not know the developer role; an assistant message's thinking is given as
    both `reasoning` and `reasoning_content` (its missing content as "")."""
    rendered = []
    for message in messages:
        item = msgspec.structs.asdict(message)
        item = {k: v for k, v in item.items() if v is not None or k == "content"}
        item["content"] = content_text(message.content)
        if message.role == "developer" and not has_developer_role:
            item["role"] = "system"
        reasoning = message.reasoning or message.reasoning_content
        if reasoning is not None:  # templates read one name or the other
            item["reasoning"] = item["reasoning_content"] = reasoning
            if item["content"] is None:
                item["content"] = ""
        rendered.append(item)
    return rendered


def content_text(content: str | list[ContentPart] | None) -> str | None:
    """A message's content as the chat template takes it: text parts joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    return "\n".join(part.text or "" for part in content)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text when `value` names a file, else the template itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        return path.read_text() if path.is_file() else value
    except OSError as exc:
        raise ValueError(f"--chat-template {value}: {exc}") from None


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the chat template names the `tools` variable at all (one that does not, such as
    the DeepSeek-R1 distills', renders the same prompt with or without tools)."""
    template = getattr(tokenizer, "chat_template", None)
    return bool(template) and re.search(r"\btools\b", str(template)) is not None


def use_chat_template(tokenizer: Any, template: str) -> None:
    """Make `template` the tokenizer's chat template (the light tokenizer keeps its templates
    by name; transformers' has one attribute)."""
    named = getattr(tokenizer, "chat_templates", None)
    if isinstance(named, dict):
        named["default"] = template
    else:
        tokenizer.chat_template = template
