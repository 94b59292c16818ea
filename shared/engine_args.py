"""Engine command-line flags, shared by `tandem engine` and `tandem serve` (vLLM's names).

Pure argparse: the launcher parses these without importing torch, then passes them on to the
engine process unchanged (`engine_argv`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import msgspec

from shared.kv_events import FORMATS, KvEventsConfigError, parse_kv_events_config
from shared.messages import MAX_LOGPROBS, Pooling
from shared.speculative import SpeculativeConfigError, parse_speculative_config

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # engine_core/quant/fp8_kv.py stores fp8


# -- --lora-modules (vLLM's forms), checked without torch; the engine reads the adapters
# themselves (engine_core/lora/)
class LoRAModulesError(ValueError):
    """A `--lora-modules` value that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAModule:
    """An adapter the server knows: the name requests use as their `model`, its folder."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """vLLM's `--lora-modules` values: `name=path` or `{"name": ..., "path": ...,
    "base_model_name": ...}`; raises LoRAModulesError."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                given = json.loads(value)
                module = LoRAModule(str(given["name"]), str(given["path"]),
                                    given.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise LoRAModulesError(f"--lora-modules {value!r}: a JSON module needs "
                                       f"\"name\" and \"path\" ({exc})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise LoRAModulesError(f"--lora-modules {value!r}: name=path or JSON")
            module = LoRAModule(name, path)
        modules.append(module)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise LoRAModulesError(f"--lora-modules: a name given twice ({', '.join(names)})")
    return tuple(modules)


# -- --runner, --convert and --pooler-config: how a server embeds (vLLM's flags). `--runner
# pooling --convert embed` serves a decoder as an embedding model, as vLLM does: each input's
# final hidden states pooled into one vector (/v1/embeddings), nothing generated; the default
# runner ("generate") serves generation and embeds as well. The pooler is vLLM's
# `--pooler-config` JSON (LAST normalized by default); the engine pools
# (engine_core/sample/pooling.py).
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed", "none")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's `--pooler-config` keys that Tandem serves (vLLM's later names beside them)."""

    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None


class PoolerConfigError(ValueError):
    """A `--pooler-config` (or runner / convert) that cannot be served; the message says why."""


def parse_pooler_config(text: str | None) -> Pooling:
    """`--pooler-config JSON` (None: the defaults) as the pooling every embedding request gets
    unless it says otherwise; raises PoolerConfigError."""
    if text is None:
        return Pooling()
    try:
        config = msgspec.json.decode(text, type=PoolerConfig)
    except msgspec.DecodeError as exc:
        raise PoolerConfigError(
            f"--pooler-config: {exc} (Tandem serves the keys pooling_type and normalize)"
        ) from None
    kind = (config.pooling_type or config.seq_pooling_type or "LAST").upper()
    if kind not in POOLING_TYPES:
        raise PoolerConfigError(f"--pooler-config: pooling_type {kind!r} is not served; "
                                f"choose one of {', '.join(POOLING_TYPES)}")
    normalize = config.normalize if config.normalize is not None else config.use_activation
    return Pooling(kind.lower(), True if normalize is None else normalize)


def check_runner(runner: str, convert: str) -> str:
    """The runner `--runner`/`--convert` ask for ("generate" or "pooling"); raises
    PoolerConfigError for a conversion other than to an embedding model."""
    if runner not in RUNNERS:
        raise PoolerConfigError(f"--runner {runner!r}: choose one of {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise PoolerConfigError(f"--convert {convert!r}: Tandem converts a decoder to an "
                                "embedding model only (--convert embed)")
    if runner == "generate" and convert == "embed":
        raise PoolerConfigError("--convert embed needs --runner pooling")
    if runner == "pooling" and convert == "none":
        raise PoolerConfigError("--runner pooling --convert none: Tandem's models are decoders; "
                                "pool them with --convert embed")
    return "pooling" if runner == "pooling" else "generate"

