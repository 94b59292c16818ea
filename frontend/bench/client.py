"""The HTTP side of the benchmark: one streamed request -> a RequestResult, plus discovery
and the server's speculative decoding counters (GET /metrics).

Works against any OpenAI-compatible server. Requests always stream with
`stream_options.include_usage`, so the last chunk carries the server's token counts. The SSE
body is read in raw pieces and split on newlines here (not with readline, whose 64 KiB line
limit an echoed prompt with logprobs can exceed); each `data:` line is one JSON event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from frontend.bench.metrics import RequestResult
from frontend.bench.spec_decode import SpecCounters, parse_counters
from frontend.bench.workload import Prompt

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
                  "embeddings": "/v1/embeddings"}
SCRAPE_TIMEOUT_S = 10.0  # a /metrics read between rounds


@dataclass(frozen=True)
class RequestOptions:
    """What every request of a run asks for; `model` is already resolved. Each prompt brings
    its own max_tokens; `extra_body` fields (vLLM's --extra-body) go into every request."""

    endpoint: str  # "completions" | "chat" | "embeddings"
    model: str
    logprobs: int | None = None
    echo: bool = False  # completions only
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)


def normalize_base_url(base_url: str) -> str:
    """http://host:port, accepting a trailing slash or /v1 from the user."""
    url = base_url.rstrip("/")
    return url.removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(options: RequestOptions, prompt: Prompt) -> dict[str, Any]:
    """The JSON body of one request: the prompt's max_tokens, the extra body on top, and
    always streaming with usage (the timings and token counts depend on it)."""
    payload: dict[str, Any] = {"model": options.model, "max_tokens": prompt.output_len}
    if options.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(api_fields(options, prompt.text))
    payload.update(options.extra_body)
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    return payload


def api_fields(options: RequestOptions, prompt: str) -> dict[str, Any]:
    """The prompt and logprob fields, as completions or chat spell them."""
    if options.endpoint == "chat":
        fields: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        if options.logprobs is not None:
            fields |= {"logprobs": True, "top_logprobs": options.logprobs}
        return fields
    fields = {"prompt": prompt}
    if options.logprobs is not None:
        fields["logprobs"] = options.logprobs
    if options.echo:
        fields["echo"] = True
    return fields


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a completions or chat chunk carries (empty for the usage-only chunk)."""
    parts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if delta is None:
            parts.append(choice.get("text") or "")
        else:
            parts.append(delta.get("content") or delta.get("reasoning_content") or "")
    return "".join(parts)


def error_message(body: str) -> str:
    """The `error.message` of an OpenAI error body, else the body itself, shortened."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return body.strip()[:300]


class StreamState:
    """What one SSE stream has said so far; `feed` takes each `data:` payload in order."""

    def __init__(self) -> None:
        self.text_times: list[float] = []
        self.text_chars = 0
        self.usage: dict[str, Any] = {}
        self.done = False
        self.error = ""

    def feed(self, data: str, elapsed: float) -> None:
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.error = "error event in the stream: " + error_message(data)
            return
        if text := chunk_text(chunk):
            self.text_times.append(elapsed)
            self.text_chars += len(text)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def result(self, latency: float, prompt: Prompt) -> RequestResult:
        error = self.error
        if not error and not self.done:
            error = "the stream ended before 'data: [DONE]'"
        if not error and not self.text_times:
            error = "the stream carried no text"
        return RequestResult(
            success=not error,
            latency=latency,
            text_times=tuple(self.text_times),
            prompt_len=prompt.input_len,
            prompt_tokens=self.usage.get("prompt_tokens"),
            completion_tokens=self.usage.get("completion_tokens"),
            error=error,
            text_chars=self.text_chars,
        )


