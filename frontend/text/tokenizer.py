"""A light tokenizer for the frontends: `tokenizers` + jinja2, no torch, no transformers.

`FastTokenizer` is a `tokenizers.Tokenizer` with the interface of transformers 5.x's
`PreTrainedTokenizerFast` (TokenizersBackend): its encode, decode, special tokens, added tokens
and chat template rendering equal transformers' for the same files. It is built from the
tokenizer's settings (its init kwargs), which `tokenizer_loader.py` reads from a model's files
as transformers' `from_pretrained` does; `load_tokenizer` there is how a frontend gets one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from frontend.text.chat_template import pick_template, render_chat_template

__all__ = ["FastTokenizer"]

LONG_TEXT = 16 * 1024  # characters from which encode releases the GIL (see FastTokenizer.encode)
DEFAULT_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# The named special tokens, in transformers' order (special_tokens_map, all_special_tokens).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# apply_chat_template arguments that shape tokenization, never template variables.
_TOKENIZE_ONLY_ARGS = frozenset(
    {"padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs"}
)
# transformers' clean-up of "tokenization spaces" (WordPiece-era decoders leave " ." etc.).
_CLEAN_UP_PAIRS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_MAX_LENGTH = int(1e30)  # transformers' model_max_length when the config gives none

TokenSpec = str | AddedToken


class FastTokenizer:
    """A `tokenizers.Tokenizer` with the interface of transformers' PreTrainedTokenizerFast.

    Encode and decode are the Rust tokenizer's own; what this class adds is what transformers
    adds around it: the special tokens and their ids, the added tokens from the config, the
    clean-up of tokenization spaces, `len()`, and chat template rendering.
    """

    def __init__(
        self,
        backend: Tokenizer,
        settings: Mapping[str, Any],
        *,
        name_or_path: str = "",
        tokenizer_class: str = DEFAULT_TOKENIZER_CLASS,
    ) -> None:
        """`settings` are the tokenizer's init kwargs (`tokenizer_loader.tokenizer_settings`)."""
        self._tokenizer = backend
        self._encode_fast = getattr(backend, "encode_batch_fast", None)  # tokenizers >= 0.21
        self.init_kwargs: dict[str, Any] = dict(settings)
        self.name_or_path = name_or_path
        self.tokenizer_class = tokenizer_class
        kwargs = dict(settings)
        self._named_tokens, self._extra_tokens = _special_tokens(kwargs)
        max_length = kwargs.get("model_max_length", kwargs.get("max_len"))
        self.model_max_length: int = _MAX_LENGTH if max_length is None else max_length
        self.clean_up_tokenization_spaces: bool = bool(
            kwargs.get("clean_up_tokenization_spaces", False)
        )
        # transformers skips the clean-up for BPE models (it deletes real spaces) unless forced
        self._force_clean_up = bool(
            kwargs.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        )
        self.split_special_tokens: bool = bool(kwargs.get("split_special_tokens", False))
        self.chat_templates: dict[str, str] = _named_templates(kwargs.get("chat_template"))
        self._prepare_backend(kwargs.get("added_tokens_decoder") or {})

    def _prepare_backend(self, config_added: Mapping[int, AddedToken]) -> None:
        """Bring the Rust tokenizer to the state transformers leaves it in after loading."""
        backend = self._tokenizer
        # encode() never truncates nor pads unless asked (transformers turns both off per call)
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        backend.encode_special_tokens = self.split_special_tokens
        tokens = self._tokens_to_add(config_added)
        if tokens:
            backend.add_tokens(tokens)
        if backend.post_processor is None:  # transformers installs an empty template
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )

    def _tokens_to_add(self, config_added: Mapping[int, AddedToken]) -> list[AddedToken]:
        """What transformers adds to the Rust tokenizer on loading: the config's added tokens
        (all of them again: their flags win over tokenizer.json's), then the special tokens that
        are not added tokens yet. Special tokens given as strings, and named special tokens, are
        added as special."""
        queued: list[TokenSpec] = [token for _, token in sorted(config_added.items())]
        known = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        known.update(str(token) for token in queued)
        for token in [*self._named_tokens.values(), *self._extra_tokens]:
            if str(token) not in known and token not in queued:
                queued.append(token)
        named = {str(token) for token in self._named_tokens.values()}
        return [_as_special(token, named) for token in queued]

    # --- vocabulary -----------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The Rust tokenizer (DecodeStream and the logprob cache read it directly)."""
        return self._tokenizer

    @property
    def is_fast(self) -> bool:
        return True

    def __len__(self) -> int:
        """The vocabulary size with the added tokens."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def __bool__(self) -> bool:
        return True  # __len__ must not make a tokenizer falsy

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)})"

    @property
    def vocab_size(self) -> int:
        """The base vocabulary size, without the added tokens."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=False))

    def get_vocab(self) -> dict[str, int]:
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """id -> AddedToken (`.content`, `.special`, ...), as the Rust tokenizer holds them."""
        return dict(self._tokenizer.get_added_tokens_decoder())

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return {token.content: i for i, token in sorted(self.added_tokens_decoder.items())}

    def get_added_vocab(self) -> dict[str, int]:
        return self.added_tokens_encoder

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """A token's id (the unknown token's id when it is not in the vocabulary), or a list."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def _token_id(self, token: str) -> int | None:
        index = self._tokenizer.token_to_id(token)
        if index is not None:
            return int(index)
        unk = self._named_tokens.get("unk_token")
        if unk is None or str(unk) == token:
            return None
        return self._token_id(str(unk))

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> Any:
        """A token id's vocabulary string (None when out of range), or a list of them."""
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skipped]

    # --- special tokens -------------------------------------------------------------------

    def _named(self, name: str) -> str | None:
        token = self._named_tokens.get(name)
        return None if token is None else str(token)

    @property
    def bos_token(self) -> str | None:
        return self._named("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._named("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self._named("unk_token")

    @property
    def sep_token(self) -> str | None:
        return self._named("sep_token")

    @property
    def pad_token(self) -> str | None:
        return self._named("pad_token")

    @property
    def cls_token(self) -> str | None:
        return self._named("cls_token")

    @property
    def mask_token(self) -> str | None:
        return self._named("mask_token")

    def _named_id(self, name: str) -> int | None:
        token = self._named(name)
        return None if token is None else self._token_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_id("unk_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (model-specific ones such as image_token included) as
        strings; the chat template receives them as variables."""
        return {name: str(token) for name, token in self._named_tokens.items()}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(token) for token in self._extra_tokens]

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, each once."""
        tokens = [*self.special_tokens_map.values(), *self.extra_special_tokens]
        return list(dict.fromkeys(tokens))

    @property
    def all_special_ids(self) -> list[int | None]:
        return [self._token_id(token) for token in self.all_special_tokens]

    # --- encode / decode ------------------------------------------------------------------

    def encode(
        self, text: str, text_pair: str | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text` (and `text_pair`); `add_special_tokens` applies the
        post-processor (e.g. Llama 3's BOS)."""
        if not isinstance(text, str):
            raise ValueError("text input must be of type `str`")
        if text_pair:
            encoding = self._tokenizer.encode(
                text, text_pair, add_special_tokens=add_special_tokens
            )
        elif self._encode_fast is not None:  # no offsets: a quarter less CPU, the same ids;
            # like encode_batch it releases the GIL, so a long text tokenized on a worker
            # thread leaves the event loop free (encode holds it)
            encoding = self._encode_fast([text], add_special_tokens=add_special_tokens)[0]
        elif len(text) >= LONG_TEXT:  # (tokenizers without encode_batch_fast)
            batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            encoding = batch[0]
        else:
            encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """{"input_ids", "attention_mask"} of one text, the common case of transformers'."""
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).tokens)

    def decode(
        self,
        token_ids: int | Sequence[int] | Sequence[Sequence[int]],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """The text of `token_ids` (a list of texts for a batch of sequences).

        `skip_special_tokens` drops the tokens the Rust tokenizer marks special. Other keyword
        arguments (spaces_between_special_tokens...) are accepted and ignored, as transformers'
        fast tokenizers ignore them.
        """
        ids = _as_id_list(token_ids)
        if ids and isinstance(ids[0], (list, tuple)):
            return [
                self._decode(seq, skip_special_tokens, clean_up_tokenization_spaces) for seq in ids
            ]
        return self._decode(ids, skip_special_tokens, clean_up_tokenization_spaces)

    def batch_decode(
        self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False, **kwargs: Any
    ) -> list[str]:
        return [self._decode(_as_id_list(seq), skip_special_tokens, None) for seq in sequences]

    def _decode(self, ids: Any, skip_special_tokens: bool, clean_up: bool | None) -> str:
        text = str(self._tokenizer.decode([int(i) for i in ids], skip_special_tokens))
        if clean_up is None:
            clean_up = self.clean_up_tokenization_spaces
        if clean_up and (self._force_clean_up or not self._is_bpe()):
            text = clean_up_tokenization(text)
        return text

    def _is_bpe(self) -> bool:
        return type(self._tokenizer.model).__name__ == "BPE"

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return " ".join(tokens) if decoder is None else str(decoder.decode(tokens))

    # --- chat -----------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the model has none, or only named ones)."""
        return self.chat_templates.get("default")

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template `apply_chat_template` renders: `chat_template` (a whole template or the
        name of one), else "tool_use" when tools are given and the model has it, else the
        default. Raises ValueError when there is none."""
        return pick_template(self.chat_templates, chat_template, tools)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        sanitize_control_tokens: bool = False,
        **kwargs: Any,
    ) -> Any:
        """`conversation` (a list of message dicts) rendered with the chat template, as
        transformers renders it: the text when `tokenize` is False; otherwise its ids, encoded
        without adding special tokens (as {"input_ids", "attention_mask"} if `return_dict`).

        The template sees messages, tools, documents, add_generation_prompt, the special tokens
        (bos_token, eos_token, ...) and every other keyword argument. Raises
        jinja2.TemplateError (a template's raise_exception included), TypeError or ValueError.
        """
        if return_assistant_tokens_mask or sanitize_control_tokens:
            raise ValueError(
                "return_assistant_tokens_mask and sanitize_control_tokens are not supported"
            )
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        variables = {k: v for k, v in kwargs.items() if k not in _TOKENIZE_ONLY_ARGS}
        text = render_chat_template(
            template,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **variables},
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        if return_dict:
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        return ids


def _special_tokens(kwargs: Mapping[str, Any]) -> tuple[dict[str, TokenSpec], list[TokenSpec]]:
    """The named special tokens (standard names first, then model-specific ones such as
    image_token, in transformers' order) and the extra special tokens, from the init kwargs."""
    standard: dict[str, TokenSpec] = {}
    from_extra: dict[str, Any] = {}
    found: dict[str, Any] = {}  # other *_token settings that hold a token
    extras: list[TokenSpec] = []
    for key, value in kwargs.items():
        if key in SPECIAL_TOKEN_NAMES:
            token = _token_spec(value, key)
            if token is not None:
                standard[key] = token
        elif key == "extra_special_tokens" and isinstance(value, dict):
            from_extra.update(value)
        elif key == "extra_special_tokens" and value is not None:
            if not isinstance(value, (list, tuple)):
                raise TypeError("extra_special_tokens must be a list of tokens or a dict")
            extras = [t for t in (_token_spec(v, key) for v in value) if t is not None]
        elif key.endswith("_token") and isinstance(value, (str, AddedToken)):
            found[key] = value
    specific = {**from_extra, **found, **(kwargs.get("model_specific_special_tokens") or {})}
    named = dict(standard)
    for key, value in specific.items():
        token = _token_spec(value, key)
        if token is not None:
            named[key] = token
    return named, extras


def _token_spec(value: Any, name: str) -> TokenSpec | None:
    """A special token as a str or an AddedToken; a plain {"content": ...} dict is accepted too."""
    if value is None or isinstance(value, (str, AddedToken)):
        return value
    if isinstance(value, dict) and "content" in value:
        return added_token(value)
    raise TypeError(f"Special token {name} has to be either str or AddedToken but got {value!r}")


def added_token(token: Any) -> AddedToken:
    """An AddedToken, or one from its dict in a config (the `__type` tag left out)."""
    if isinstance(token, AddedToken):
        return token
    if isinstance(token, dict):
        fields = {k: v for k, v in token.items() if k != "__type"}
        return AddedToken(**fields)
    raise TypeError(f"an added token must be a dict or an AddedToken, got {token!r}")


def _as_special(token: TokenSpec, named: set[str]) -> AddedToken:
    """A token to add: strings become special AddedTokens; named special tokens are special."""
    if isinstance(token, str):
        return AddedToken(token, special=True)
    if not token.special and token.content in named:
        token.special = True
    return token


def _named_templates(value: Any) -> dict[str, str]:
    """The chat templates by name: a single template is "default"; a config's list of
    {"name", "template"} or a dict of templates keep their names."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {str(item["name"]): str(item["template"]) for item in value}
    raise TypeError(f"chat_template must be a string, a list or a dict, got {type(value).__name__}")


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces that word-piece decoders leave before punctuation."""
    for before, after in _CLEAN_UP_PAIRS:
        text = text.replace(before, after)
    return text


def _as_id_list(token_ids: Any) -> Any:
    """Token ids as Python ints/lists (numpy arrays and tensors have tolist())."""
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
        return [token_ids] if isinstance(token_ids, int) else token_ids
    return list(token_ids)
