"""What the hardware allows: a step's bytes moved and FLOPs from the model's config, over the
H200's peaks (the figures issue 39 reasons with), for the "fraction of roofline" beside each
measured time.

A decode step reads every weight it multiplies by (the LM head's whole matrix, tied or not; of
the embedding only the rows looked up, which is nothing beside it) and each row's KV cache up
to its context; it is bound by memory at any batch the check runs. A prefill is bound by its
FLOPs: two per weight and token, plus the causal attention's QK^T and PV over the prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The H200 as issue 39 counts it: HBM bandwidth reached by a streaming kernel, and bf16 dense
# tensor-core peak (docs/gpu.md).
PEAK_BYTES_S = 4.3e12
PEAK_FLOPS_S = 790e12

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: str) -> ModelShape:
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(hidden=hidden, layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"],
                   dtype_bytes=DTYPE_BYTES[dtype])

    @classmethod
    def of_model(cls, model_dir: str | Path, dtype: str) -> ModelShape:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()), dtype)

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o, gate, up and down of one decoder layer."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        return attention + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """What one decode step reads of the weights: every layer's matrices and norms, the
        final norm, the LM head."""
        norms = (2 * self.layers + 1) * self.hidden
        params = self.layers * self.layer_matmul_params + self.head_params + norms
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def decode_step_bytes(self, batch: int, mean_context: float) -> float:
        return self.weight_bytes + batch * mean_context * self.kv_bytes_per_token

    def decode_step_flops(self, batch: int, mean_context: float) -> float:
        matmuls = 2 * batch * (self.layers * self.layer_matmul_params + self.head_params)
        attention = 4 * batch * self.layers * self.heads * self.head_dim * mean_context
        return matmuls + attention

    def decode_step_floor_s(self, batch: int, mean_context: float) -> float:
        """The fastest a decode step of `batch` rows at `mean_context` tokens can be."""
        return max(self.decode_step_bytes(batch, mean_context) / PEAK_BYTES_S,
                   self.decode_step_flops(batch, mean_context) / PEAK_FLOPS_S)

    def prefill_flops(self, prompts: int, length: int) -> float:
        """`prompts` fresh prompts of `length` tokens, logits for each one's last token."""
        matmuls = 2 * prompts * length * self.layers * self.layer_matmul_params
        causal_pairs = length * (length + 1) / 2
        attention = 4 * prompts * self.layers * self.heads * self.head_dim * causal_pairs
        return matmuls + attention + 2 * prompts * self.head_params

    def run_floor_s(self, prompts: int, concurrency: int, input_len: int,
                    output_len: int) -> float:
        """A whole benchmark's floor, as issue 39 counts it: every prefill at the FLOP peak,
        plus the decode steps of `prompts / concurrency` waves of `concurrency` rows, each at
        its memory floor (mean context halfway through the output)."""
        waves = -(-prompts // concurrency)
        batch = min(prompts, concurrency)
        steps = waves * max(output_len - 1, 0)
        step = self.decode_step_floor_s(batch, input_len + output_len / 2)
        return self.prefill_flops(prompts, input_len) / PEAK_FLOPS_S + steps * step


def fraction(floor_s: float, measured_s: float) -> float | None:
    """The floor over the measured time: 1.0 is the hardware's limit."""
    return floor_s / measured_s if measured_s > 0 else None
