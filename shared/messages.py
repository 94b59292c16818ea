"""Wire messages between frontends and the engine core.

Every message is a msgspec Struct (array_like, omit_defaults, tagged union), encoded with
msgpack. Token ids and logprob arrays travel as packed little-endian int32/float32 bytes
(columnar per step), never as one Python object per token: `ints()`/`floats()` pack them and
`read_ints()`/`read_floats()` read them back as lists. This module imports no numpy: frontends,
which users run many of, import it and stay light (the engine packs its numpy columns in
`shared/step_outputs.py`).

Frontend -> engine: Hello, AddRequest, AbortRequest, StopRequest, UtilityRequest, MetricsReport.
Engine -> frontend: Ready, StepOutputs, UtilityResult.
"""

from __future__ import annotations

import enum
import sys
from array import array
from collections.abc import Iterable
from typing import Any

import msgspec

MAX_LOGPROBS = 20  # most top logprobs a request may ask for, per token (as OpenAI allows)


class FinishReason(enum.StrEnum):
    """Why the engine finished a request."""

    STOP = "stop"  # EOS or a stop token (or, from the frontend, a stop string)
    LENGTH = "length"  # max_tokens or the context length; also a prompt-only request
    ABORT = "abort"  # the frontend aborted it
    ERROR = "error"  # refused: the request can never run (Finished.message says why)
    OVERLOADED = "overloaded"  # refused: the waiting queue is full


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every tagged wire message."""


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A constraint on a request's output text, compiled by the engine into a token grammar.

    `kind` says what `spec` holds: "json" (a JSON schema as JSON text), "json_object" (any JSON
    object; `spec` empty), "regex", "choice" (a JSON list of the allowed strings) or "grammar"
    (EBNF). Whitespace between JSON tokens is bounded unless `any_whitespace` is false, when
    only the single spaces of the default separators remain."""

    kind: str
    spec: str = ""
    any_whitespace: bool = True


