"""Qwen2 (Qwen2.5 and its distillations): Llama's layers with biases on the QKV product (none
on the output product), without sliding-window layers."""

from __future__ import annotations

from typing import Any

from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.registry import register


@register("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        return True, False
