"""Tandem's model files (engine_core/models/) against transformers' own classes: each family's
hidden states on small random checkpoints (Llama with biases and llama3 rope scaling, Qwen2's
QKV bias, Qwen3's q/k norms and own head_dim), bit for bit with the reference ops; the forward
in pieces equal to the whole; the weight loader's merging and its errors; the registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine_core.layers import attention
from engine_core.layers.ops import TorchOps
from engine_core.models import MODELS, model_class
from engine_core.models.llama import LlamaForCausalLM
from engine_core.models.parts import ModelKit
from engine_core.models.qwen3 import Qwen3ForCausalLM
from engine_core.models.weights import checkpoint_files, load_model

KIT = ModelKit(TorchOps(), attention.attend)
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0,
                                                  "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}),
    "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=40, attention_bias=True),
}


def checkpoint(tmp_path: Path, make: Any, seed: int = 0) -> tuple[Path, Any]:
    """A transformers model of the config, random (weights scaled up: logits not flat), saved."""
    config = make()
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "qwen3": "Qwen3ForCausalLM"}[config.model_type]]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path)
    return tmp_path, model


def ours(folder: Path) -> Any:
    config = AutoConfig.from_pretrained(folder)
    return load_model(model_class(config), config, KIT, checkpoint_files(folder), torch.float32,
                      torch.device("cpu"), 256)


def prefill_meta(config: Any, tokens: int, head_dim: int) -> tuple[Any, torch.Tensor]:
    """One sequence's first chunk of `tokens`: its metadata over a fresh cache, its positions."""
    bs, blocks = 16, -(-tokens // 16)
    caches = [(torch.zeros(blocks * bs, config.num_key_value_heads, head_dim),
               torch.zeros(blocks * bs, config.num_key_value_heads, head_dim))
              for _ in range(config.num_hidden_layers)]
    meta, positions = attention.build_metadata(np.array([0]), np.array([tokens]),
                                               np.arange(blocks)[None], bs, caches,
                                               torch.device("cpu"))
    return meta, torch.from_numpy(positions)


@pytest.mark.parametrize("family", list(CONFIGS))
@torch.inference_mode()
def test_hidden_states_are_transformers_own(tmp_path, family):
    folder, reference = checkpoint(tmp_path, CONFIGS[family])
    model = ours(folder)
    config = reference.config
    ids = torch.randint(0, config.vocab_size, (29,), generator=torch.Generator().manual_seed(1))
    meta, positions = prefill_meta(config, len(ids), model.shape.head_dim)
    want = reference.model(input_ids=ids[None]).last_hidden_state[0]
    assert torch.equal(model.model(ids, positions, meta), want)
    head = reference.get_output_embeddings().weight
    assert torch.equal(model.head_weight, head)
    assert (model.lm_head is None) == (family == "llama-tied")


@torch.inference_mode()
def test_the_forward_in_pieces_into_given_buffers_is_the_forward(tmp_path):
    folder, _ = checkpoint(tmp_path, CONFIGS["qwen3"])
    model = ours(folder).model
    config = model.config
    ids = torch.randint(0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(2))
    meta, positions = prefill_meta(config, len(ids), 40)
    want = model(ids, positions, meta)
    width = model.layer(0).self_attn.shape.qkv_width
    # buffers wider than the step, as a piecewise graph's
    residual, qkv = torch.empty(20, config.hidden_size), torch.empty(20, width)
    attended = torch.empty(20, 4, 40)
    stream, q = model.begin(ids, residual[:13], qkv[:13])
    assert stream.data_ptr() == residual.data_ptr() and q.data_ptr() == qkv.data_ptr()
    for i in range(model.num_layers):
        out = model.attention(i, qkv[:13], positions, meta, attended[:13])
        assert out.data_ptr() == attended.data_ptr()
        if i + 1 < model.num_layers:
            model.between(i, out, residual[:13], qkv[:13])
    torch.testing.assert_close(model.end(out, residual[:13]), want, rtol=1e-6, atol=1e-6)


def test_merged_projections_hold_the_checkpoints_parts_in_order(tmp_path):
    folder, reference = checkpoint(tmp_path, CONFIGS["qwen2"])
    layer = ours(folder).model.layer(1)
    hf = reference.model.layers[1]
    parts = [hf.self_attn.q_proj, hf.self_attn.k_proj, hf.self_attn.v_proj]
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([p.weight for p in parts]))
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([p.bias for p in parts]))
    assert layer.self_attn.o_proj.bias is None  # Qwen2: biases on q, k and v only
    assert torch.equal(layer.mlp.gate_up_proj.weight,
                       torch.cat([hf.mlp.gate_proj.weight, hf.mlp.up_proj.weight]))


def _rewrite(folder: Path, edit: Any) -> None:
    from safetensors.torch import load_file

    (path,) = checkpoint_files(folder)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     "no weights for model.layers.1.self_attn.qkv_proj.weight"),
    (lambda t: t.pop("model.norm.weight"), "no weights for model.norm.weight"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
     "model.layers.0.extra.weight has no place"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(5, 64)}),
     r"up_proj.weight is \(5, 64\)"),
])
def test_a_checkpoint_that_does_not_fit_is_an_error_naming_the_tensor(tmp_path, edit, message):
    folder, _ = checkpoint(tmp_path, CONFIGS["llama-tied"])
    _rewrite(folder, edit)
    with pytest.raises(ValueError, match=message):
        ours(folder)


def test_what_the_loader_leaves_out_on_purpose(tmp_path):
    """transformers' rotary buffer of old checkpoints; a tied model's copy of its head."""
    folder, _ = checkpoint(tmp_path, CONFIGS["llama-tied"])

    def add(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    _rewrite(folder, add)
    assert ours(folder).lm_head is None


def test_the_registry_and_what_a_file_declines():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(MODELS)
    qwen3 = Qwen3Config(**SMALL)
    qwen3.architectures = ["Qwen3ForCausalLM"]
    assert model_class(qwen3) is Qwen3ForCausalLM
    other = LlamaConfig(**SMALL)
    other.architectures = ["GemmaForCausalLM"]
    assert model_class(other) is None
    assert LlamaForCausalLM.unsupported(LlamaConfig(**SMALL), 256) is None
    assert "hidden_act" in LlamaForCausalLM.unsupported(LlamaConfig(**SMALL, hidden_act="gelu"),
                                                        256)
    dynamic = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                    "rope_theta": 10000.0})
    assert "length" in LlamaForCausalLM.unsupported(dynamic, 256)
    windowed = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32,
                           max_window_layers=1)
    assert "sliding" in Qwen3ForCausalLM.unsupported(windowed, 256)
    mistral = LlamaConfig(**SMALL)
    mistral.sliding_window = 4096  # Mistral 7B v0.1's: no window within 4096 positions
    assert LlamaForCausalLM.unsupported(mistral, 4096) is None
    assert "sliding" in LlamaForCausalLM.unsupported(mistral, 8192)
