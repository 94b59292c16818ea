"""Several engines behind one frontend (data parallel): one `EngineClient` each, and the choice
of engine for every request.

`EngineGroup` is what the APIs talk to; it has the calls of one `EngineClient` (`add`, `abort`,
`ready`, `healthy`, utilities) and hands each HTTP request to one engine:
- pinned by vLLM's `X-data-parallel-rank` header (the server's middleware puts it in
  `PINNED_RANK` for the request's task), else
- chosen by the `Router` (frontend/engine/routing.py) from each live engine's load and the
  longest prefix of the prompt it holds cached (frontend/engine/kv_index.py, fed by the
  engines' KV-cache events). A load is the queue the engine last published (running +
  waiting, with every ping answer, four times a second) plus the requests this frontend has
  sent it since, so that frontends deciding at once do not all pile onto one engine.
The n choices of one request go together (to the engine of their shared `OutputStream`).

An engine that stops answering (or stalls) fails its own requests, as one engine always did
(EngineClient), and leaves routing at once; its cached blocks are forgotten. When it answers
again (the launcher started a new one at its address) it takes work again, with an empty
cache. An engine that did not answer at start is waited for in the background, so a frontend
serves as soon as one engine does. Each engine is known by its position in the list of
addresses: its rank, for pinning and for the `engine` label of its metrics.

With one engine, `add` and `abort` go straight to it: nothing is hashed or chosen.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Sequence
from contextvars import ContextVar

import zmq.asyncio

from frontend.engine.client import EngineClient, EngineDeadError, EngineUnavailableError
from frontend.engine.kv_index import BlockIndex, KvEventFeed
from frontend.engine.routing import Router, RoutingConfig
from frontend.engine.stream import OutputStream
from shared import messages as wire
from shared.block_hash import chain_hashes, root_parent
from shared.curve import ClientKeys
from shared.kv_events import reachable

logger = logging.getLogger(__name__)

PINNED_RANK: ContextVar[int | None] = ContextVar("tandem_pinned_rank", default=None)
WATCH_S = 0.1  # how often engines' health is looked at (a dead one's blocks forgotten)
RETRY_S = 1.0  # between handshakes with an engine that did not answer yet
STRAGGLER_S = 2.0  # once one engine answered, how long start() waits for the others
_FACTS = ("model", "tokenizer", "max_model_len", "vocab_size", "eos_token_ids")

ClientFactory = Callable[[str], EngineClient]


class _Engine:
    """One engine as the group sees it."""

    def __init__(self, rank: int, address: str) -> None:
        self.rank = rank
        self.address = address
        self.client: EngineClient | None = None  # None until its handshake succeeded
        self.feed: KvEventFeed | None = None
        self.feed_task: asyncio.Task[None] | None = None
        self.resync: asyncio.Task[None] | None = None  # relearning its blocks after a silence
        self.was_healthy = False
        self.published: wire.EngineLoad | None = None  # the load figure last taken into account
        self.sent = 0  # requests sent since that figure

    @property
    def serving(self) -> bool:
        return self.client is not None and self.client.healthy

    def load(self) -> int:
        assert self.client is not None
        published = self.client.load
        if published is not self.published:  # a new figure counts what was sent before it
            self.published, self.sent = published, 0
        base = published.running + published.waiting if published is not None else 0
        return base + self.sent


class EngineGroup:
    """Create with the engines' addresses (in rank order), `await start()`, use, `close()`."""

    def __init__(self, addresses: Sequence[str], make_client: ClientFactory,
                 routing: RoutingConfig | None = None, curve: ClientKeys | None = None) -> None:
        if not addresses:
            raise ValueError("an engine group needs at least one engine address")
        self._engines = [_Engine(rank, a) for rank, a in enumerate(addresses)]
        self._make_client = make_client
        self._router = Router(routing or RoutingConfig())
        self._curve = curve
        self.index = BlockIndex()
        self._ctx = zmq.asyncio.Context()
        self._stream_engine: weakref.WeakKeyDictionary[OutputStream, _Engine] = (
            weakref.WeakKeyDictionary())
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: wire.Ready | None = None
        self._single = len(addresses) == 1

    @property
    def size(self) -> int:
        return len(self._engines)

    @property
    def ready(self) -> wire.Ready:
        """The model facts (every engine serves the same model)."""
        if self._ready is None:
            raise RuntimeError("EngineGroup.start() has not completed")
        return self._ready

    @property
    def healthy(self) -> bool:
        """True while at least one engine serves."""
        return any(e.serving for e in self._engines)

    @property
    def clients(self) -> list[tuple[int, EngineClient]]:
        """(rank, client) of every engine that has answered its handshake."""
        return [(e.rank, e.client) for e in self._engines if e.client is not None]

    @property
    def serving_clients(self) -> list[tuple[int, EngineClient]]:
        return [(e.rank, e.client) for e in self._engines
                if e.client is not None and e.client.healthy]

    async def start(self) -> wire.Ready:
        """Handshake with every engine; returns once all have answered, or one has and the
        others took STRAGGLER_S more (they join when they answer). Raises
        EngineUnavailableError when none answers."""
        attempts = [asyncio.create_task(self._handshake(e)) for e in self._engines]
        pending: set[asyncio.Task[bool]] = set(attempts)
        try:
            while pending and self._ready is None:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            for task in attempts:
                task.cancel()
            raise
        if pending and self._ready is not None:  # the others, unless they keep it waiting
            _, pending = await asyncio.wait(pending, timeout=STRAGGLER_S)
        if self._ready is None:
            raise EngineUnavailableError(self._last_error if self._single else
                                         "no engine answered: " + ", ".join(
                                             e.address for e in self._engines))
        self._tasks = [asyncio.create_task(self._watch())]
        self._tasks += [asyncio.create_task(self._join_later(e, first))
                        for e, first in zip(self._engines, attempts, strict=True)
                        if e.client is None]
        return self._ready

    async def close(self) -> None:
        for task in self._tasks + [t for e in self._engines for t in (e.feed_task, e.resync)
                                   if t is not None]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(e.client.close() for e in self._engines if e.client is not None))
        self._ctx.destroy(linger=0)

    # -- requests ---------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: wire.SamplingParams,
            stream: OutputStream | None = None, choice: int = 0) -> OutputStream:
        """Send one engine request to the engine chosen for its stream (one choice per engine
        request; a stream's choices share an engine). Raises EngineDeadError when no engine
        (or not the pinned one) serves."""
        if self._single and PINNED_RANK.get() in (None, 0):
            return self._client(self._engines[0]).add(request_id, prompt_token_ids, params,
                                                      stream, choice)
        stream = stream if stream is not None else OutputStream()
        engine = self._stream_engine.get(stream)
        if engine is None or not engine.serving:
            engine = self._choose(prompt_token_ids, params.lora)
            self._stream_engine[stream] = engine
        engine.sent += 1
        return self._client(engine).add(request_id, prompt_token_ids, params, stream, choice)

    def abort(self, request_ids: list[str], stopped: bool = False) -> None:
        """Stop these requests in whichever engine runs them."""
        if self._single:
            self._client(self._engines[0]).abort(request_ids, stopped)
            return
        for _, client in self.clients:
            mine = [rid for rid in request_ids if client.holds(rid)]
            if mine:
                client.abort(mine, stopped)

    def _choose(self, prompt: list[int], lora: str | None = None) -> _Engine:
        pinned = PINNED_RANK.get()
        if pinned is not None:
            engine = self._engines[pinned]
            if not engine.serving:
                raise EngineDeadError(f"engine {pinned} (chosen by X-data-parallel-rank) is "
                                      "not answering")
            return engine
        alive = [e.rank for e in self._engines if e.serving]
        if not alive:
            raise EngineDeadError("no engine is answering")
        loads = [e.load() if e.serving else 0 for e in self._engines]
        blocks, holders, hashed = 0, 0, 0
        with_events = [r for r in alive if self._engines[r].feed is not None]
        if with_events and self._router.config.policy == "cache-aware":
            # keyed by (adapter, prefix): an adapter's blocks hash from its own root
            hashes = chain_hashes(prompt, self.ready.block_size, root=root_parent(lora))
            hashed = len(hashes)
            mask = sum(1 << r for r in with_events)
            blocks, holders = self.index.longest_prefix(hashes, mask)
        choice = self._router.choose(alive, loads, blocks, holders, hashed)
        assert choice is not None
        return self._engines[choice.rank]

    # -- utilities --------------------------------------------------------------------------
    def flush_latency(self) -> None:
        for _, client in self.clients:
            client.latency.flush()

    async def stats(self, timeout: float = 5.0) -> list[tuple[int, wire.EngineStats]]:
        """Every serving engine's figures, by rank; raises EngineDeadError when none serves."""
        serving = self.serving_clients
        if not serving:
            raise EngineDeadError("no engine is answering")
        answers = await asyncio.gather(*(c.stats(timeout) for _, c in serving),
                                       return_exceptions=True)
        got = [(rank, a) for (rank, _), a in zip(serving, answers, strict=True)
               if isinstance(a, wire.EngineStats)]
        if not got:
            error = next(a for a in answers if isinstance(a, BaseException))
            raise error
        return got

    async def call_all(self, method: str, timeout: float = 5.0) -> None:
        """A utility call on every engine (e.g. "reset_prefix_cache"); raises the first
        failure, or EngineDeadError when some engine is not answering."""
        down = [e.rank for e in self._engines if not e.serving]
        answers = await asyncio.gather(*(c.call_utility(method, timeout)
                                         for _, c in self.serving_clients),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        if down:
            raise EngineDeadError(f"engine(s) {', '.join(map(str, down))} not answering")

    async def call_lora(self, method: str, lora: wire.LoRACard | None = None,
                        timeout: float = 30.0) -> list[wire.LoRACard]:
        """A LoRA utility call ("add_lora", "remove_lora", "loras") on every serving engine,
        each of which must know the same adapters; the adapters served after it. Raises the
        first engine's refusal (UtilityError with its status), or EngineDeadError."""
        serving = self.serving_clients
        if not serving:
            raise EngineDeadError("no engine is answering")
        answers = await asyncio.gather(*(c.call_utility(method, timeout, lora)
                                         for _, c in serving), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return list(answers[0].loras or [])  # type: ignore[union-attr]

    # -- engines coming and going -----------------------------------------------------------
    _last_error = "the engine did not answer"

    async def _handshake(self, engine: _Engine) -> bool:
        client = self._make_client(engine.address)
        try:
            ready = await client.start()
        except EngineUnavailableError as exc:
            self._last_error = str(exc)
            if not self._single:
                logger.warning("engine %d at %s did not answer yet; serving without it until "
                               "it does", engine.rank, engine.address)
            return False
        problem = self._mismatch(ready)
        if problem is not None:
            logger.error("engine %d at %s is left out: %s", engine.rank, engine.address, problem)
            await client.close()
            return False
        if ready.data_parallel_rank != engine.rank and not self._single:
            logger.warning("engine at %s reports data-parallel rank %d but is engine %d of "
                           "this frontend's --engine list; it is engine %d here", engine.address,
                           ready.data_parallel_rank, engine.rank, engine.rank)
        self._ready = self._ready or ready
        engine.client = client
        engine.was_healthy = True
        if not self._single and ready.kv_events_endpoint is not None:
            self._start_feed(engine, ready)
        elif not self._single:
            logger.warning("engine %d at %s publishes no KV-cache events this frontend can "
                           "subscribe to (start it with --kv-events-config binding an "
                           "endpoint): it is routed to by load only", engine.rank,
                           engine.address)
        return True

    async def _join_later(self, engine: _Engine, first: asyncio.Task[bool]) -> None:
        """Until the engine answers: the first handshake's end, then another every RETRY_S."""
        joined = await first
        while not joined:
            await asyncio.sleep(RETRY_S)
            joined = await self._handshake(engine)

    def _mismatch(self, ready: wire.Ready) -> str | None:
        if self._ready is None:
            return None
        for name in _FACTS:
            mine, theirs = getattr(self._ready, name), getattr(ready, name)
            if mine != theirs:
                return f"its {name} is {theirs!r}, the other engines' {mine!r}"
        return None

    def _start_feed(self, engine: _Engine, ready: wire.Ready) -> None:
        assert ready.kv_events_endpoint is not None
        replay = ready.kv_events_replay
        engine.feed = KvEventFeed(
            engine.rank, self.index, reachable(ready.kv_events_endpoint, engine.address),
            None if replay is None else reachable(replay, engine.address), self._ctx,
            self._curve)
        engine.feed_task = asyncio.create_task(engine.feed.run())

    async def _watch(self) -> None:
        """An engine that stopped serving loses its place in the index at once; when it serves
        again its feed relearns its blocks (the replay buffer's, or none: a new engine)."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self._single:  # the client says it (nothing to route elsewhere, no index)
                continue
            for e in self._engines:
                serving = e.serving
                if serving == e.was_healthy:
                    continue
                e.was_healthy = serving
                if e.feed is not None:
                    e.feed.forget()
                    if serving:
                        e.resync = asyncio.create_task(e.feed.resync())
                if serving:
                    logger.warning("engine %d at %s serves again; what it caches is learned "
                                   "anew from its events (a new engine's cache is empty)",
                                   e.rank, e.address)
                else:
                    logger.error("engine %d at %s stopped answering; requests go to the "
                                 "others", e.rank, e.address)

    @staticmethod
    def _client(engine: _Engine) -> EngineClient:
        if engine.client is None:
            raise EngineDeadError(f"engine {engine.rank} has not answered yet")
        return engine.client
