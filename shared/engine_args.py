"""Engine command-line flags, shared by `tandem engine` and `tandem serve` (vLLM's names).

Pure argparse: the launcher parses these without importing torch, then passes them on to the
engine process unchanged (`engine_argv`).
"""

from __future__ import annotations

import argparse

_ENGINE_FLAGS = (
    ("--served-model-name", {
        "default": None, "help": "model name the API answers to (default: MODEL)"}),
    ("--tokenizer", {
        "default": None, "help": "tokenizer folder or hub id (default: MODEL)"}),
    ("--max-model-len", {
        "type": int, "default": None, "help": "context length (default: the model's)"}),
    ("--max-num-seqs", {
        "type": int, "default": 128, "help": "most requests running at once"}),
    ("--max-num-batched-tokens", {
        "type": int, "default": None,
        "help": "token budget of one step; longer prompts are chunked (default: 2048 on CUDA; "
                "on CPU a quarter of the queued prompt tokens, between 512 and 2048)"}),
    ("--max-waiting-requests", {
        "type": int, "default": 1024,
        "help": "most requests queued for a slot; beyond it new requests get 503 with "
                "Retry-After"}),
    ("--block-size", {
        "type": int, "default": 16, "help": "tokens per KV-cache block"}),
    ("--kv-cache-memory", {
        "type": int, "default": None,
        "help": "KV cache size in bytes (default: 2 GiB on CPU, 80%% of free on CUDA)"}),
    ("--num-kv-blocks", {
        "type": int, "default": None,
        "help": "exact number of KV blocks (wins over --kv-cache-memory)"}),
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
        "help": "torch CPU threads of the engine (tandem serve: cores minus frontends)"}),
    ("--trust-remote-code", {
        "action": "store_true", "help": "allow model code from the model folder"}),
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flag, kwargs in _ENGINE_FLAGS:
        group.add_argument(flag, **kwargs)  # type: ignore[arg-type]


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of parsed `args`, as a command line for the engine process."""
    argv: list[str] = []
    for flag, kwargs in _ENGINE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kwargs.get("action") == "store_true":
            argv += [flag] if value else []
        elif kwargs.get("action") is argparse.BooleanOptionalAction:
            argv += [flag if value else "--no-" + flag[2:]]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
