"""Which of Tandem's model files serves a config: `architectures` in config.json to a class.

A model file registers its class under the architecture names it serves
(`@register("LlamaForCausalLM", ...)`); adding a family is one new file and one import line
in `engine_core/models/__init__.py`. A class may still decline a config it cannot serve
exactly (`unsupported`, with the reason), and that model then runs through transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

MODELS: dict[str, Any] = {}
T = TypeVar("T")


def register(*architectures: str) -> Callable[[T], T]:
    def add(cls: T) -> T:
        for name in architectures:
            MODELS[name] = cls
        return cls
    return add


def model_class(config: Any) -> Any | None:
    """The registered class for the first of the config's `architectures` that has one."""
    for name in getattr(config, "architectures", None) or ():
        if name in MODELS:
            return MODELS[name]
    return None
