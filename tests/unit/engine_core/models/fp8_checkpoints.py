"""fp8 checkpoints written as llm-compressor and the "fp8" method write them, for the loader's
and the engine's tests: a small random Llama's decoder linears quantized here, plainly
(scale = amax / 448 per tensor or per output channel, weight / scale cast to e4m3), saved
with config.json's `quantization_config`; beside it the same model with the dequantized
weights in float32, for Hugging Face to run as the reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

FORMATS = ("ct-channel", "ct-tensor", "fp8")  # compressed-tensors per channel / per tensor; fp8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORED = "model.layers.1.mlp.down_proj"  # kept in full precision by the per-channel one


class Fp8Checkpoint(NamedTuple):
    folder: Path  # the fp8 checkpoint
    reference: Path  # its dequantized model, full precision
    stored: dict[str, torch.Tensor]  # the checkpoint's tensors, as saved


def small_llama(seed: int = 0) -> Any:
    """A random Llama (biases off, its own LM head) with weights wide enough (0.2) that its
    logits are not flat."""
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def quantization_config(fmt: str, static: bool) -> dict[str, Any]:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    activations = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                    "symmetric": True} if static else
                   {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                    "symmetric": True})
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if fmt == "ct-channel" else "tensor"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"] + ([IGNORED] if fmt == "ct-channel" else [])}


def write_fp8_checkpoint(root: Path, fmt: str, static: bool = False, seed: int = 0,
                         input_scales: dict[str, float] | None = None) -> Fp8Checkpoint:
    """`static`: each projection an input scale, from `input_scales` (by module name) where
    given, else an arbitrary one of 0.01, 0.02, 0.03."""
    model = small_llama(seed)
    stored: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    ignored = {IGNORED} if fmt == "ct-channel" else set()
    for i, (name, w) in enumerate(model.state_dict().items()):
        module = name.rsplit(".", 1)[0]
        if module.rsplit(".", 1)[-1] not in LINEARS or module in ignored:
            stored[name] = w.contiguous()
            continue
        if fmt == "ct-channel":
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # [out, 1]
        else:
            scale = (w.abs().amax() / 448.0).reshape(1 if fmt == "ct-tensor" else ())
        q = (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        stored[name] = q
        stored[module + ".weight_scale"] = scale.contiguous()
        if static:  # each projection its own, so a merged product's parts differ
            value = (input_scales or {}).get(module, 0.01 * (1 + i % 3))
            stored[module + ".input_scale"] = torch.tensor(value).reshape(
                1 if fmt != "fp8" else ())
        dequantized[name] = q.float() * scale.reshape(-1, 1)
    folder, reference = root / f"{fmt}{'-static' if static else ''}", root / f"{fmt}-reference"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(fmt, static)
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, w in dequantized.items():
            model.get_parameter(name).copy_(w)
    model.save_pretrained(reference)
    return Fp8Checkpoint(folder, reference, stored)


def dequantized_copy(folder: Path, out: Path) -> Path:
    """`folder`'s model with each decoder linear weight replaced by its quantized-then-
    dequantized self (the engine's `quantize_rows`, tested against a plain reference in
    tests/unit/engine_core/layers/test_fp8.py), saved to `out`: what `--quantization fp8`
    computes on the CPU."""
    from engine_core.quant.fp8 import dequantize, quantize_rows

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
                p.copy_(dequantize(*quantize_rows(p), torch.float32))
    model.save_pretrained(out)
    return out