async def send_request(
    session: aiohttp.ClientSession,
    base_url: str,
    options: RequestOptions,
    prompt: Prompt,
    api_key: str | None = None,
) -> RequestResult:
    """Send one streamed request and time it; never raises for HTTP or stream failures."""
    if options.endpoint == "embeddings":
        return await send_embedding(session, base_url, options, prompt, api_key)
    url = normalize_base_url(base_url) + ENDPOINT_PATHS[options.endpoint]
    payload = build_payload(options, prompt)
    state = StreamState()
    start = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=auth_headers(api_key)) as response:
            if response.status != 200:
                body = error_message(await response.text())
                return failure(f"HTTP {response.status}: {body}", start, prompt)
            buffer = b""
            async for piece in response.content.iter_any():
                elapsed = time.perf_counter() - start
                *lines, buffer = (buffer + piece).split(b"\n")
                feed_lines(state, lines, elapsed)
            feed_lines(state, [buffer], time.perf_counter() - start)  # no final newline
    # One bad request must not end the run; each failure becomes its own result.
    except Exception as exc:  # noqa: BLE001
        return failure(f"{type(exc).__name__}: {exc}", start, prompt)
    return state.result(time.perf_counter() - start, prompt)


async def send_embedding(
    session: aiohttp.ClientSession,
    base_url: str,
    options: RequestOptions,
    prompt: Prompt,
    api_key: str | None = None,
) -> RequestResult:
    """One /v1/embeddings request of one input, timed whole: its answer is one JSON body, so
    its "first text" is the vector, at the end (TTFT = latency, no output tokens)."""
    url = normalize_base_url(base_url) + ENDPOINT_PATHS["embeddings"]
    payload = {"model": options.model, "input": prompt.text, **options.extra_body}
    start = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=auth_headers(api_key)) as response:
            body = await response.text()
            latency = time.perf_counter() - start
            if response.status != 200:
                return failure(f"HTTP {response.status}: {error_message(body)}", start, prompt)
            answer = json.loads(body)
            if not answer.get("data") or not answer["data"][0].get("embedding"):
                return failure("the answer carried no embedding", start, prompt)
    except Exception as exc:  # noqa: BLE001 - one bad request must not end the run
        return failure(f"{type(exc).__name__}: {exc}", start, prompt)
    return RequestResult(success=True, latency=latency, text_times=(latency,),
                         prompt_len=prompt.input_len,
                         prompt_tokens=(answer.get("usage") or {}).get("prompt_tokens"),
                         completion_tokens=0)


def feed_lines(state: StreamState, lines: list[bytes], elapsed: float) -> None:
    for line in lines:
        if line.startswith(b"data:"):
            state.feed(line[5:].strip().decode(), elapsed)


def failure(message: str, start: float, prompt: Prompt) -> RequestResult:
    return RequestResult(
        success=False,
        latency=time.perf_counter() - start,
        prompt_len=prompt.input_len,
        error=message,
    )


async def fetch_json(
    session: aiohttp.ClientSession, base_url: str, path: str, api_key: str | None
) -> Any:
    url = normalize_base_url(base_url) + path
    async with session.get(url, headers=auth_headers(api_key)) as response:
        if response.status != 200:
            raise ValueError(f"GET {url}: HTTP {response.status}: {await response.text()}")
        return await response.json(content_type=None)


async def fetch_spec_counters(
    session: aiohttp.ClientSession, base_url: str, api_key: str | None = None
) -> SpecCounters | None:
    """The server's speculative decoding counters now (spec_decode.py); None when it has none
    or /metrics does not answer."""
    url = f"{normalize_base_url(base_url)}/metrics"
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    try:
        async with session.get(url, headers=auth_headers(api_key), timeout=timeout) as resp:
            if resp.status != 200:
                return None
            return parse_counters(await resp.text())
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


async def fetch_model_id(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The first model id of GET /v1/models."""
    try:
        models = await fetch_json(session, base_url, "/v1/models", api_key)
        return str(models["data"][0]["id"])
    except (aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"could not read a model id from {base_url}/v1/models ({exc}); "
            "check --base-url (and --api-key) or pass --model"
        ) from None


async def fetch_tokenizer_hint(
    session: aiohttp.ClientSession, base_url: str, api_key: str | None
) -> str | None:
    """Best effort: a tokenizer path the server names at GET /tokenizer_info, else None.

    Accepts {"tokenizer_path": ...}, {"tokenizer": ...} or {"name_or_path": ...}; any failure
    (no such route, another shape) is None and the caller falls back to the model id.
    """
    try:
        info = await fetch_json(session, base_url, "/tokenizer_info", api_key)
    except (aiohttp.ClientError, ValueError, TimeoutError):
        return None
    if not isinstance(info, dict):
        return None
    for key in ("tokenizer_path", "tokenizer", "name_or_path"):
        if isinstance(info.get(key), str) and info[key]:
            return str(info[key])
    return None
