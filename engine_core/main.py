"""`tandem engine MODEL --listen ADDR`: run the engine core alone (also `python -m engine_core`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from shared.argv import ConfigFileError, normalize
from shared.curve import CurveKeyError, open_engine_refusal, server_keys
from shared.engine_args import (
    add_engine_args,
    check_engine_args,
    check_runner,
    parse_lora_modules,
    parse_pooler_config,
)
from shared.kv_events import parse_kv_events_config
from shared.messages import LoRACard, Ready
from shared.speculative import parse_speculative_config

if TYPE_CHECKING:  # the engine's modules import torch: only once the arguments are parsed
    from engine_core.config import EngineConfig
    from engine_core.worker.model_runner import ModelFacts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem engine", description=__doc__)
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder or hub id, or a built-in model: "
                             "tandem-tiny-llama (the default), tandem-tiny-qwen2, "
                             "tandem-qwen2.5-0.5b-shape, tandem-llama3.2-1b-shape (random "
                             "weights, built on first use)")
    parser.add_argument("--listen", default="tcp://127.0.0.1:5570",
                        help="ZeroMQ address to bind, tcp://HOST:PORT or ipc://PATH")
    parser.add_argument("--curve-keys", default=os.environ.get("TANDEM_CURVE_KEYS"),
                        help="folder from `tandem keys`: admit only frontends holding a listed "
                             "keypair (CURVE; for tcp:// beyond loopback; default: "
                             "$TANDEM_CURVE_KEYS)")
    parser.add_argument("--data-parallel-rank", type=int, default=0,
                        help="this engine's rank among the engines behind the same frontends "
                             "(vLLM's flag): its label in metrics, its KV-event ports' offset, "
                             "the X-data-parallel-rank that pins a request to it")
    parser.add_argument("--allow-unauthenticated-engine", action="store_true",
                        help="listen on a tcp:// address beyond loopback without --curve-keys "
                             "(refused otherwise): only on a network you trust")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = normalize(sys.argv[1:] if argv is None else argv, parser)
    except ConfigFileError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    problem = check_engine_args(args)
    if problem is not None:
        parser.error(problem)
    if args.data_parallel_rank < 0:
        parser.error(f"--data-parallel-rank {args.data_parallel_rank}: 0 or more")
    refusal = open_engine_refusal(args.listen, args.curve_keys, args.allow_unauthenticated_engine)
    if refusal is not None:
        parser.error(refusal)
    if args.curve_keys is not None:
        try:
            server_keys(args.curve_keys)  # before the model loads: a wrong folder fails at once
        except CurveKeyError as exc:
            parser.error(str(exc))
    log_format = f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    from engine_core.config import EngineConfig
    from engine_core.engine import EngineCore
    from engine_core.process import serve
    from engine_core.worker.default_model import resolve_model

    # A built-in model answers to its own name, not to the folder it was built in.
    model, builtin_name = resolve_model(args.model)
    served_name = args.served_model_name or builtin_name
    try:
        config = EngineConfig(
            model=model, served_model_name=served_name, tokenizer=args.tokenizer,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            max_waiting_requests=args.max_waiting_requests,
            kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization, max_logprobs=args.max_logprobs,
            generation_config=args.generation_config,
            enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype, device=args.device,
            seed=args.seed, num_threads=args.num_threads, trust_remote_code=args.trust_remote_code,
            model_impl="tandem" if args.model_impl == "vllm" else args.model_impl,
            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
            speculative=(None if args.speculative_config is None
                         else parse_speculative_config(args.speculative_config)),
            cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
            tensor_parallel_size=args.tensor_parallel_size,
            runner=check_runner(args.runner, args.convert),
            pooler=parse_pooler_config(args.pooler_config),
            enable_lora=args.enable_lora, lora_modules=parse_lora_modules(args.lora_modules),
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            max_cpu_loras=args.max_cpu_loras, quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales)
        core = EngineCore(config)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tandem engine: cannot start: {e}", file=sys.stderr)
        return 2
    kv_events = (None if args.kv_events_config is None
                 else parse_kv_events_config(args.kv_events_config))
    ready = ready_message(config, core.facts, args.data_parallel_rank)
    return serve(core, args.listen, ready, args.curve_keys, kv_events, args.kv_events_format,
                 log_stats=not args.disable_log_stats)


def ready_message(config: EngineConfig, facts: ModelFacts, rank: int = 0) -> Ready:
    """The handshake answer: the names the API serves, and the model facts a frontend needs."""
    return Ready(model=config.served_model_name or config.model,
                 tokenizer=config.tokenizer or config.model, max_model_len=facts.max_model_len,
                 vocab_size=facts.vocab_size, eos_token_ids=list(facts.eos_token_ids),
                 bos_token_id=facts.bos_token_id, engine_pid=os.getpid(),
                 sampling_defaults=dict(facts.sampling_defaults), data_parallel_rank=rank,
                 block_size=config.block_size,
                 num_speculative_tokens=(config.speculative.num_speculative_tokens
                                         if config.speculative else 0),
                 runner=config.runner, pooler=config.pooler, hidden_size=facts.hidden_size,
                 matryoshka_dimensions=(None if facts.matryoshka_dimensions is None
                                        else list(facts.matryoshka_dimensions)),
                 lora_adapters=[LoRACard(m.name, m.path, m.base_model_name)
                                for m in config.lora_modules],
                 max_loras=config.max_loras if config.enable_lora else 0)


if __name__ == "__main__":
    sys.exit(main())
