"""Loading a tokenizer: `load_tokenizer(name_or_path)`, for a local folder or a hub id.

A folder with a `tokenizer.json` gives a `FastTokenizer` (tokenizer.py), with the settings around
it (tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
additional_chat_templates/*.jinja) read the way transformers 5.x's `AutoTokenizer` reads them for
a `PreTrainedTokenizerFast` (`tokenizer_settings`). A model without a tokenizer.json (a slow,
SentencePiece or tiktoken-only tokenizer) is loaded by transformers' AutoTokenizer instead: that
fallback is the only place that imports transformers (and with it torch).

A hub id (not a local folder) is fetched with huggingface_hub (imported lazily; it does not
import torch): the tokenizer files of one commit, from the HF cache when offline.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from frontend.text.tokenizer import (
    DEFAULT_TOKENIZER_CLASS,
    SPECIAL_TOKEN_NAMES,
    FastTokenizer,
    added_token,
)

__all__ = ["load_tokenizer", "tokenizer_from_folder", "tokenizer_settings"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
PROCESSOR_CHAT_TEMPLATE_FILE = "chat_template.json"  # a processor's template (legacy format)
HUB_FILES = [
    TOKENIZER_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    PROCESSOR_CHAT_TEMPLATE_FILE,
    f"{CHAT_TEMPLATE_DIR}/*.jinja",
]


# --- loading ------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a local folder or a hub id.

    A FastTokenizer when there is a tokenizer.json; otherwise, or when the light path fails for
    a reason other than the network, transformers' AutoTokenizer (which imports torch). Network
    errors (offline with nothing cached, Hub unreachable) are raised as huggingface_hub raises
    them. The result always has a `tokenizer_class` attribute (tokenizer_config.json's).
    """
    folder = Path(name_or_path)
    if folder.is_dir():
        return _load_folder(folder, None, name_or_path)
    try:
        snapshot = _download(name_or_path)
    except Exception as exc:  # noqa: BLE001 - network errors are raised, others fall back
        if _is_network_error(exc):
            raise
        return _load_with_transformers(name_or_path)
    return _load_folder(Path(snapshot), name_or_path, name_or_path)


def _load_folder(folder: Path, hub_id: str | None, name_or_path: str) -> Any:
    if not (folder / TOKENIZER_FILE).is_file():
        return _load_with_transformers(name_or_path)
    try:
        return tokenizer_from_folder(folder, hub_id)
    except Exception:  # noqa: BLE001 - anything this loader does not understand: transformers
        return _load_with_transformers(name_or_path)


def tokenizer_from_folder(
    folder: str | os.PathLike[str], name_or_path: str | None = None
) -> FastTokenizer:
    """The tokenizer in `folder` (which must hold a tokenizer.json); `name_or_path` is the
    name it was asked for (a hub id), by default the folder itself."""
    path = Path(folder)
    name = str(folder) if name_or_path is None else name_or_path
    backend = Tokenizer.from_file(str(path / TOKENIZER_FILE))
    config = _read_json(path / CONFIG_FILE) or {}
    tokenizer_class = str(config.get("tokenizer_class") or DEFAULT_TOKENIZER_CLASS)
    settings = tokenizer_settings(
        path, config, backend, name_or_path=name, is_local=name_or_path is None
    )
    return FastTokenizer(backend, settings, name_or_path=name, tokenizer_class=tokenizer_class)


def _download(repo_id: str) -> str:
    """The local snapshot folder with the tokenizer files of `repo_id` (one commit), downloaded
    or, offline, from the HF cache."""
    from huggingface_hub import snapshot_download

    return str(snapshot_download(repo_id, allow_patterns=HUB_FILES))


_NETWORK_MODULES = re.compile(r"^(httpx|httpcore|requests|urllib3)")


def _is_network_error(exc: BaseException) -> bool:
    """True for failures to reach the Hub, which transformers could not get past either:
    huggingface_hub's LocalEntryNotFoundError ("not cached, and the Hub cannot be reached", or
    offline mode), connection errors and timeouts, and the HTTP clients' own errors."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return any(
        cls.__name__ == "LocalEntryNotFoundError" or _NETWORK_MODULES.match(cls.__module__)
        for cls in type(exc).__mro__
    )


def _load_with_transformers(name_or_path: str) -> Any:
    """transformers' AutoTokenizer: the only import of transformers (and torch) in this module."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    config = dict(getattr(tokenizer, "init_kwargs", {}) or {})
    declared = _declared_class(name_or_path) or config.get("tokenizer_class")
    tokenizer.tokenizer_class = str(declared or type(tokenizer).__name__)
    return tokenizer


def _declared_class(name_or_path: str) -> str | None:
    """tokenizer_config.json's tokenizer_class for a local folder, when it names one."""
    config = _read_json(Path(name_or_path) / CONFIG_FILE) if Path(name_or_path).is_dir() else None
    value = (config or {}).get("tokenizer_class")
    return str(value) if value else None


# --- settings, as transformers' from_pretrained builds them ---------------------------------


