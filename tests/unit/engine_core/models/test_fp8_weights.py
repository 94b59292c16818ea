"""fp8 weights in the model files (engine_core/models/quantization.py, weights.py): an fp8
checkpoint's weights and scales load bit for bit as stored (compressed-tensors per channel and
per tensor, the fp8 method; static input scales merged by their max; an ignored layer kept in
full precision), `--quantization fp8` quantizes each row as `quantize_rows` does, tensor
parallel ranks hold their rows and scales of exactly what one device holds, and every scheme
that is not supported is refused with its name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from engine_core.layers import attention
from engine_core.layers.ops import TorchOps
from engine_core.layers.parallel import TensorParallel
from engine_core.models import model_class
from engine_core.models.parts import ModelKit
from engine_core.models.quantization import Fp8Scheme, QuantizationError, fp8_scheme
from engine_core.models.weights import checkpoint_files, load_model
from engine_core.quant.fp8 import FP8, Fp8Linear, quantize_rows
from tests.unit.engine_core.models.fp8_checkpoints import (
    FORMATS,
    IGNORED,
    quantization_config,
    small_llama,
    write_fp8_checkpoint,
)

MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def load(folder: Path, quantization: str | None = None, tp: TensorParallel | None = None,
         ) -> Any:
    config = AutoConfig.from_pretrained(folder)
    return load_model(model_class(config), config, ModelKit(TorchOps(), attention.attend, tp),
                      checkpoint_files(folder), torch.float32, torch.device("cpu"), 256,
                      fp8_scheme(config, quantization))


def layers(model: Any) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in MERGED]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_fp8_checkpoint_loads_as_stored(tmp_path, fmt, static):
    ckpt = write_fp8_checkpoint(tmp_path, fmt, static)
    model = load(ckpt.folder)
    stored = ckpt.stored
    checked = 0
    for name, layer in layers(model):
        parent, kind = name.rsplit(".", 1)
        sources = [f"{parent}.{p}" for p in MERGED[kind]]
        if sources == [IGNORED] and fmt == "ct-channel":
            assert type(layer) is nn.Linear
            assert torch.equal(layer.weight, stored[IGNORED + ".weight"])
            continue
        assert isinstance(layer, Fp8Linear) and layer.weight.dtype == FP8
        weight = torch.cat([stored[s + ".weight"] for s in sources])
        assert torch.equal(bits(layer.weight), bits(weight))
        scales = torch.cat([stored[s + ".weight_scale"].float().reshape(-1).expand(
            stored[s + ".weight"].shape[0]) for s in sources])
        assert torch.equal(layer.weight_scale, scales)
        if static:
            assert layer.activations == "static" and layer.input_scale is not None
            assert float(layer.input_scale) == max(float(stored[s + ".input_scale"])
                                                   for s in sources)
        else:
            assert layer.input_scale is None and layer.activations == "token"
        checked += 1
    assert checked == 8 - (fmt == "ct-channel")
    assert model.lm_head.weight.dtype == torch.float32  # the head and embedding as they were
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])


def test_quantization_fp8_quantizes_each_row_as_it_loads(tmp_path):
    reference = small_llama(1)
    reference.save_pretrained(tmp_path)
    model = load(tmp_path, "fp8")
    state = reference.state_dict()
    for name, layer in layers(model):
        parent, kind = name.rsplit(".", 1)
        whole = torch.cat([state[f"{parent}.{p}.weight"] for p in MERGED[kind]])
        q, scales = quantize_rows(whole)
        assert isinstance(layer, Fp8Linear)
        assert torch.equal(bits(layer.weight), bits(q))
        assert torch.equal(layer.weight_scale, scales)
    assert model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("fmt", ["dynamic", "ct-channel", "fp8"])
def test_tensor_parallel_ranks_hold_their_part_of_one_devices_weights(tmp_path, fmt):
    """Column-parallel products (q/k/v, gate/up): each rank its rows with their scales;
    row-parallel ones (o, down): its columns, every scale (of whole rows)."""
    if fmt == "dynamic":
        small_llama(2).save_pretrained(tmp_path)
        folder, quantization = tmp_path, "fp8"
    else:
        folder, quantization = write_fp8_checkpoint(tmp_path, fmt, static=True).folder, None
    whole = dict(layers(load(folder, quantization)))
    heads, kv_heads, dim = 4, 2, 16
    for rank in range(2):
        part = dict(layers(load(folder, quantization, TensorParallel(rank, 2))))
        for name, layer in part.items():
            one = whole[name]
            kind = name.rsplit(".", 1)[-1]
            if kind == "qkv_proj":
                q = rank * heads // 2 * dim, heads // 2 * dim
                kv = rank * kv_heads // 2 * dim, kv_heads // 2 * dim
                rows = [torch.arange(a, a + n) for a, n in
                        (q, (heads * dim + kv[0], kv[1]), ((heads + kv_heads) * dim + kv[0],
                                                           kv[1]))]
            elif kind == "gate_up_proj":
                rows = [torch.arange(a + rank * 64, a + rank * 64 + 64) for a in (0, 128)]
            else:
                width = layer.weight.shape[1]
                assert torch.equal(bits(layer.weight),
                                   bits(one.weight[:, rank * width:(rank + 1) * width]))
                if isinstance(layer, Fp8Linear):  # (not the layer the checkpoint ignores)
                    assert torch.equal(layer.weight_scale, one.weight_scale)
                continue
            index = torch.cat(rows)
            assert torch.equal(bits(layer.weight), bits(one.weight[index]))
            assert torch.equal(layer.weight_scale, one.weight_scale[index])
            if layer.input_scale is not None:
                assert torch.equal(layer.input_scale, one.input_scale)


def _ct(weights: dict[str, Any] | None = None, activations: Any = "token",
        **top: Any) -> dict[str, Any]:
    config = quantization_config("ct-channel", False)
    group = config["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    if activations is None:
        group["input_activations"] = None
    elif isinstance(activations, dict):
        group["input_activations"].update(activations)
    return config | top


UNSUPPORTED = {
    "block-wise fp8": ({"quant_method": "fp8", "weight_block_size": [128, 128]},
                       "weight_block_size"),
    "gptq": ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    "awq": ({"quant_method": "awq", "bits": 4}, "'awq'"),
    "int8 weights": (_ct({"type": "int"}), "type 'int'"),
    "int4 weights": (_ct({"num_bits": 4, "type": "int"}), "4 bits"),
    "pack-quantized": (_ct(format="pack-quantized"), "'pack-quantized'"),
    "group strategy": (_ct({"strategy": "group", "group_size": 128}), "'group'"),
    "weight-only": (_ct(activations=None), "weight-only"),
    "static per-token": (_ct(activations={"dynamic": False}), "'token' (static)"),
    "kv cache scheme": (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}),
                        "kv_cache_scheme"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_schemes_are_refused_by_name(case):
    stored, words = UNSUPPORTED[case]
    config = AutoConfig.for_model("llama")
    config.quantization_config = stored
    with pytest.raises(QuantizationError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fp8_scheme(config, None)
    with pytest.raises(QuantizationError):
        fp8_scheme(config, "fp8")  # the flag does not override what the checkpoint is


def test_the_scheme_of_each_source():
    plain = AutoConfig.for_model("llama")
    assert fp8_scheme(plain, None) is None
    assert fp8_scheme(plain, "fp8") == Fp8Scheme("dynamic", "channel", "token")
    with pytest.raises(QuantizationError, match="--quantization 'int8'"):
        fp8_scheme(plain, "int8")
    plain.quantization_config = quantization_config("ct-tensor", True)
    scheme = fp8_scheme(plain, "fp8")
    assert scheme == Fp8Scheme("compressed-tensors", "tensor", "static", ("lm_head",))
    assert scheme.prequantized and scheme.ignores("lm_head")
    assert Fp8Scheme("fp8", "tensor", "token", ("re:.*mlp.*",)).ignores("model.layers.3.mlp.up")
