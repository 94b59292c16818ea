"""Qwen3 (dense): Llama's layers with an RMSNorm over each query and key head before the rotary
embedding, a `head_dim` of its own (not hidden / heads), and `attention_bias` on all four
attention products."""

from __future__ import annotations

from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.registry import register


@register("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