def tokenizer_settings(
    folder: Path,
    config: Mapping[str, Any],
    backend: Tokenizer,
    *,
    name_or_path: str,
    is_local: bool,
) -> dict[str, Any]:
    """The tokenizer's init kwargs (transformers' `init_kwargs`) for a folder with a
    tokenizer.json: tokenizer_config.json's settings, with the chat template files applied, the
    special tokens as AddedTokens where they are added tokens, and the loader's own keys."""
    kwargs = {k: v for k, v in config.items() if k not in ("tokenizer_class", "init_inputs")}
    # With a tokenizer.json its post-processor decides about BOS/EOS, not these flags
    kwargs.pop("add_bos_token", None)
    kwargs.pop("add_eos_token", None)
    _apply_template_files(kwargs, folder)
    _move_model_specific_tokens(kwargs)
    kwargs["vocab_file"] = None
    kwargs["name_or_path"] = name_or_path
    kwargs["is_local"] = is_local
    kwargs["local_files_only"] = False
    added_tokens = _added_tokens(kwargs, folder, backend)
    kwargs["added_tokens_decoder"] = added_tokens
    kwargs = dict(_typed_added_tokens(kwargs))
    by_content = {token.content: token for token in added_tokens.values()}
    for name in SPECIAL_TOKEN_NAMES:  # the special tokens share the added tokens' flags
        value = kwargs.get(name)
        if value is not None and by_content and not isinstance(value, dict):
            kwargs[name] = by_content.get(str(value), value)
    _apply_backend_settings(kwargs, backend)
    if "additional_special_tokens" in kwargs and "extra_special_tokens" not in kwargs:
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    return kwargs


def _apply_template_files(kwargs: dict[str, Any], folder: Path) -> None:
    """chat_template.jinja ("default") and additional_chat_templates/NAME.jinja take priority
    over the config's template. A processor's chat_template.json is read only when there is no
    template at all (transformers' tokenizer never reads it; its processor does)."""
    templates: dict[str, str] = {}
    default = folder / CHAT_TEMPLATE_FILE
    if default.is_file():
        templates["default"] = default.read_text(encoding="utf-8")
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if set(templates) == {"default"}:
        kwargs["chat_template"] = templates["default"]
    elif templates:
        kwargs["chat_template"] = templates
    elif not kwargs.get("chat_template"):
        processor = _read_json(folder / PROCESSOR_CHAT_TEMPLATE_FILE) or {}
        if isinstance(processor.get("chat_template"), str):
            kwargs["chat_template"] = processor["chat_template"]


def _move_model_specific_tokens(kwargs: dict[str, Any]) -> None:
    """Model-specific special tokens (image_token...) and a dict of extra special tokens go to
    model_specific_special_tokens; additional_special_tokens is the old name of the extra list."""
    if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
        kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
    specific = {
        key: kwargs.pop(key)
        for key in list(kwargs)
        if key not in SPECIAL_TOKEN_NAMES
        and key.endswith("_token")
        and isinstance(kwargs[key], str)
    }
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        specific.update(kwargs.pop("extra_special_tokens"))
    if specific:
        kwargs["model_specific_special_tokens"] = specific


def _added_tokens(
    kwargs: dict[str, Any], folder: Path, backend: Tokenizer
) -> dict[int, AddedToken]:
    """id -> AddedToken: the config's added_tokens_decoder when it has one; otherwise
    tokenizer.json's added tokens, and special_tokens_map.json's tokens go into `kwargs`."""
    if "added_tokens_decoder" in kwargs:
        return {int(i): added_token(token) for i, token in kwargs["added_tokens_decoder"].items()}
    special_map = _read_json(folder / SPECIAL_TOKENS_MAP_FILE) or {}
    for key, value in special_map.items():
        if key == "extra_special_tokens" and isinstance(value, list):
            merged = list(kwargs.get("extra_special_tokens") or [])
            for token in value:
                token = _special_added_token(token) if isinstance(token, dict) else token
                if token not in merged:
                    merged.append(token)
            kwargs[key] = merged
        elif isinstance(value, dict):
            kwargs[key] = _special_added_token(value)
        else:
            kwargs[key] = value
    if isinstance(kwargs.get("extra_special_tokens"), dict):
        specific = kwargs.setdefault("model_specific_special_tokens", {})
        specific.update(kwargs.pop("extra_special_tokens"))
    return dict(backend.get_added_tokens_decoder())


def _special_added_token(value: Mapping[str, Any]) -> AddedToken:
    fields = {k: v for k, v in value.items() if k not in ("special", "__type")}
    return AddedToken(**fields, special=True)


def _typed_added_tokens(value: Any) -> Any:
    """Dicts tagged {"__type": "AddedToken", ...} (how configs serialize tokens) as AddedTokens."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return added_token(value)
    if isinstance(value, (list, tuple)):
        return [_typed_added_tokens(item) for item in value]
    if isinstance(value, dict):
        return {key: _typed_added_tokens(item) for key, item in value.items()}
    return value


def _apply_backend_settings(kwargs: dict[str, Any], backend: Tokenizer) -> None:
    """tokenizer.json's truncation and padding settings fill the matching init kwargs."""
    truncation = backend.truncation
    if truncation is not None:
        kwargs.setdefault("max_length", truncation["max_length"])
        kwargs.setdefault("truncation_side", truncation["direction"])
        kwargs.setdefault("stride", truncation["stride"])
        kwargs.setdefault("truncation_strategy", truncation["strategy"])
    padding = backend.padding
    if padding is not None:
        kwargs.setdefault("pad_token", padding["pad_token"])
        kwargs.setdefault("pad_token_type_id", padding["pad_type_id"])
        kwargs.setdefault("padding_side", padding["direction"])
        kwargs.setdefault("max_length", padding["length"])
        kwargs.setdefault("pad_to_multiple_of", padding["pad_to_multiple_of"])
    kwargs.setdefault("backend", "tokenizers")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else None
