"""A peft LoRA adapter as the engine holds it: read from its folder (`adapter_config.json` and
`adapter_model.safetensors`), checked against what the engine serves, its A and B matrices by
layer and projection, B already scaled (alpha / r, or alpha / sqrt(r) with rsLoRA).

The engine serves adapters of the decoder layers' linears (q, k, v, o, gate, up, down: any
subset, any layers), rank at most `--max-lora-rank`, without biases, DoRA, per-module ranks or
trained embeddings/heads: anything else is a clear error naming what it found.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.engine_args import LoRAModule

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAError(ValueError):
    """An adapter the engine cannot serve; the message says why."""


__all__ = ["LoRAAdapter", "LoRAError", "LoRAModule", "read_adapter"]


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    # (layer, target) -> (A [r, in], B [out, r] times the scale), on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(module: LoRAModule, max_rank: int, num_layers: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter in `module.path`, checked; raises LoRAError."""
    folder = Path(module.path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {module.name!r}: {folder} has no adapter_config.json and "
                        "adapter_model.safetensors (peft's format)")
    config = json.loads(config_file.read_text())
    problem = _config_problem(config, max_rank)
    if problem is not None:
        raise LoRAError(f"LoRA adapter {module.name!r}: {problem}")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.search(key)
        if match is None:
            raise LoRAError(f"LoRA adapter {module.name!r}: weight {key!r} is not a LoRA matrix "
                            f"of a decoder layer's {', '.join(TARGETS)}")
        layer, target, which = int(match[1]), match[2], match[3]
        if target not in TARGETS or layer >= num_layers:
            raise LoRAError(f"LoRA adapter {module.name!r}: {key!r} adapts a module this model "
                            "does not have")
        pairs.setdefault((layer, target), {})[which] = tensor
    weights = {}
    for where, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {module.name!r}: layer {where[0]} {where[1]} lacks "
                            f"lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {module.name!r}: layer {where[0]} {where[1]} has "
                            f"rank {a.shape[0]}, not r = {rank}")
        weights[where] = (a.to(dtype), (b.float() * scale).to(dtype))
    return LoRAAdapter(module.name, rank, weights)


def _config_problem(config: dict, max_rank: int) -> str | None:
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config.get('peft_type')!r} (only LORA is served)"
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        return f"r {rank!r} is not a rank"
    if rank > max_rank:
        return f"rank {rank} is above --max-lora-rank {max_rank}"
    for key, what in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
                      ("modules_to_save", "trained modules beside the adapter"),
                      ("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                      ("lora_bias", "LoRA biases")):
        if config.get(key):
            return f"{what} ({key}) are not served"
    if config.get("bias", "none") != "none":
        return f"bias {config['bias']!r} (only 'none' is served)"
    return None
