"""The frontend's own flags (vLLM's names), shared by `tandem serve`, which passes them on to
its frontends, and `tandem frontend`, which reads them into its `FrontendConfig`.

Flags that vLLM has and that change nothing here are accepted so that `vllm serve` command
lines start, and their help says so. The HTTP limits (`frontend/http_limits.py`) have no vLLM
equivalent and take Tandem's names.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from frontend.openai.reasoning.outputs import FIELD_ALIASES, REASONING_PARSERS
from frontend.openai.tools.parsers import AUTO_PARSERS

TOOL_CALL_PARSERS = tuple(AUTO_PARSERS)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--enable-auto-tool-choice", {
        "action": "store_true", "help": 'allow tool_choice "auto" (needs --tool-call-parser)'}),
    ("--tool-call-parser", {
        "default": None, "choices": TOOL_CALL_PARSERS,
        "help": 'how "auto" tool calls are read from the model\'s output'}),
    ("--reasoning-parser", {
        "default": None, "choices": REASONING_PARSERS,
        "help": "split chat answers into `reasoning` (the model's thinking) and `content`; a "
                "constrained answer's grammar starts after the thinking"}),
    ("--chat-template", {
        "default": None,
        "help": "a chat template (a file, or the template itself) instead of the tokenizer's"}),
    ("--response-role", {
        "default": "assistant", "help": "the role of chat answers"}),
    ("--allowed-origins", {
        "type": _json_list, "default": ["*"], "help": "CORS: allowed origins (JSON list)"}),
    ("--allowed-methods", {
        "type": _json_list, "default": ["*"], "help": "CORS: allowed methods (JSON list)"}),
    ("--allowed-headers", {
        "type": _json_list, "default": ["*"], "help": "CORS: allowed headers (JSON list)"}),
    ("--allow-credentials", {
        "action": "store_true", "help": "CORS: allow credentials"}),
    ("--ssl-keyfile", {"default": None, "help": "serve HTTPS with this private key"}),
    ("--ssl-certfile", {"default": None, "help": "serve HTTPS with this certificate"}),
    ("--uvicorn-log-level", {
        "default": "info", "choices": LOG_LEVELS,
        "help": "level of the HTTP server's own logs (aiohttp's here; vLLM's name)"}),
    ("--disable-uvicorn-access-log", {
        "action": "store_true", "help": "no access-log line per HTTP request"}),
    ("--enable-log-requests", {
        "action": "store_true", "help": "log each request's id, prompt length and parameters"}),
    ("--disable-log-requests", {
        "action": "store_true", "help": "no-op: requests are not logged unless "
                                        "--enable-log-requests"}),
    ("--stream-interval", {
        "type": int, "default": 1,
        "help": "streamed tokens per chunk: a choice's first output goes at once, then its "
                "text waits for this many tokens (or its end); 1 sends each as it comes"}),
)
# For tests only (no help shown): every stream waits for this many engine steps before it
# writes, so that the merged chunks of a stream that fell behind are what the tests see.
_TEST_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--merge-steps", {"type": int, "default": 1, "help": argparse.SUPPRESS}),
)


_LIMIT_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--max-request-body-bytes", {
        "type": int, "default": None,
        "help": "largest request body accepted, else 413 (default: 64 bytes per token of the "
                "model's context, at least 1 MiB)"}),
    ("--http-read-timeout", {
        "type": float, "default": 30.0,
        "help": "seconds a client has to send a request's headers (from its connection or the "
                "previous answer; idle connections close after it too), then its body"}),
    ("--http-write-timeout", {
        "type": float, "default": 60.0,
        "help": "seconds a stream's client may take nothing before the stream is closed and "
                "its requests aborted"}),
)


_TANDEM_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--reasoning-field-alias", {
        "default": None, "choices": FIELD_ALIASES,
        "help": "with --reasoning-parser: answers also carry the reasoning under this older "
                "name (vLLM's before `reasoning`)"}),
    ("--responses-store-size", {
        "type": int, "default": 0,
        "help": "keep the last N /v1/responses answers in memory, per frontend process, for "
                "previous_response_id (default 0: stateless, previous_response_id is a 400)"}),
)


def add_frontend_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("frontend (vLLM's names)")
    for flag, kwargs in _FLAGS:
        group.add_argument(flag, **kwargs)
    own = parser.add_argument_group("frontend (Tandem's names)")
    for flag, kwargs in _TANDEM_FLAGS:
        own.add_argument(flag, **kwargs)
    limits = parser.add_argument_group("frontend HTTP limits (Tandem's names)")
    for flag, kwargs in _LIMIT_FLAGS:
        limits.add_argument(flag, **kwargs)
    for flag, kwargs in _TEST_FLAGS:
        parser.add_argument(flag, **kwargs)


def check_frontend_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags that parse but cannot be served are usage errors."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser "
                     f"({' or '.join(TOOL_CALL_PARSERS)})")
    if args.reasoning_field_alias is not None and args.reasoning_parser is None:
        parser.error("--reasoning-field-alias needs --reasoning-parser "
                     f"({' or '.join(REASONING_PARSERS)})")
    if args.responses_store_size < 0:
        parser.error("--responses-store-size must be 0 (no store) or more")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("--ssl-keyfile and --ssl-certfile go together")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 1:
        parser.error("--max-request-body-bytes must be positive")
    if min(args.http_read_timeout, args.http_write_timeout) <= 0:
        parser.error("--http-read-timeout and --http-write-timeout must be positive")
    for flag in ("--stream-interval", "--merge-steps"):
        if getattr(args, flag[2:].replace("-", "_")) < 1:
            parser.error(f"{flag} must be at least 1")


def frontend_argv(args: argparse.Namespace) -> list[str]:
    """The frontend flags of parsed `args`, as a frontend command line takes them."""
    argv: list[str] = []
    for flag, kwargs in _FLAGS + _TANDEM_FLAGS + _LIMIT_FLAGS + _TEST_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if kwargs.get("action") == "store_true":
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, json.dumps(value)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