_ENGINE_FLAGS = (
    ("--served-model-name", {
        "default": None, "help": "model name the API answers to (default: MODEL)"}),
    ("--tokenizer", {
        "default": None, "help": "tokenizer folder or hub id (default: MODEL)"}),
    ("--max-model-len", {
        "type": int, "default": None, "help": "context length (default: the model's)"}),
    ("--max-num-seqs", {
        "type": int, "default": None,
        "help": "most requests running at once (default: 128 on CPU; on CUDA vLLM's 1024 on a "
                "GPU of 70 GiB or more other than an A100, else 256)"}),
    ("--max-num-batched-tokens", {
        "type": int, "default": None,
        "help": "token budget of one step; longer prompts are chunked (default: on CUDA 8192 "
                "where --max-num-seqs defaults to 1024, else 2048; on CPU a quarter of the "
                "queued prompt tokens, between 512 and 2048)"}),
    ("--max-waiting-requests", {
        "type": int, "default": 1024,
        "help": "most requests queued for a slot; beyond it new requests get 503 with "
                "Retry-After"}),
    ("--block-size", {
        "type": int, "default": 16, "help": "tokens per KV-cache block"}),
    (("--kv-cache-memory", "--kv-cache-memory-bytes"), {
        "type": int, "default": None,
        "help": "KV cache size in bytes (default: 2 GiB on CPU; on CUDA what "
                "--gpu-memory-utilization leaves)"}),
    (("--num-kv-blocks", "--num-gpu-blocks-override"), {
        "type": int, "default": None,
        "help": "exact number of KV blocks (wins over --kv-cache-memory)"}),
    ("--gpu-memory-utilization", {
        "type": float, "default": None,
        "help": "share of the GPU's whole memory the engine may hold (weights, activations, "
                "KV cache), as vLLM defines it; the KV cache gets what a profiled step at the "
                "largest budget leaves (default: 0.9)"}),
    ("--kv-cache-dtype", {
        "default": "auto",
        "help": "the KV cache's element type: auto (the model's dtype), fp8 or fp8_e4m3 "
                "(float8 e4m3: twice the tokens of bf16 in the same memory; one scale per "
                "layer for K and one for V, from the checkpoint's k_scale/v_scale where it has "
                "them, else 1.0 or --calculate-kv-scales)"}),
    ("--calculate-kv-scales", {
        "action": "store_true",
        "help": "with an fp8 KV cache and no scales in the checkpoint: each layer's scales "
                "from the first batch's K and V (|K|max / 200, |V|max / 100, as vLLM)"}),
    ("--enable-prefix-caching", {
        "action": argparse.BooleanOptionalAction, "default": True,
        "help": "reuse KV blocks of shared prompt prefixes"}),
    ("--dtype", {
        "default": "auto", "choices": ["auto", "float32", "bfloat16", "float16"],
        "help": "auto = float32 on CPU, bfloat16 on CUDA"}),
    ("--device", {
        "default": "auto", "choices": ["auto", "cpu", "cuda"], "help": "where the model runs"}),
    ("--seed", {
        "type": int, "default": 0, "help": "seed of the engine's sampler for unseeded requests"}),
    ("--num-threads", {
        "type": int, "default": None,
        "help": ("torch CPU threads of the engine; default: each step on all usable cores or one "
                 "fewer, whichever that size of step has measured faster")}),
    ("--model-impl", {
        "default": "auto", "choices": ["auto", "tandem", "vllm", "transformers"],
        "help": "auto: Tandem's own model file where it has one for the architecture (Llama, "
                "Mistral without a sliding window, Qwen2, Qwen3), else transformers' module "
                "tree; tandem (or vLLM's word, vllm) insists on the own file, transformers on "
                "transformers"}),
    ("--trust-remote-code", {
        "action": "store_true", "help": "allow model code from the model folder"}),
    ("--generation-config", {
        "default": "auto",
        "help": "where requests' sampling defaults come from: 'auto', the model's "
                "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty "
                "for the fields a request leaves out, as vLLM does); 'vllm', OpenAI's defaults; "
                "or a folder holding a generation_config.json"}),
    ("--tensor-parallel-size", {
        "type": int, "default": 1,
        "help": "ranks one model is split over (Megatron-style, on torch.distributed: one GPU "
                "each on CUDA, gloo processes on the CPU); the engine is rank 0"}),
    ("--runner", {
        "default": "auto", "choices": ["auto", "generate", "pooling"],
        "help": "pooling: serve the model as an embedding model (/v1/embeddings only, as "
                "vLLM's); auto and generate: generation, and /v1/embeddings beside it"}),
    ("--convert", {
        "default": "auto", "choices": ["auto", "embed", "none"],
        "help": "with --runner pooling: embed (auto's choice) pools a decoder's final hidden "
                "states into embeddings; none only with the generate runner"}),
    ("--pooler-config", {
        "default": None,
        "help": "how embeddings pool, vLLM's JSON: '{\"pooling_type\": \"LAST\", "
                "\"normalize\": true}' (LAST, MEAN or CLS; default LAST, normalized)"}),
    ("--enable-lora", {
        "action": "store_true",
        "help": "serve LoRA adapters (peft's format) on the base model: a request names one "
                "as its model; rows of several adapters and the base model share a batch"}),
    ("--lora-modules", {
        "nargs": "+", "default": None, "metavar": "NAME=PATH",
        "help": "the adapters, vLLM's forms: name=path, or JSON '{\"name\": ..., "
                "\"path\": ..., \"base_model_name\": ...}'"}),
    ("--max-loras", {
        "type": int, "default": 1,
        "help": "adapters on the device at once; a request whose adapter has no slot waits"}),
    ("--max-lora-rank", {
        "type": int, "default": 16, "help": "the largest adapter rank served"}),
    ("--max-cpu-loras", {
        "type": int, "default": None,
        "help": "adapters kept in host memory (default: --max-loras), the rest read again "
                "from their folder when needed"}),
    (("--quantization", "-q"), {
        "default": None, "choices": ["fp8"],
        "help": "fp8: the decoder's linear weights quantized to fp8 (e4m3, a scale per output "
                "channel) as they load, activations per token, products on the fp8 GEMM of a "
                "GPU of compute capability 8.9+ (elsewhere dequantized per product: correct, "
                "not fast). An fp8 checkpoint (compressed-tensors float-quantized, or fp8) "
                "loads as it is stored, with or without this flag"}),
    ("--kv-events-config", {
        "default": None,
        "help": "publish the prefix cache's changes as vLLM's KV-cache events, for external "
                "routers: vLLM's JSON keys, e.g. '{\"enable_kv_cache_events\": true, "
                "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}' "
                "(each data-parallel rank adds its rank to the ports)"}),
    ("--kv-events-format", {
        "default": "map", "choices": list(FORMATS),
        "help": "the KV-cache events' msgpack form: 'map', vLLM 0.32's bytes (each event a map "
                "tagged by \"type\", as vLLM 0.26 and later send); 'array', the positional "
                "arrays of older vLLM, and a replay without the topic frame, for consumers that "
                "read only those (llm-d-kv-cache before v0.9.0)"}),
    ("--speculative-config", {
        "default": None,
        "help": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                "\"prompt_lookup_min\": 2}' (proposals from the request's own tokens) or "
                "'{\"model\": PATH, \"num_speculative_tokens\": 4}' (a draft model with the "
                "same tokenizer); outputs keep the model's distribution"}),
    ("--max-logprobs", {
        "type": int, "default": None,
        "help": "most logprobs a request may ask for (default and most: 20)"}),
    ("--enforce-eager", {
        "action": "store_true",
        "help": "no CUDA graphs: every decode step runs eagerly (default: decode-only steps "
                "replay graphs captured at start-up)"}),
    ("--cuda-graph-sizes", {
        "type": int, "nargs": "+", "default": None,
        "help": "batch sizes of the decode steps' CUDA graphs (default: 1 2 4 8 16 24 ... up "
                "to --max-num-seqs, at most 512)"}),
    ("--async-scheduling", {
        "action": argparse.BooleanOptionalAction, "default": None,
        "help": "overlapped steps: the next step is scheduled and prepared while the device "
                "runs this one (default: on with CUDA, off on the CPU)"}),
    # vLLM flags accepted so its command lines start; each says what it does here.
    ("--enable-chunked-prefill", {
        "action": argparse.BooleanOptionalAction, "default": True,
        "help": "no-op: prefills are always chunked under the step budget"}),
    ("--disable-log-stats", {
        "action": "store_true",
        "help": "no periodic stats line in the engine's log (throughput, queue, KV cache, "
                "prefix hits, speculative decoding's acceptance; every 10 s while it works)"}),
)


