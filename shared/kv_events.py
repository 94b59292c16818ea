"""KV-cache events on the wire, in vLLM 0.32's exact format, so that external routers (llm-d's
KV-cache indexer, NVIDIA Dynamo, vLLM's production-stack router) read Tandem's engines unchanged.

An engine publishes what its prefix cache gains and loses on a ZeroMQ PUB socket, one
three-frame message per engine step with news: `[topic, sequence number as 8-byte big-endian,
msgpack(KVEventBatch)]`. A batch is `[ts, events, data_parallel_rank]`, each event a tagged
array: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]`, `["BlockRemoved", block_hashes, medium]` or `["AllBlocksCleared"]`. Block hashes
are the unsigned 64-bit chain of `shared/block_hash.py`. A ROUTER replay socket answers an
8-byte big-endian start sequence with every buffered `[seq, payload]` from there on, then
`[-1, b""]` (`shared/kv_publisher.py` is the engine's side, `frontend/engine/kv_index.py` a
subscriber's).

`--kv-events-config` takes vLLM's JSON keys (`KvEventsConfig`); in a data-parallel server each
rank binds the endpoint's port plus its rank (`rank_endpoint`), as vLLM does.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks newly in the prefix cache: a run of one request's consecutive blocks."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the hash of the block before the first; None at the root
    token_ids: list[int]  # every block's tokens, back to back
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache (their KV is overwritten)."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was forgotten (`/reset_prefix_cache`)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were taken
    events: list[KvEvent]
    data_parallel_rank: int | None = None


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """vLLM's `--kv-events-config` keys (its KVEventsConfig), with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; unset: "zmq" when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.kind == "zmq"

    @property
    def kind(self) -> str:
        if self.publisher is not None:
            return self.publisher
        return "zmq" if self.enable_kv_cache_events else "null"


class KvEventsConfigError(ValueError):
    """A `--kv-events-config` that cannot be used; the message says why."""


def parse_kv_events_config(text: str) -> KvEventsConfig:
    """`--kv-events-config JSON`, checked; raises KvEventsConfigError."""
    try:
        config = msgspec.json.decode(text, type=KvEventsConfig)
    except msgspec.DecodeError as exc:
        raise KvEventsConfigError(f"--kv-events-config: {exc} (vLLM's keys: "
                                  f"{', '.join(KvEventsConfig.__struct_fields__)})") from None
    if config.kind not in ("zmq", "null"):
        raise KvEventsConfigError(f"--kv-events-config: publisher {config.kind!r}: Tandem "
                                  "publishes with 'zmq' (or 'null': none)")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(config, name) < 1:
            raise KvEventsConfigError(f"--kv-events-config: {name} must be at least 1")
    for endpoint in (config.endpoint, config.replay_endpoint):
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise KvEventsConfigError(f"--kv-events-config: endpoint {endpoint!r}: tcp://, "
                                      "ipc:// or inproc://")
    return config


def config_json(config: KvEventsConfig) -> str:
    return msgspec.json.encode(config).decode()


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank `rank`'s address: the port plus the rank for tcp://, a `_dp{rank}` suffix for
    ipc:// and inproc:// (vLLM's rule; rank 0 keeps the address)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds a wildcard, ipc:// or inproc:// address and connects
    to any other (a collector that binds)."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


def reachable(endpoint: str, engine_address: str) -> str:
    """Where a frontend connects to reach `endpoint` bound by the engine at `engine_address`:
    a wildcard host becomes the engine's own host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", "[*]") and engine_address.startswith("tcp://"):
        host = engine_address[len("tcp://"):].rpartition(":")[0]
    elif host in ("*", "0.0.0.0", "[::]", "::", "[*]"):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(KVEventBatch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def read_seq(frame: bytes | Any) -> int:
    return int.from_bytes(bytes(frame), "big", signed=True)
