"""vLLM's LoRA flags, checked without torch: `--lora-modules` (`name=path`, or JSON with
`name`, `path` and `base_model_name`), and the adapters a server knows (`LoRAModule`). The
engine reads the adapters themselves (engine_core/lora/)."""

from __future__ import annotations

import json
from dataclasses import dataclass


class LoRAModulesError(ValueError):
    """A `--lora-modules` value that cannot be served; the message says why."""


@dataclass(frozen=True)
class LoRAModule:
    """An adapter the server knows: the name requests use as their `model`, its folder."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """vLLM's `--lora-modules` values: `name=path` or `{"name": ..., "path": ...,
    "base_model_name": ...}`; raises LoRAModulesError."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                given = json.loads(value)
                module = LoRAModule(str(given["name"]), str(given["path"]),
                                    given.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise LoRAModulesError(f"--lora-modules {value!r}: a JSON module needs "
                                       f"\"name\" and \"path\" ({exc})") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise LoRAModulesError(f"--lora-modules {value!r}: name=path or JSON")
            module = LoRAModule(name, path)
        modules.append(module)
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise LoRAModulesError(f"--lora-modules: a name given twice ({', '.join(names)})")
    return tuple(modules)
