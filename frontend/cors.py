"""Cross-origin requests, as vLLM's server answers them (`--allowed-origins`, `--allowed-methods`,
`--allowed-headers`, `--allow-credentials`; every origin by default): preflight `OPTIONS`
requests are answered here, before authentication (browsers send them without credentials),
and every other answer to an allowed origin carries `Access-Control-Allow-Origin`."""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from frontend.errors import Handler


def cors_middleware(origins: Sequence[str], methods: Sequence[str], headers: Sequence[str],
                    credentials: bool) -> web.middleware:  # type: ignore[valid-type]
    any_origin = "*" in origins

    def allowed(origin: str) -> str | None:
        """The Access-Control-Allow-Origin value for `origin`, or None when it is not allowed."""
        if any_origin and not credentials:
            return "*"
        return origin if any_origin or origin in origins else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        allow = allowed(origin) if origin else None
        preflight = "Access-Control-Request-Method" in request.headers
        if request.method == "OPTIONS" and allow and preflight:
            response: web.StreamResponse = web.Response(status=200)
            asked = request.headers.get("Access-Control-Request-Headers", "")
            response.headers["Access-Control-Allow-Methods"] = (
                "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT" if "*" in methods
                else ", ".join(methods))
            response.headers["Access-Control-Allow-Headers"] = (
                asked if "*" in headers else ", ".join(headers))
            response.headers["Access-Control-Max-Age"] = "600"
        else:
            response = await handler(request)
        if allow:
            response.headers["Access-Control-Allow-Origin"] = allow
            if credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
            if allow != "*":
                response.headers["Vary"] = "Origin"
        return response

    return middleware
