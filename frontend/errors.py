"""OpenAI-shaped errors and the aiohttp middleware that renders every failure as one.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with a
matching HTTP status. Bad input (undecodable JSON, wrong types, out-of-range values, nesting
deeper than Python can recurse) is always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}
_PATH_RE = re.compile(r"(?: - at `\$\.|missing required field `)([A-Za-z_][A-Za-z0-9_]*)")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class OpenAIError(Exception):
    """An error answered to the client in OpenAI's JSON shape.

    `type` defaults to the conventional name for `status` (400 -> "BadRequestError") and
    `code` to the status itself, as vLLM does; pass a string code such as "model_not_found"
    where OpenAI defines one.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "InternalServerError")
        self.param = param
        self.code = code if code is not None else status

    def info(self) -> ErrorInfo:
        return ErrorInfo(self.message, self.type, self.param, self.code)

    def to_json(self) -> bytes:
        return msgspec.json.encode(ErrorResponse(self.info()))

    def to_response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.to_json(), content_type="application/json"
        )


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_validation_error(exc: msgspec.ValidationError) -> OpenAIError:
    """msgspec says e.g. "Expected `int` <= 20 - at `$.logprobs`": keep it, name the field."""
    text = str(exc)
    match = _PATH_RE.search(text)
    return bad_request(text, param=match.group(1) if match else None)


def from_http_exception(exc: web.HTTPException) -> OpenAIError:
    return OpenAIError(exc.status, exc.reason if exc.text is None else exc.text)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn OpenAIError, msgspec decoding errors and aiohttp HTTP errors into OpenAI JSON."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.to_response()
    except msgspec.ValidationError as exc:
        return from_validation_error(exc).to_response()
    except msgspec.DecodeError as exc:
        return bad_request(f"The request body is not valid JSON: {exc}").to_response()
    except RecursionError:  # JSON, a schema or tools nested deeper than Python recurses
        logger.warning("refused %s %s: nested too deeply", request.method, request.path)
        return bad_request("The request is nested too deeply to be read; flatten its "
                           "JSON (arrays and objects inside one another).").to_response()
    except web.HTTPRedirection:
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc).to_response()
    except (ConnectionResetError, ConnectionError):
        raise  # the client is gone; nobody to answer
    except Exception:
        logger.exception("unexpected error handling %s %s", request.method, request.path)
        return OpenAIError(500, "Internal server error; see the server log.").to_response()
