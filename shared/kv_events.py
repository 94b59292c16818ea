"""KV-cache events on the wire, in vLLM 0.32's format byte for byte, so that external routers
(llm-d's KV-cache indexer, NVIDIA Dynamo, vLLM's production-stack router) read Tandem's engines
as they read vLLM's; or, with `--kv-events-format array`, in the positional arrays of vLLM before
0.26 (its PR 42892) for consumers that read only those (llm-d-kv-cache before v0.9.0).

An engine publishes what its prefix cache gains and loses on a ZeroMQ PUB socket, one
three-frame message per engine step with news: `[topic, sequence number as 8-byte big-endian,
msgpack(KVEventBatch)]`. A batch is the array `[ts, events, data_parallel_rank]`. Each event is
a map tagged by `type`, its keys the field names of the structs below, in their order, optional
ones left out at their defaults: `{"type": "BlockStored", "block_hashes": [...],
"parent_block_hash": null, ..., "group_idx": 0}`, `{"type": "AllBlocksCleared"}`. In the array
form an event is `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name]`, `["BlockRemoved", block_hashes, medium]` or
`["AllBlocksCleared"]`. Block hashes are the unsigned 64-bit chain of `shared/block_hash.py`.

A ROUTER replay socket answers an 8-byte big-endian start sequence with every buffered batch
from there on, then an end marker: vLLM 0.32 repeats each PUB message, `[topic, seq, payload]`,
and ends with `[b"", -1, b""]`; the array form sends `[seq, payload]` and ends with `[-1, b""]`,
as vLLM did before its PR 45177 (each after the client's envelope). `shared/kv_publisher.py` is
the engine's side, `frontend/engine/kv_index.py` a subscriber's, which reads either form.
`tests/data/kv_events/` holds frames recorded from vLLM 0.32.0's own classes.

`--kv-events-config` takes vLLM's JSON keys (`KvEventsConfig`); in a data-parallel server each
rank binds the endpoint's port plus its rank (`rank_endpoint`), as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message
KvEventsFormat = Literal["map", "array"]
FORMATS: tuple[str, ...] = get_args(KvEventsFormat)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events: a map, its class name under "type"."""


class BlockStored(KVCacheEvent):
    """Full blocks newly in the prefix cache: a run of one request's consecutive blocks.

    vLLM 0.32's struct has more optional fields after these (`kv_cache_spec_kind`,
    `kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`); at their defaults
    they are not on the wire, and a decoder ignores them."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the hash of the block before the first; None at the root
    token_ids: list[int]  # every block's tokens, back to back
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: what else its hash keys
    group_idx: int | None = None  # the KV-cache group (a hybrid model has several)


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache (their KV is overwritten)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was forgotten (`/reset_prefix_cache`)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were taken
    events: list[KvEvent]
    data_parallel_rank: int | None = None  # (an array's every field is written: nil when None)


class _Positional(msgspec.Struct, array_like=True, gc=False, tag=True):
    """The array form of an event: its tag, then the fields of the map form's struct that
    vLLM's events had before `extra_keys`, in the same order."""


class _PositionalBlockStored(_Positional, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _PositionalBlockRemoved(_Positional, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _PositionalAllBlocksCleared(_Positional, tag="AllBlocksCleared"):
    pass


_PositionalEvent = _PositionalBlockStored | _PositionalBlockRemoved | _PositionalAllBlocksCleared
_POSITIONAL: dict[type, Any] = {  # each event's struct in the other form, both ways
    BlockStored: _PositionalBlockStored, BlockRemoved: _PositionalBlockRemoved,
    AllBlocksCleared: _PositionalAllBlocksCleared}
_NAMED: dict[type, Any] = {positional: named for named, positional in _POSITIONAL.items()}


def _positional(event: KvEvent) -> _PositionalEvent:
    cls = _POSITIONAL[type(event)]
    return cls(**{name: getattr(event, name) for name in cls.__struct_fields__})


def _named(event: _PositionalEvent) -> KvEvent:
    return _NAMED[type(event)](**msgspec.structs.asdict(event))


class _PositionalBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PositionalEvent]
    data_parallel_rank: int | None = None


class KvEventWire:
    """One format's bytes: a batch's payload and the replay's messages."""

    def __init__(self, form: KvEventsFormat = "map") -> None:
        self.form = form
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: KVEventBatch) -> bytes:
        if self.form == "map":
            return self._encoder.encode(batch)
        return self._encoder.encode(_PositionalBatch(
            batch.ts, [_positional(e) for e in batch.events], batch.data_parallel_rank))

    def replayed(self, topic: bytes, seq: int, payload: bytes) -> tuple[bytes, ...]:
        """One buffered batch as the replay sends it, after the client's envelope."""
        if self.form == "map":
            return topic, seq_bytes(seq), payload
        return seq_bytes(seq), payload

    def replay_end(self) -> tuple[bytes, ...]:
        return (b"", END_SEQ, b"") if self.form == "map" else (END_SEQ, b"")


class KvEventDecoder:
    """A payload of either form into a KVEventBatch of the map form's events: a subscriber
    reads any engine, whatever `--kv-events-format` it was started with."""

    def __init__(self) -> None:
        self._named = msgspec.msgpack.Decoder(KVEventBatch)
        self._positional = msgspec.msgpack.Decoder(_PositionalBatch)

    def decode(self, payload: bytes) -> KVEventBatch:
        """Raises msgspec.DecodeError (the map form's complaint) when neither form fits."""
        try:
            return self._named.decode(payload)
        except msgspec.ValidationError as error:
            try:
                batch = self._positional.decode(payload)
            except msgspec.ValidationError:
                raise error from None
        return KVEventBatch(batch.ts, [_named(e) for e in batch.events], batch.data_parallel_rank)


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
    inproc:// (vLLM's rule) and for ipc:// (which vLLM 0.32 refuses with a rank); rank 0
    keeps the address."""
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


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def read_seq(frame: bytes | Any) -> int:
    return int.from_bytes(bytes(frame), "big", signed=True)
