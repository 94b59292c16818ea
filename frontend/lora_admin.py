"""LoRA adapters at run time, vLLM's API: `POST /v1/load_lora_adapter` (`{"lora_name": ...,
"lora_path": ...}`) and `POST /v1/unload_lora_adapter` (`{"lora_name": ...}`), routed only when
the environment variable VLLM_ALLOW_RUNTIME_LORA_UPDATING is `1` or `true` (as vLLM: otherwise
they are unknown routes, 404). Success is vLLM's 200 with a plain-text sentence.

Every engine loads (or unloads) the adapter through a utility call; the engine checks it and
answers the adapters it serves, which this frontend then serves. Other frontends learn of a
change lazily: a request naming a model they do not know makes them ask the engines for their
adapters before answering 404 (`refresh_middleware`), and so does /v1/models.
"""

from __future__ import annotations

import logging
import os

import msgspec
from aiohttp import web

from frontend.engine.client import EngineDeadError, UtilityError
from frontend.engine.group import EngineGroup
from frontend.errors import Handler, OpenAIError, bad_request
from frontend.openai.serving.served_model import ServedModel, UnknownModelError
from shared.messages import LoRACard

logger = logging.getLogger(__name__)
ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
LORA_ENGINE = web.AppKey("lora_engine", EngineGroup)
LORA_SERVED = web.AppKey("lora_served", ServedModel)
LORA_UPDATES = web.AppKey("lora_updates", bool)  # the routes are on


class LoadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct):
    lora_name: str = ""


def runtime_updates_allowed(environ: dict[str, str] | None = None) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    value = (os.environ if environ is None else environ).get(ENV, "0")
    return value.strip().lower() in ("1", "true")


def add_routes(app: web.Application) -> None:
    logger.warning("LoRA dynamic loading & unloading is enabled (%s): this should ONLY be "
                   "used for local development!", ENV)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def load_lora_adapter(request: web.Request) -> web.Response:
    req = msgspec.json.decode(await request.read(), type=LoadLoRAAdapterRequest)
    served = request.app[LORA_SERVED]
    if not req.lora_name or not req.lora_path:
        raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                          "InvalidUserInput")
    if req.lora_name == served.name:
        raise OpenAIError(400, f"The lora adapter '{req.lora_name}' conflicts with a served "
                          "base model.", "InvalidUserInput")
    if req.load_inplace:
        raise bad_request("load_inplace is not supported: unload the adapter, then load it")
    await _call(request, "add_lora", LoRACard(req.lora_name, req.lora_path))
    logger.info("Loaded new LoRA adapter: name '%s', path '%s'", req.lora_name, req.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    req = msgspec.json.decode(await request.read(), type=UnloadLoRAAdapterRequest)
    if not req.lora_name:
        raise OpenAIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                          "InvalidUserInput")
    await _call(request, "remove_lora", LoRACard(req.lora_name, ""))
    logger.info("Removed LoRA adapter: name '%s'", req.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


async def _call(request: web.Request, method: str, card: LoRACard) -> None:
    """The call on every engine; this frontend then serves what they serve."""
    try:
        cards = await request.app[LORA_ENGINE].call_lora(method, card)
    except UtilityError as exc:
        if exc.status:
            raise OpenAIError(exc.status, str(exc),
                              "NotFoundError" if exc.status == 404 else "InvalidUserInput"
                              ) from None
        raise OpenAIError(500, str(exc)) from None
    except (EngineDeadError, TimeoutError) as exc:
        raise OpenAIError(503, f"The engine did not answer ({exc}).") from None
    request.app[LORA_SERVED].set_adapters(cards)


async def refresh_adapters(app: web.Application) -> None:
    """Serve the adapters the engines serve now (another frontend may have changed them)."""
    try:
        app[LORA_SERVED].set_adapters(await app[LORA_ENGINE].call_lora("loras"))
    except (RuntimeError, TimeoutError) as exc:  # no answer: keep what this frontend knows
        logger.warning("could not ask the engines for their LoRA adapters: %s", exc)


@web.middleware
async def refresh_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A request naming an unknown model: ask the engines for their adapters, then answer it
    once more (its body is read already) before it becomes a 404."""
    try:
        return await handler(request)
    except UnknownModelError:
        await refresh_adapters(request.app)
        return await handler(request)
