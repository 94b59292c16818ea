"""The frontend process: an aiohttp app speaking OpenAI's HTTP API to one engine core, or to
several (data parallel: `--engine` once per engine).

`init_app(config)` builds the app: routes, Bearer auth, /health, /version, /v1/models and the
/metrics handler here; the OpenAI APIs in `frontend.openai`; what one client may cost (body
size, read and write timeouts) in `frontend.http_limits`. Its cleanup context connects the
EngineGroup (an EngineClient per engine, Hello/Ready, the router: frontend/engine/group.py),
loads the tokenizer the engine names, settles the `ServedModel`, and closes everything on
shutdown. vLLM's `X-data-parallel-rank` header pins a request to one engine.
`run_frontend(config)` serves it until SIGTERM/SIGINT, then stops accepting and gives in-flight
requests `config.shutdown_grace` seconds to finish.

    python -m frontend.server --engine tcp://127.0.0.1:5555 --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

import uvloop
from aiohttp import web

from frontend.access_log import AccessLog
from frontend.cors import cors_middleware
from frontend.engine.client import EngineClient, EngineUnavailableError
from frontend.engine.group import PINNED_RANK, EngineGroup
from frontend.engine.routing import RoutingConfig, add_routing_args, routing_config
from frontend.errors import Handler, OpenAIError, bad_request, error_middleware
from frontend.http_limits import HTTP_LIMITS, HttpLimits, body_limit, body_middleware
from frontend.lora_admin import (
    LORA_ENGINE,
    LORA_SERVED,
    LORA_UPDATES,
    add_routes,
    refresh_adapters,
    refresh_middleware,
    runtime_updates_allowed,
)
from frontend.memory import settle_gc
from frontend.metrics import CONTENT_TYPE, render
from frontend.openai.chat.endpoint import ServingChat
from frontend.openai.completions.endpoint import ServingCompletions
from frontend.openai.embeddings.endpoint import ServingEmbeddings
from frontend.openai.protocol.base import ModelList
from frontend.openai.reasoning.outputs import ReasoningConfig
from frontend.openai.responses.endpoint import ServingResponses
from frontend.openai.responses.store import ResponseStore
from frontend.openai.serving.choices import (
    RETRY_AFTER_S,
    STREAMING,
    StreamingOptions,
    json_response,
)
from frontend.openai.serving.plan import REQUEST_LOG
from frontend.openai.serving.served_model import (
    ServedModel,
    read_chat_template,
    template_reads_tools,
    use_chat_template,
)
from frontend.openai.tokens.endpoint import ServingTokens
from frontend.options import add_frontend_args, check_frontend_args
from frontend.text.tokenizer_loader import load_tokenizer
from shared.argv import ConfigFileError, normalize
from shared.curve import ClientKeys, CurveKeyError, client_keys
from shared.memory import MemoryTrimmer

logger = logging.getLogger(__name__)

TokenizerLoader = Callable[[str], Any]


@dataclass(frozen=True)
class FrontendConfig:
    engine_address: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    reuse_port: bool = False
    handshake_timeout: float = 30.0
    heartbeat_interval: float = 0.25
    silence_timeout: float = 1.25  # with the ping spacing: a dead engine shows within 2 s
    stall_timeout: float = 10.0  # least time a busy engine may finish no step (x5 slowest step)
    shutdown_grace: float = 30.0
    max_request_body_bytes: int | None = None  # None: sized to the model (http_limits.py)
    http_read_timeout: float = 30.0  # to send a request's headers, then its body
    http_write_timeout: float = 60.0  # a stream whose client takes nothing this long is closed
    ready_file: str | None = None  # touched once listening (the launcher waits for it)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # "hermes" | "llama3_json"
    reasoning_parser: str | None = None  # "deepseek_r1" | "qwen3": split (openai/reasoning/)
    reasoning_field_alias: str | None = None  # "reasoning_content": sent too
    responses_store_size: int = 0  # /v1/responses kept for previous_response_id (0: none)
    chat_template: str | None = None  # instead of the tokenizer's (the template itself)
    response_role: str = "assistant"  # the role of chat answers
    allowed_origins: tuple[str, ...] = ("*",)  # CORS, as vLLM's defaults
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    access_log: bool = True  # an access-log line per HTTP request
    http_log_level: str = "info"  # aiohttp's own loggers
    log_requests: bool = False  # a line per request: id, prompt length, parameters
    curve: ClientKeys | None = None  # CURVE keys for the engine socket (shared/curve.py)
    more_engines: tuple[str, ...] = ()  # data parallel: engines 1.. (engine_address is 0)
    routing: RoutingConfig = RoutingConfig()  # how a request's engine is chosen among several

    @property
    def engine_addresses(self) -> tuple[str, ...]:
        return (self.engine_address, *self.more_engines)

    stream_interval: int = 1  # streamed tokens per chunk (vLLM's --stream-interval)
    merge_steps: int = 1  # tests only: engine steps each stream waits for before it writes

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto", or None when it is not enabled."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None


CONFIG = web.AppKey("config", FrontendConfig)
ENGINE = web.AppKey("engine", EngineGroup)
SERVED = web.AppKey("served", ServedModel)
COMPLETIONS = web.AppKey("completions", ServingCompletions)
CHAT = web.AppKey("chat", ServingChat)
RESPONSES = web.AppKey("responses", ServingResponses)
TOKENS = web.AppKey("tokens", ServingTokens)
EMBEDDINGS = web.AppKey("embeddings", ServingEmbeddings)
TRIMMER = web.AppKey("trimmer", MemoryTrimmer)
FRONTEND_ID = f"{socket.gethostname()}:{os.getpid()}"


def init_app(
    config: FrontendConfig, tokenizer_loader: TokenizerLoader = load_tokenizer
) -> web.Application:
    """The frontend app; the engine handshake happens at startup (in cleanup_ctx)."""
    cors = cors_middleware(config.allowed_origins, config.allowed_methods,
                           config.allowed_headers, config.allow_credentials)
    lora_updates = runtime_updates_allowed()  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    app = web.Application(middlewares=[cors, error_middleware, auth_middleware, body_middleware,
                                       *([refresh_middleware] if lora_updates else []),
                                       pin_middleware])
    app[CONFIG] = config
    app[LORA_UPDATES] = lora_updates
    app[TRIMMER] = MemoryTrimmer()
    app.cleanup_ctx.append(partial(engine_context, tokenizer_loader=tokenizer_loader))
    app.on_response_prepare.append(add_frontend_header)
    app.on_response_prepare.append(add_retry_after)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # vLLM's name for the same check (GET and POST)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    if lora_updates:
        add_routes(app)
    return app


async def engine_context(
    app: web.Application, tokenizer_loader: TokenizerLoader
) -> AsyncIterator[None]:
    config = app[CONFIG]

    def make_client(address: str) -> EngineClient:
        return EngineClient(address, handshake_timeout=config.handshake_timeout,
                            heartbeat_interval=config.heartbeat_interval,
                            silence_timeout=config.silence_timeout,
                            stall_timeout=config.stall_timeout, curve=config.curve)

    client = EngineGroup(config.engine_addresses, make_client, config.routing, config.curve)
    ready = await client.start()
    try:
        tokenizer = await asyncio.get_running_loop().run_in_executor(
            None, tokenizer_loader, ready.tokenizer
        )
        app[TRIMMER].trim()  # what loading tokenizer.json peaked at (frontend/memory.py)
        if config.chat_template is not None:
            use_chat_template(tokenizer, config.chat_template)
        if config.auto_tool_parser and not template_reads_tools(tokenizer):
            logger.warning("--enable-auto-tool-choice: this chat template never reads `tools`, "
                           "so the model is not shown the tools it may call (tool_choice "
                           '"required" and named functions still constrain the output); pass '
                           "--chat-template with a template that renders them")
        served = ServedModel.from_ready(tokenizer, ready, config.served_model_name)
        app[ENGINE] = app[LORA_ENGINE] = client
        app[SERVED] = app[LORA_SERVED] = served
        app[HTTP_LIMITS] = HttpLimits(
            body_limit(ready.max_model_len, config.max_request_body_bytes),
            config.http_read_timeout, config.http_write_timeout)
        app[STREAMING] = StreamingOptions(config.stream_interval, config.merge_steps)
        app[COMPLETIONS] = ServingCompletions(client, served)
        reasoning = None if config.reasoning_parser is None else ReasoningConfig.load(
            config.reasoning_parser, tokenizer, config.reasoning_field_alias)
        app[CHAT] = ServingChat(client, served, config.auto_tool_parser, config.response_role,
                                reasoning)
        store = ResponseStore(config.responses_store_size) if config.responses_store_size else None
        app[RESPONSES] = ServingResponses(client, served, config.tool_call_parser, reasoning,
                                          store)
        app[TOKENS] = ServingTokens(served, ready.tokenizer)
        app[EMBEDDINGS] = ServingEmbeddings(client, served, ready)
        logger.info(
            "engine at %s ready: model %s, max_model_len %d%s",
            config.engine_address,
            ready.model,
            ready.max_model_len,
            f" ({client.size} engines, {config.routing.policy} routing)"
            if client.size > 1 else "",
        )
        yield
    finally:
        await client.close()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer check on /v1/* (and /reset_prefix_cache) when an API key is configured; /health
    stays open."""
    key = request.app[CONFIG].api_key
    if key and (request.path.startswith("/v1/") or request.path == "/reset_prefix_cache"):
        given = request.headers.get("Authorization", "")  # undecodable bytes: surrogates
        if not hmac.compare_digest(given.encode(errors="surrogateescape"),
                                   f"Bearer {key}".encode()):
            raise OpenAIError(
                401,
                "Invalid or missing API key (send 'Authorization: Bearer <key>').",
                code="invalid_api_key",
            )
    return await handler(request)


