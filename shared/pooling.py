"""`--runner`, `--convert` and `--pooler-config`: how a server embeds (vLLM's flags).

`--runner pooling --convert embed` serves a decoder as an embedding model, as vLLM does: each
input's final hidden states are pooled into one vector (/v1/embeddings) and nothing is
generated. The default runner ("generate") serves generation and embeds as well. The pooler is
vLLM's `--pooler-config` JSON: `{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}`
(vLLM's defaults for an embedding model: LAST, normalized). The launcher checks the flags
without torch (here); the engine pools (engine_core/pooling.py).
"""

from __future__ import annotations

import msgspec

from shared.messages import Pooling

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
