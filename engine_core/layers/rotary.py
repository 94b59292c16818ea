"""The rotary embedding's cos and sin for every position, computed once at load.

transformers computes `cos(position * inv_freq) * attention_scaling` (and the sine) for each
step's positions; a table over the model's context holds the very same values (one product
and one cosine each, in float32), so a step gathers its rows instead of computing them. The
frequencies and the scaling come from transformers' own rotary class for the config, so
every rope type it knows (default, linear, llama3, yarn, ...) is computed its way; the types
whose frequencies change with the sequence's length (`dynamic`, `longrope`) are not served
by a table (`supported`), and such models run through transformers (engine_core/models/).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

LENGTH_DEPENDENT = ("dynamic", "longrope")


class RotaryTable(NamedTuple):
    """cos and sin [positions, head_dim] float32, as transformers' `emb` (both halves alike)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def head_dim(self) -> int:
        return int(self.cos.shape[1])


def rope_type(config: Any) -> str:
    """The config's rope type, in transformers 5's `rope_parameters` or 4's `rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not params:
        return "default"
    return str(params.get("rope_type", params.get("type", "default")))


def supported(config: Any) -> bool:
    return rope_type(config) not in LENGTH_DEPENDENT


def rotary_table(config: Any, positions: int, device: torch.device) -> RotaryTable:
    """The table for positions [0, positions) of `config` (its head_dim), on `device`."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)  # its frequencies, made on the host as HF makes them
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    freqs = torch.arange(positions, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary.attention_scaling
    return RotaryTable((emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous())