@web.middleware
async def pin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """vLLM's `X-data-parallel-rank: K` sends the request to engine K (a 400 if there is no
    such engine; a 503 if it is not answering)."""
    value = request.headers.get("X-data-parallel-rank")
    if value is None:
        return await handler(request)
    size = request.app[ENGINE].size
    try:
        rank = int(value)
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        raise bad_request(f"X-data-parallel-rank {value!r}: this server has engines 0 to "
                          f"{size - 1}")
    token = PINNED_RANK.set(rank)
    try:
        return await handler(request)
    finally:
        PINNED_RANK.reset(token)


async def add_frontend_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Tandem-Frontend"] = FRONTEND_ID


async def add_retry_after(request: web.Request, response: web.StreamResponse) -> None:
    """Every 503 (engine down or waiting queue full) tells the client when to try again."""
    if response.status == 503:
        response.headers.setdefault("Retry-After", str(RETRY_AFTER_S))


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """POST /reset_prefix_cache (vLLM's): the engine forgets every cached prompt prefix."""
    try:  # every engine's, each publishing AllBlocksCleared
        await request.app[ENGINE].call_all("reset_prefix_cache")
    except (RuntimeError, TimeoutError) as exc:
        return OpenAIError(503, f"The engine did not reset its prefix cache ({exc}).").to_response()
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: every serving engine's figures, labelled by engine; 503 when no engine,
    which holds the figures, answers."""
    group = request.app[ENGINE]
    group.flush_latency()  # this frontend's latest observations reach the engines first
    try:
        stats = await group.stats()
    except (RuntimeError, TimeoutError) as exc:  # EngineDeadError, UtilityError, no answer
        message = f"Metrics are unavailable: the engine did not answer ({exc})."
        return OpenAIError(503, message).to_response()
    body = render(stats, request.app[SERVED].name, group.ready.num_speculative_tokens,
                  group.ready.max_loras)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def completions(request: web.Request) -> web.StreamResponse:
    generates(request, "Completions")
    return await request.app[COMPLETIONS].handle(request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    generates(request, "Chat Completions")
    return await request.app[CHAT].handle(request)


async def responses(request: web.Request) -> web.StreamResponse:
    generates(request, "Responses")
    return await request.app[RESPONSES].handle(request)


def generates(request: web.Request, api: str) -> None:
    """An embedding server (--runner pooling) answers generation APIs with a 400, as vLLM's."""
    if request.app[ENGINE].ready.runner == "pooling":
        raise bad_request(f"The model does not support {api} API: this server serves "
                          "embeddings (--runner pooling); use /v1/embeddings.")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await request.app[EMBEDDINGS].handle(request)


