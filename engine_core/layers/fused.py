"""The decoder layers' elementwise work fused into a few compiled kernels, on the CPU.

transformers' Llama and Qwen2 layers run RMSNorm, the rotary embedding, SiLU(gate) * up and
the residual adds as some 30 small torch ops per layer, each a pass over memory and a
dispatch. `fuse_decoder` swaps each such layer for a `FusedDecoderLayer` that runs the same
sublayers (the projections, whatever linear.py made of them, and the platform's attention
function) with that work done by `ElementwiseOps`: one pass per RMSNorm with the residual
add folded in, one for SiLU × up, one per rotary application, in place where the tensor is
the layer's own. The projections that read the same input run as one product each (q, k
and v; gate and up: `merge_linears`, done before linear.py prepares them), so a decode step
hands each layer's products to the threads four times, not seven. The arithmetic is the
modules' own, in the same order, in float32; only RMSNorm's sum (vectorised) and the vector
expf of the kernels' -ffast-math build differ from torch's, in the last bits (HF parity
holds: tests/engine/test_fused_parity.py).

The kernels are csrc/kernels.c's, built with the LM head's (native.py): nothing to compile
at start-up beyond them. torch.compile (inductor) was measured against them and lost:
docs/benchmarks.md. Which layers are fused is decided by class, exactly: a subclass may
change the forward, so it keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

from engine_core.layers import native

FUSABLE_LAYERS = (LlamaDecoderLayer, Qwen2DecoderLayer)
FUSABLE_NORMS = (LlamaRMSNorm, Qwen2RMSNorm)


class ElementwiseOps:
    """The fused ops over rows of float32 values (tensors [rows, n], contiguous), through the
    compiled kernels, on the calling thread, as torch ran them on a small box (sharing them
    over the linears' pool measured no faster on a busy 2-core machine). Outputs may reuse an
    input's memory, as each method says: a fresh tensor of a large step costs page faults."""

    def __init__(self, kernels: native.Kernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """`norm(x)`, x left as it is."""
        return self._norm(x, None, norm)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: Any) -> torch.Tensor:
        """`norm(x + residual)`; the sum is left in `x` (the residual stream from here)."""
        return self._norm(x, residual, norm)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` [rows, n] of gate_up [rows, 2n], gate then up side by side."""
        assert gate_up.is_contiguous()
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, width, dtype=gate_up.dtype)
        self.kernels.silu_mul(gate_up.data_ptr(), rows, width, out.data_ptr())
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_dim: int) -> torch.Tensor:
        """transformers' `apply_rotary_pos_emb` on x [rows, heads * head_dim] (rows may be
        strided: columns of a wider tensor) with cos and sin [rows, head_dim], in place."""
        rows, width = x.shape
        assert x.stride(1) == 1
        self.kernels.rotary(x.data_ptr(), x.stride(0), rows, width // head_dim, head_dim,
                            cos.data_ptr(), sin.data_ptr(), head_dim)
        return x

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None,
              norm: Any) -> torch.Tensor:
        out = torch.empty_like(x)
        self.kernels.rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                              norm.weight.data_ptr(), norm.variance_epsilon, x.shape[0],
                              x.shape[1], out.data_ptr())
        return out


class FusedDecoderLayer(nn.Module):
    """A Llama or Qwen2 decoder layer (`layer`'s own submodules) with its elementwise work
    fused; called as the layer was. Every tensor a kernel writes in place is one this layer
    made: a projection's output (the linears return new tensors)."""

    # transformers' modules, typed loosely: used through their own attributes
    self_attn: Any
    mlp: Any
    input_layernorm: Any
    post_attention_layernorm: Any

    def __init__(self, layer: Any, ops: ElementwiseOps) -> None:
        super().__init__()
        self.self_attn = attn = layer.self_attn
        self.mlp = mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.ops = ops
        # The projections of one input merged into one product each (one pass over the
        # input, one hand-off to the threads): the originals leave the modules, their weights
        # now the merged ones' parts.
        self.widths = (attn.q_proj.out_features, attn.k_proj.out_features)
        self.qkv_proj = merge_linears(attn.q_proj, attn.k_proj, attn.v_proj)
        self.gate_up_proj = merge_linears(mlp.gate_proj, mlp.up_proj)
        attn.q_proj = attn.k_proj = attn.v_proj = mlp.gate_proj = mlp.up_proj = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs: Any) -> torch.Tensor:
        assert position_embeddings is not None, "the model computes the rotary embedding"
        lead, width = hidden_states.shape[:-1], hidden_states.shape[-1]
        x = hidden_states.reshape(-1, width).contiguous()
        h = self.ops.rms_norm(x, self.input_layernorm)
        attended = self._attention(h, lead, position_embeddings, attention_mask, kwargs)
        h = self.ops.add_rms_norm(attended, x, self.post_attention_layernorm)
        out = self.mlp.down_proj(self.ops.silu_mul(self.gate_up_proj(h)))
        return out.add_(attended).view(*lead, width)

    def _attention(self, h: torch.Tensor, lead: torch.Size,
                   position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        """transformers' attention forward on rows h [rows, hidden], rotary fused; the
        output projection's [rows, hidden]."""
        attn = self.self_attn
        rows, dim = h.shape[0], attn.head_dim
        cos, sin = (t.expand(*lead, dim).reshape(rows, dim).contiguous()
                    for t in position_embeddings)
        qkv = self.qkv_proj(h)
        q_width, k_width = self.widths
        q = self.ops.rotary(qkv[:, :q_width], cos, sin, dim)
        k = self.ops.rotary(qkv[:, q_width:q_width + k_width], cos, sin, dim)
        v = qkv[:, q_width + k_width:]
        query, key, value = (t.view(*lead, -1, dim).transpose(1, 2) for t in (q, k, v))
        kwargs = {name: arg for name, arg in kwargs.items() if name != "cache"}
        if hasattr(attn, "sliding_window"):  # Qwen2 passes it on; Llama has none
            kwargs["sliding_window"] = attn.sliding_window
        interface = ALL_ATTENTION_FUNCTIONS[attn.config._attn_implementation]
        out, _ = interface(attn, query, key, value, attention_mask, dropout=0.0,
                           scaling=attn.scaling, **kwargs)
        return attn.o_proj(out.reshape(rows, -1).contiguous()).contiguous()


class FusedRMSNorm(nn.Module):
    """The decoder's final RMSNorm through the fused kernel."""

    norm: Any

    def __init__(self, norm: Any, ops: ElementwiseOps) -> None:
        super().__init__()
        self.norm = norm
        self.ops = ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        width = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, width).contiguous()
        return self.ops.rms_norm(x, self.norm).view(hidden_states.shape)


def fuse_decoder(decoder: nn.Module, ops: ElementwiseOps) -> int:
    """Swap every fusable layer of `decoder` (its `layers`, a ModuleList) for a
    FusedDecoderLayer, and its final norm for a FusedRMSNorm; return how many layers."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return 0
    fused = 0
    for i, layer in enumerate(layers):
        if fusable(layer):
            layers[i] = FusedDecoderLayer(layer, ops)
            fused += 1
    norm: Any = getattr(decoder, "norm", None)
    if fused and type(norm) in FUSABLE_NORMS and _float32(norm):
        decoder.norm = FusedRMSNorm(norm, ops)
    return fused


def fusable(layer: Any) -> bool:
    """A Llama or Qwen2 layer, exactly, in float32, with a SiLU MLP and plain linear
    projections (which it merges)."""
    if type(layer) not in FUSABLE_LAYERS:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    return (all(type(n) in FUSABLE_NORMS and _float32(n) for n in norms)
            and type(mlp.act_fn) is SiLUActivation
            and all(type(p) is nn.Linear for p in projections))


def merge_linears(*linears: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output is the given ones' side by side, for the same input: their
    weights (and biases, zeros where one has none) stacked by output. Each output is the same
    dot product as before."""
    first = linears[0]
    merged = nn.Linear(first.in_features, sum(x.out_features for x in linears),
                       bias=any(x.bias is not None for x in linears),
                       device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        merged.weight.copy_(torch.cat([x.weight for x in linears]))
        if merged.bias is not None:
            merged.bias.copy_(torch.cat([x.bias if x.bias is not None
                                         else torch.zeros(x.out_features, dtype=x.weight.dtype)
                                         for x in linears]))
    return merged.requires_grad_(False)


def _float32(norm: Any) -> bool:
    return norm.weight.dtype == torch.float32 and norm.weight.device.type == "cpu"