class Pooling(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """An embedding request (/v1/embeddings): its prompt's final hidden states pooled into one
    vector, and nothing sampled (the request is prompt-only, `max_tokens` 0).

    `kind`: "last" (the last token's state), "mean" (every token's, averaged) or "cls" (the
    first token's); `dimensions` > 0 keeps the vector's first that many entries (a Matryoshka
    model's), before `normalize` scales it to unit length."""

    kind: str = "last"
    normalize: bool = True
    dimensions: int = 0


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine needs to sample one request. Text-level options (stop strings,
    detokenization) stay in the frontend."""

    max_tokens: int = 16  # 0 => prefill only, nothing sampled
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None => none; k => sampled token + top-k (k <= MAX_LOGPROBS)
    prompt_logprobs: int | None = None  # None => none; k => per prompt token + top-k
    structured: StructuredOutput | None = None  # None => unconstrained
    # A constrained output that thinks first (a server with a reasoning parser): the token ids
    # of the end-of-thinking marker. The grammar masks nothing until the output first ends with
    # them, and applies from the next token on. Empty: the grammar applies from the first token.
    reasoning_end: list[int] = []
    pooling: Pooling | None = None  # an embedding request: pooled, never sampled
    lora: str | None = None  # the LoRA adapter it runs with (its name); None: the base model


class LoRACard(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A LoRA adapter the engine serves: the name requests give as their model, its folder,
    and the base model it names (vLLM's base_model_name; None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


class Hello(_Wire, tag="hello"):
    client_id: str


class Ready(_Wire, tag="ready"):
    """The model facts a frontend needs, sent in answer to Hello."""

    model: str
    tokenizer: str  # a local folder or hub id the frontend can load the tokenizer from
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    engine_pid: int = 0
    # The model's generation defaults (temperature, top_p, top_k, min_p, repetition_penalty)
    # for requests that leave them out: vLLM's --generation-config auto.
    sampling_defaults: dict[str, int | float] = {}
    # Data parallel: the engine's rank, its KV-cache block size (the router hashes prompts in
    # blocks of it) and where it publishes its KV-cache events (None: it does not).
    data_parallel_rank: int = 0
    block_size: int = 16
    kv_events_endpoint: str | None = None
    kv_events_replay: str | None = None
    # Speculative decoding: the most draft tokens a step proposes per request (the
    # --speculative-config's num_speculative_tokens); 0 when the engine does not speculate.
    # The frontends publish vLLM's spec_decode counters, one per position, only when it is set.
    num_speculative_tokens: int = 0
    # Embeddings (/v1/embeddings): "generate" (the default runner also embeds) or "pooling"
    # (--runner pooling: embeddings only, as vLLM's); the pooler's defaults (--pooler-config);
    # the vector's width (the model's hidden size); the Matryoshka widths the model allows
    # `dimensions` to ask for (None: it is not a Matryoshka model; empty: any width).
    runner: str = "generate"
    pooler: Pooling = Pooling()
    hidden_size: int = 0
    matryoshka_dimensions: list[int] | None = None
    # --enable-lora: the adapters requests may name (as their model), and --max-loras
    lora_adapters: list[LoRACard] = []
    max_loras: int = 0


class AddRequest(_Wire, tag="add"):
    request_id: str
    prompt_token_ids: bytes  # int32
    params: SamplingParams


class AbortRequest(_Wire, tag="abort"):
    request_ids: list[str]


class StopRequest(_Wire, tag="stop"):
    """Like AbortRequest, for requests the frontend finished itself (a stop string matched):
    the engine frees them and counts them as finished by "stop", not as aborted."""

    request_ids: list[str]


class UtilityRequest(_Wire, tag="util"):
    call_id: int
    method: str  # "stats" | "ping" | "reset_prefix_cache" | "add_lora" | "remove_lora" | "loras"
    lora: LoRACard | None = None  # the adapter "add_lora" loads ("remove_lora": its name)


class Histogram(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Observations of one latency histogram since a frontend's last report.

    `counts[i]` counts observations <= bounds[i] and > bounds[i - 1] (not cumulative); the
    last entry, counts[len(bounds)], counts those above every bound (+Inf)."""

    name: str
    bounds: list[float]
    counts: list[int]
    sum: float


class MetricsReport(_Wire, tag="metrics"):
    """A frontend's latency observations (TTFT, ITL, end-to-end) since its last report; the
    engine adds them up so that any frontend can serve the whole server's figures."""

    histograms: list[Histogram]


class EngineStats(msgspec.Struct, omit_defaults=True, gc=False):
    """The engine's gauges and counters, and the whole server's latency histograms (the sum
    of every frontend's reports), as the "stats" utility returns them."""

    running: int = 0  # requests running now
    waiting: int = 0  # requests queued for a slot now
    num_requests: int = 0  # requests the engine holds (running + waiting)
    num_blocks: int = 0  # KV-cache blocks in all
    free_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, found cached
    preemptions: int = 0
    chunked_prefills: int = 0  # steps that computed a prompt only in part
    request_prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed
    prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    generation_tokens: int = 0  # tokens sampled
    steps: int = 0  # engine steps run
    output_messages: int = 0  # StepOutputs sent (one per frontend with news, per step)
    output_rows: int = 0  # rows in them (requests with news)
    finished: dict[FinishReason, int] = {}  # requests finished, by reason (stop, length, abort)
    rejected: dict[FinishReason, int] = {}  # requests refused, by reason (overloaded, error)
    histograms: list[Histogram] = []
    step_errors: int = 0  # steps that raised (their requests finished with "error")
    frontends_lost: int = 0  # frontends gone silent whose requests the engine aborted
    block_size: int = 0  # tokens per KV-cache block
    cache_dtype: str = ""  # --kv-cache-dtype (vLLM's cache_dtype label); "" is "auto"
    kv_events_dropped: int = 0  # KV-event batches the publisher had no room for
    # speculative decoding (vLLM's spec_decode counters): drafts verified (one per request
    # per step that had any), their tokens, the tokens accepted, and of those, how many at
    # each position of a draft (index 0: the first draft token)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # --enable-lora: the adapters with requests in the engine (vLLM's lora_requests_info):
    # each one's running and waiting requests, the adapters in the order of their oldest
    # request, and when these were taken (time.time())
    lora_running: dict[str, int] = {}
    lora_waiting: dict[str, int] = {}
    lora_time: float = 0.0


class StepProgress(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The busy loop's progress, as the I/O thread sees it when it answers a ping: a live
    socket does not prove that steps still finish (a hung kernel, a deadlock)."""

    busy: bool = False  # the loop has work (or is inside a step) rather than waiting for some
    since_step_s: float = 0.0  # seconds since the loop last finished a step (or took input)
    slowest_step_s: float = 0.0  # the longest step seen so far


class EngineLoad(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The engine's queue as a ping finds it: what a router weighs engines by."""

    running: int = 0
    waiting: int = 0


class UtilityResult(_Wire, tag="util_result"):
    call_id: int
    stats: EngineStats | None = None  # the answer to "stats"
    error: str | None = None
    progress: StepProgress | None = None  # the answer to "ping"
    load: EngineLoad | None = None  # the answer to "ping"
    loras: list[LoRACard] | None = None  # the adapters served now: the answer to the LoRA calls
    status: int = 0  # with `error`: the HTTP status it means (0: a server error)


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of prompt tokens 1..P-1 (token 0 has none), sent once per request."""

    index: int  # row in StepOutputs.req_ids
    logprobs: bytes  # float32 [P-1]
    ranks: bytes  # int32 [P-1]
    k: int = 0
    top_ids: bytes = b""  # int32 [(P-1) * k]
    top_logprobs: bytes = b""  # float32 [(P-1) * k]


class Finished(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    index: int  # row in StepOutputs.req_ids
    reason: FinishReason
    stop_token_id: int | None = None  # set when a stop_token_ids entry ended it
    message: str | None = None  # for "error": why the engine refused the request
    embedding: bytes = b""  # float32 [d]: a pooling request's vector, on its finish row


class StepOutputs(_Wire, tag="out"):
    """One engine step's news for the requests of one frontend, column by column.

    Row i is request req_ids[i]. token_ids[i] is its new token or -1 (a prefill chunk that
    sampled nothing). lp_k[i] is -1 without logprobs, else the number of top entries k_i;
    lp_top_ids/lp_top_vals hold the rows' top-k back to back.
    """

    req_ids: list[str]
    token_ids: bytes  # int32 [n]
    lp_k: bytes = b""  # int32 [n] (empty => no row has logprobs)
    lp_sampled: bytes = b""  # float32 [n]
    lp_rank: bytes = b""  # int32 [n]
    lp_top_ids: bytes = b""  # int32 [sum k_i]
    lp_top_vals: bytes = b""  # float32 [sum k_i]
    prompt_logprobs: list[PromptLogprobs] = []
    finished: list[Finished] = []


EngineInput = Hello | AddRequest | AbortRequest | StopRequest | UtilityRequest | MetricsReport
EngineOutput = Ready | StepOutputs | UtilityResult


def ints(values: Iterable[int]) -> bytes:
    return _packed("i", values)


def floats(values: Iterable[float]) -> bytes:
    return _packed("f", values)


def read_ints(buf: bytes) -> list[int]:
    return _unpacked("i", buf)


def read_floats(buf: bytes) -> list[float]:
    return _unpacked("f", buf)


def _packed(typecode: str, values: Iterable[Any]) -> bytes:
    packed = array(typecode, values)  # "i" and "f" are 4 bytes wherever CPython runs
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpacked(typecode: str, buf: bytes) -> list[Any]:
    values = array(typecode)
    values.frombytes(buf)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()