async def tokenize(request: web.Request) -> web.Response:
    return await request.app[TOKENS].tokenize(request)


async def detokenize(request: web.Request) -> web.Response:
    return await request.app[TOKENS].detokenize(request)


async def tokenizer_info(request: web.Request) -> web.Response:
    return await request.app[TOKENS].tokenizer_info(request)


async def models(request: web.Request) -> web.Response:
    if request.app[LORA_UPDATES]:  # adapters another frontend loaded or unloaded
        await refresh_adapters(request.app)
    return json_response(ModelList(request.app[SERVED].cards()))


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE].healthy:
        return web.Response(status=200)
    return OpenAIError(503, "The engine is not answering.").to_response()


async def version(request: web.Request) -> web.Response:
    try:
        number = metadata.version("tandem-serve")
    except metadata.PackageNotFoundError:
        number = "0.0.0+local"
    return web.json_response({"version": number})


async def serve(config: FrontendConfig) -> None:
    """Serve until SIGTERM/SIGINT; then stop accepting and let in-flight requests finish."""
    http_level = config.http_log_level.upper().replace("TRACE", "DEBUG")
    logging.getLogger("aiohttp").setLevel(http_level)
    request_level = logging.INFO if config.log_requests else logging.WARNING
    logging.getLogger(REQUEST_LOG).setLevel(request_level)
    runner = web.AppRunner(init_app(config), **runner_options(config))
    await runner.setup()  # connects to the engine; raises if it does not answer
    settle_gc()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, config.host, config.port, reuse_port=config.reuse_port,
                           ssl_context=ssl_context(config))
        await site.start()
        scheme = "https" if config.ssl_certfile else "http"
        logger.info("frontend %s serving on %s://%s:%d", FRONTEND_ID, scheme, config.host,
                    config.port)
        if config.ready_file:
            with open(config.ready_file, "w") as f:
                f.write(FRONTEND_ID)
        await stop.wait()
        logger.info("shutting down: no new connections, %g s grace", config.shutdown_grace)
    finally:
        await runner.cleanup()


