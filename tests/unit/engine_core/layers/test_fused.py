"""The fused elementwise kernels (fused.py) against transformers' own modules: each op, a whole
decoder of Llama and of Qwen2 swapped in place, what is left alone, and the platform's knob."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaModel, Qwen2Config, Qwen2Model
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

from engine_core.config import EngineConfig
from engine_core.layers.fused import (
    ElementwiseOps,
    FusedDecoderLayer,
    FusedRMSNorm,
    fuse_decoder,
    merge_linears,
)
from engine_core.worker.platform import Platform
from tests.unit.engine_core.heads import engine_kernels

KERNELS = engine_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: no CPU kernels here")
CPU = EngineConfig(model="m", device="cpu")


@pytest.fixture
def ops() -> ElementwiseOps:
    assert KERNELS is not None
    return ElementwiseOps(KERNELS)


def _norm(width: int) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(3))
    return norm


def test_rms_norm_as_transformers(ops):
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)) * 3
    norm = _norm(96)
    before = x.clone()
    torch.testing.assert_close(ops.rms_norm(x, norm), norm(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, before)


def test_add_rms_norm_leaves_the_sum_in_place(ops):
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(19, 64, generator=g), torch.randn(19, 64, generator=g)
    total, kept = x + residual, residual.clone()
    norm = _norm(64)
    out = ops.add_rms_norm(x, residual, norm)
    torch.testing.assert_close(out, norm(total), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, total) and torch.equal(residual, kept)


def test_silu_mul_of_gate_and_up_side_by_side(ops):
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(5, 333, generator=g) * 8, torch.randn(5, 333, generator=g)
    expected = torch.nn.functional.silu(gate) * up
    out = ops.silu_mul(torch.cat([gate, up], dim=1))
    assert out.shape == (5, 333)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_merged_linears_give_each_ones_output_side_by_side():
    g = torch.Generator().manual_seed(3)
    with_bias, without = torch.nn.Linear(24, 10), torch.nn.Linear(24, 6, bias=False)
    x = torch.randn(7, 24, generator=g)
    merged = merge_linears(with_bias, without)
    assert (merged.in_features, merged.out_features) == (24, 16)
    out = merged(x)
    torch.testing.assert_close(out[:, :10], with_bias(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:, 10:], without(x), rtol=1e-6, atol=1e-6)


def test_rotary_as_transformers(ops):
    rows, heads, kv_heads, dim = 11, 4, 2, 32
    g = torch.Generator().manual_seed(4)
    q = torch.randn(rows, heads * dim, generator=g)
    k = torch.randn(rows, kv_heads * dim, generator=g)
    angles = torch.rand(rows, dim // 2, generator=g) * 50
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    # transformers' layout: [batch, heads, tokens, dim], cos/sin [batch, tokens, dim]
    q_ref, k_ref = apply_rotary_pos_emb(q.view(1, rows, heads, dim).transpose(1, 2),
                                        k.view(1, rows, kv_heads, dim).transpose(1, 2),
                                        cos[None], sin[None])
    qk = torch.cat([q, k], dim=1)  # as the merged projection leaves them: side by side
    ops.rotary(qk[:, :heads * dim], cos, sin, dim)
    ops.rotary(qk[:, heads * dim:], cos, sin, dim)
    q, k = qk[:, :heads * dim], qk[:, heads * dim:]
    torch.testing.assert_close(q.view(1, rows, heads, dim).transpose(1, 2), q_ref,
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.view(1, rows, kv_heads, dim).transpose(1, 2), k_ref,
                               rtol=1e-6, atol=1e-6)


def _llama(**kw) -> LlamaModel:
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="sdpa", **kw)
    torch.manual_seed(0)
    return LlamaModel(config).eval()


def _qwen2() -> Qwen2Model:
    config = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2Model(config).eval()


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2"])
@torch.inference_mode()
def test_fused_decoder_gives_the_models_hidden_states(ops, build):
    model = build()
    ids = torch.randint(0, 300, (1, 23), generator=torch.Generator().manual_seed(5))
    expected = model(input_ids=ids).last_hidden_state
    assert fuse_decoder(model, ops) == model.config.num_hidden_layers
    assert all(isinstance(layer, FusedDecoderLayer) for layer in model.layers)
    assert isinstance(model.norm, FusedRMSNorm)
    torch.testing.assert_close(model(input_ids=ids).last_hidden_state, expected,
                               rtol=1e-5, atol=1e-5)


def test_what_is_not_llama_or_qwen2_in_float32_with_silu_is_left_alone(ops):
    class Subclass(LlamaDecoderLayer):  # may change the forward
        pass

    model = _llama()
    model.layers[1] = Subclass(model.config, 1)
    assert fuse_decoder(model, ops) == 2 and type(model.layers[1]) is Subclass
    assert fuse_decoder(_llama(hidden_act="gelu"), ops) == 0
    assert fuse_decoder(_llama().to(torch.bfloat16), ops) == 0
    assert fuse_decoder(torch.nn.Linear(2, 2), ops) == 0  # no layers at all


def test_platform_fuses_on_the_cpu_in_float32_unless_told_not_to():
    assert Platform.detect(CPU, environ={}).fused_elementwise
    assert Platform.detect(CPU, environ={"TANDEM_FUSED": "1"}).fused_elementwise
    assert not Platform.detect(CPU, environ={"TANDEM_FUSED": "0"}).fused_elementwise
    # the kernels are the CPU's, for float32: without them (or in bf16), transformers' ops
    assert not Platform.detect(CPU, environ={"TANDEM_NATIVE": "0",
                                             "TANDEM_FUSED": "1"}).fused_elementwise
    bf16 = EngineConfig(model="m", device="cpu", dtype="bfloat16")
    assert not Platform.detect(bf16, environ={}).fused_elementwise
    with pytest.raises(ValueError, match="TANDEM_FUSED"):
        Platform.detect(CPU, environ={"TANDEM_FUSED": "yes"})