def _names(flags: str | tuple[str, ...]) -> tuple[str, ...]:
    return (flags,) if isinstance(flags, str) else flags


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flags, kwargs in _ENGINE_FLAGS:
        group.add_argument(*_names(flags), **kwargs)  # type: ignore[arg-type]


def check_engine_args(args: argparse.Namespace) -> str | None:
    """What is wrong with engine flags that parse but cannot be served, or None."""
    if args.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {args.tensor_parallel_size}: at least 1"
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        return (f"--kv-cache-dtype {args.kv_cache_dtype!r} is not supported: choose auto (the "
                "model's dtype), fp8 or fp8_e4m3 (float8 e4m3)")
    if args.calculate_kv_scales and args.kv_cache_dtype == "auto":
        return "--calculate-kv-scales needs an fp8 KV cache: add --kv-cache-dtype fp8"
    if args.max_logprobs is not None and not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        return f"--max-logprobs {args.max_logprobs}: between 0 and {MAX_LOGPROBS}"
    utilization = args.gpu_memory_utilization
    if utilization is not None and not 0 < utilization <= 1:
        return f"--gpu-memory-utilization {utilization}: a share in (0, 1]"
    if args.speculative_config is not None:
        try:
            parse_speculative_config(args.speculative_config)
        except SpeculativeConfigError as exc:
            return str(exc)
    if args.lora_modules and not args.enable_lora:
        return "--lora-modules needs --enable-lora"
    if args.enable_lora and args.tensor_parallel_size > 1:
        return "--enable-lora: not yet with --tensor-parallel-size above 1"
    try:
        parse_lora_modules(args.lora_modules)
    except LoRAModulesError as exc:
        return str(exc)
    try:
        check_runner(args.runner, args.convert)
        parse_pooler_config(args.pooler_config)
    except PoolerConfigError as exc:
        return str(exc)
    if args.kv_events_config is not None:
        try:
            parse_kv_events_config(args.kv_events_config)
        except KvEventsConfigError as exc:
            return str(exc)
    return None


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of parsed `args`, as a command line for the engine process."""
    argv: list[str] = []
    for flags, kwargs in _ENGINE_FLAGS:
        flag = _names(flags)[0]
        value = getattr(args, flag[2:].replace("-", "_"))
        if kwargs.get("action") == "store_true":
            argv += [flag] if value else []
        elif kwargs.get("action") is argparse.BooleanOptionalAction:
            if value is not None:
                argv += [flag if value else "--no-" + flag[2:]]
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