def runner_options(config: FrontendConfig) -> dict[str, Any]:
    """The HTTP server's settings. aiohttp's keep-alive timer is the header timeout too: it
    closes a connection that has not sent a whole request's headers within the bound."""
    options: dict[str, Any] = {"handler_cancellation": True,
                               "shutdown_timeout": config.shutdown_grace,
                               "keepalive_timeout": config.http_read_timeout}
    if config.access_log:
        options["access_log_class"] = AccessLog
    else:
        options["access_log"] = None
    return options


def ssl_context(config: FrontendConfig) -> ssl.SSLContext | None:
    if config.ssl_certfile is None or config.ssl_keyfile is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    return context


def run_frontend(config: FrontendConfig) -> None:
    """Serve on uvloop's event loop (libuv's; as vLLM's API server does): its transports write,
    and its callbacks run, in C (docs/benchmarks.md, "CPU per streamed token")."""
    uvloop.run(serve(config))


def parse_args(argv: list[str] | None = None) -> FrontendConfig:
    parser = argparse.ArgumentParser(description="Tandem OpenAI-compatible frontend process.")
    parser.add_argument("--engine", required=True, action="append",
                        help="engine address, tcp://H:P or ipc://PATH; once per engine for "
                             "several (data parallel, in rank order)")
    parser.add_argument("--host", default=os.environ.get("TANDEM_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"))
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--reuse-port", action="store_true", help="SO_REUSEPORT (many frontends)")
    parser.add_argument("--handshake-timeout", type=float, default=30.0)
    parser.add_argument("--shutdown-grace", type=float, default=30.0)
    parser.add_argument("--stall-timeout", type=float, default=10.0,
                        help="seconds a busy engine may finish no step before it counts as "
                             "dead (at least; 5x its slowest step if more)")
    parser.add_argument("--ready-file", default=None, help="file to create once listening")
    parser.add_argument("--curve-keys", default=os.environ.get("TANDEM_CURVE_KEYS"),
                        help="folder with frontend.key_secret and engine.key (`tandem keys`): "
                             "connect with CURVE (default: $TANDEM_CURVE_KEYS)")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_frontend_args(parser)
    add_routing_args(parser)
    try:
        args = parser.parse_args(normalize(sys.argv[1:] if argv is None else argv, parser))
    except ConfigFileError as exc:
        parser.error(str(exc))
    check_frontend_args(parser, args)
    try:
        curve = None if args.curve_keys is None else client_keys(args.curve_keys)
    except CurveKeyError as exc:
        parser.error(str(exc))
    logging.getLogger().setLevel(args.log_level.upper())
    return FrontendConfig(
        engine_address=args.engine[0],
        more_engines=tuple(args.engine[1:]),
        routing=routing_config(args),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        reuse_port=args.reuse_port,
        handshake_timeout=args.handshake_timeout,
        shutdown_grace=args.shutdown_grace,
        stall_timeout=args.stall_timeout,
        ready_file=args.ready_file,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        reasoning_field_alias=args.reasoning_field_alias,
        responses_store_size=args.responses_store_size,
        chat_template=read_chat_template(args.chat_template),
        response_role=args.response_role,
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        access_log=not args.disable_uvicorn_access_log,
        http_log_level=args.uvicorn_log_level,
        log_requests=args.enable_log_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        http_read_timeout=args.http_read_timeout,
        http_write_timeout=args.http_write_timeout,
        curve=curve,
        stream_interval=args.stream_interval,
        merge_steps=args.merge_steps,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s frontend[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    config = parse_args(argv)
    try:
        run_frontend(config)
    except (EngineUnavailableError, OSError) as exc:  # startup failures: one clear line
        logger.error("frontend failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
