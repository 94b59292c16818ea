"""`tandem engine MODEL --listen ADDR`: run the engine core alone (also `python -m engine_core`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.engine_args import add_engine_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem engine", description=__doc__)
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model folder or hub id (default: the embedded tiny Llama)")
    parser.add_argument("--listen", default="tcp://127.0.0.1:5570",
                        help="ZeroMQ address to bind, tcp://HOST:PORT or ipc://PATH")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s engine[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    from engine_core.config import EngineConfig
    from engine_core.default_model import ensure_model
    from engine_core.engine import EngineCore
    from engine_core.process import serve
    from shared.messages import Ready

    model = args.model or str(ensure_model())
    try:
        config = EngineConfig(
            model=model, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            max_waiting_requests=args.max_waiting_requests,
            kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype, device=args.device,
            seed=args.seed, num_threads=args.num_threads, trust_remote_code=args.trust_remote_code)
        core = EngineCore(config)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"tandem engine: cannot start: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (args.model or "tandem-tiny-llama")
    facts = core.facts
    ready = Ready(model=name, tokenizer=args.tokenizer or model, max_model_len=facts.max_model_len,
                  vocab_size=facts.vocab_size, eos_token_ids=list(facts.eos_token_ids),
                  bos_token_id=facts.bos_token_id, engine_pid=os.getpid())
    serve(core, args.listen, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
