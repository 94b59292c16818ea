"""What one client may cost a frontend: the size of a request body and the time it may take to
send a request or to take an answer. One slow or hostile client must not hold the event loop,
memory or a stream's engine requests.

- The body limit follows the model: `BYTES_PER_TOKEN` bytes per token of its context, at least
  `MIN_BODY_BYTES` (`--max-request-body-bytes` sets it instead). A body over it is a 413,
  refused by its Content-Length before any of it is read, or else as soon as what was read
  passes the limit: it is never buffered whole.
- `read_timeout`: a client has that long to send a request's headers, counted from its
  connection or from the previous answer (aiohttp's keep-alive timer, which also closes
  connections left idle that long), and then that long again for its body (a 408).
- `write_timeout`: a stream whose client takes nothing for that long is closed and its engine
  requests are aborted (`frontend.openai.serving.sse.SSEWriter`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from frontend.errors import Handler, OpenAIError

# Generous: a token id in JSON takes at most 8 bytes ("128255, "), English text ~4-6 bytes a
# token, non-ASCII text escaped as \uXXXX ~6-12; the rest of a request is small beside it.
BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 2**20


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int
    read_timeout: float
    write_timeout: float


HTTP_LIMITS = web.AppKey("http_limits", HttpLimits)


def body_limit(max_model_len: int, configured: int | None = None) -> int:
    """The largest request body served: `configured`, else sized to the model's context."""
    if configured is not None:
        return configured
    return max(MIN_BODY_BYTES, BYTES_PER_TOKEN * max_model_len)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The request body is larger than this server accepts ({limit:,} bytes at most). "
        "Send a shorter prompt, or start the server with a larger --max-request-body-bytes.",
    )


@web.middleware
async def body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read a request's body within the limits before its handler runs (whose
    `request.read()` then returns it at once); 413 when too large, 408 when too slow."""
    if not request.body_exists:
        return await handler(request)
    limits = request.app[HTTP_LIMITS]
    limit = limits.max_body_bytes
    if (request.content_length or 0) > limit:
        raise too_large(limit)
    request = request.clone(client_max_size=limit)
    try:
        async with asyncio.timeout(limits.read_timeout):
            await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit) from None
    except TimeoutError:
        raise OpenAIError(
            408, f"The request body did not arrive within {limits.read_timeout:g} s."
        ) from None
    return await handler(request)
