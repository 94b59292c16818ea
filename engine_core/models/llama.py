"""Llama (Llama 2 and 3.x, and Mistral-style configs without a sliding window), written for the
engine: the base of Qwen2 (qwen2.py) and Qwen3 (qwen3.py), which change only their attention's
biases and norms.

A decoder layer is four products and the kit's ops (engine_core/layers/ops.py):

    h = norm(x)  ->  qkv = QKV(h)  ->  rope + KV write, attention  ->  o = O(attn)
    h = add_norm(o, residual)  ->  down(silu_mul(GATE_UP(h)))  ->  h = add_norm(mlp, residual)

with q, k and v in one product and gate and up in another (their weights merged as they load:
weights.py), the residual stream updated in place, and each layer's second add_norm already the
next layer's input norm (the last one the final norm). The forward is cut where the attention
is (`LlamaModel.begin`, `attention`, `between`, `end`): the same pieces run eagerly one after
another, or each captured in a CUDA graph with the attention eager between them
(engine_core/worker/piecewise.py).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.layers.ops import HeadShape, QKNorm, split_qkv
from engine_core.layers.parallel import HeadSplit, TensorParallel, split_error
from engine_core.layers.rotary import RotaryTable, rotary_table
from engine_core.layers.rotary import supported as rope_supported
from engine_core.models.parts import ModelKit, Part, RMSNorm, Slice, linear_into
from engine_core.models.registry import register
from engine_core.quant import fp8_kv


class LlamaAttention(nn.Module):
    qkv_proj: nn.Module  # nn.Linear, or what engine_core/layers/linear.py made of it
    o_proj: nn.Module

    def __init__(self, config: Any, layer: int, kit: ModelKit, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.layer, self.kit = layer, kit
        # this rank's heads (all of them without tensor parallelism)
        self.split = (HeadSplit(heads, 0, kv_heads, 0) if kit.tp is None
                      else kit.tp.heads(heads, kv_heads))
        self.shape = HeadShape(self.split.heads, self.split.kv_heads, dim)
        self.scale = dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.shape.qkv_width, bias=qkv_bias)
        self.o_proj = nn.Linear(self.shape.heads * dim, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(dim, config.rms_norm_eps) if qk_norm else None

    def core(self, qkv: torch.Tensor, positions: torch.Tensor, meta: Any, rotary: RotaryTable,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention between the QKV and output products: q and k rotated (and normed)
        in place, k and v into the cache, then the platform's attention; [T, H * D] (in
        `out`, [T, H, D], when given)."""
        k_cache, v_cache = meta.kv_caches[self.layer]
        qk_norm = None
        if self.q_norm is not None and self.k_norm is not None:
            qk_norm = QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        scales = meta.scales(self.layer)
        self.kit.ops.rope_and_cache(qkv, positions, rotary, self.shape, k_cache, v_cache,
                                    meta.slot_mapping, qk_norm, scales)
        q, k, v = split_qkv(qkv, self.shape)
        if meta.kv_scales is not None and meta.kv_scales.calibrating:  # the first batch's
            # K/V set the fp8 scales (--calculate-kv-scales): written again with them
            meta.kv_scales.calibrate(self.layer, k, v)
            fp8_kv.write(k_cache, v_cache, meta.slot_mapping, k, v, scales)
        attended = self.kit.attend(self.layer, q, k, v, self.scale, meta, out)
        return attended.view(qkv.shape[0], -1)


def mlp_width(intermediate: int, tp: TensorParallel | None) -> int:
    """This rank's columns of the MLP (all of them without tensor parallelism)."""
    return intermediate if tp is None else tp.columns(intermediate)[1]


class LlamaMLP(nn.Module):
    gate_up_proj: nn.Module
    down_proj: nn.Module

    def __init__(self, config: Any, kit: ModelKit) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.kit = kit
        width = mlp_width(config.intermediate_size, kit.tp)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=bias)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.kit.ops.silu_mul(self.gate_up_proj(h)))
        return out if self.kit.tp is None else self.kit.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    self_attn: LlamaAttention
    mlp: LlamaMLP
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def __init__(self, config: Any, layer: int, kit: ModelKit, attention: LlamaAttention
                 ) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = LlamaMLP(config, kit)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """The decoder: token ids in, the final norm's hidden states out (`forward`), or the same
    in pieces cut at each attention."""

    rotary: RotaryTable  # set by `prepare`, once the weights are in place
    norm: RMSNorm

    def __init__(self, config: Any, kit: ModelKit, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        self.config, self.kit = config, kit
        self.tp: TensorParallel | None = kit.tp
        vocab = config.vocab_size if self.tp is None else self.tp.vocab_rows(config.vocab_size)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> LlamaDecoderLayer:
        return cast(LlamaDecoderLayer, self.layers[i])

    def prepare(self, positions: int) -> None:
        """What is computed rather than loaded: the rotary table for `positions`."""
        self.rotary = rotary_table(self.config, positions, self.embed_tokens.weight.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states of every row, or of the rows `keep` only: the others'
        keys and values are written and attended like any, but the last layer's output
        product, MLP and the final norm skip them (no later layer reads them)."""
        residual, qkv = self.begin(ids)
        for i in range(self.num_layers):
            attended = self.attention(i, qkv, positions, meta)
            if i + 1 < self.num_layers:
                qkv = self.between(i, attended, residual)
        if keep is not None:
            if not len(keep):
                return residual.new_empty((0, residual.shape[1]))
            attended, residual = attended.index_select(0, keep), residual.index_select(0, keep)
        return self.end(attended, residual)

    # -- the pieces ---------------------------------------------------------------------------
    def begin(self, ids: torch.Tensor, residual: torch.Tensor | None = None,
              qkv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The embedding (the residual stream, into `residual` when given) and the first
        layer up to its QKV product (into `qkv` when given)."""
        weight = self.embed_tokens.weight
        if self.tp is not None:  # each rank its rows of the table, summed
            stream = self.tp.embed(ids, weight)
            stream = stream if residual is None else residual.copy_(stream)
        else:
            stream = (F.embedding(ids, weight) if residual is None
                      else torch.index_select(weight, 0, ids, out=residual))
        first = self.layer(0)
        h = self.kit.ops.rms_norm(stream, first.input_layernorm.weight,
                                  first.input_layernorm.eps)
        return stream, linear_into(first.self_attn.qkv_proj, h, qkv)

    def attention(self, i: int, qkv: torch.Tensor, positions: torch.Tensor, meta: Any,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's attention (what the piecewise graphs leave eager)."""
        return self.layer(i).self_attn.core(qkv, positions, meta, self.rotary, out)

    def between(self, i: int, attended: torch.Tensor, residual: torch.Tensor,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i after its attention, then layer i + 1 up to its QKV product."""
        following = self.layer(i + 1)
        h = self._finish(i, attended, residual, following.input_layernorm)
        return linear_into(following.self_attn.qkv_proj, h, qkv)

    def end(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer after its attention, and the final norm."""
        return self._finish(self.num_layers - 1, attended, residual, self.norm)

    def _finish(self, i: int, attended: torch.Tensor, residual: torch.Tensor,
                next_norm: RMSNorm) -> torch.Tensor:
        layer, ops = self.layer(i), self.kit.ops
        post = layer.post_attention_layernorm
        o = layer.self_attn.o_proj(attended)
        if self.tp is not None:  # each rank's heads' share of the output product, summed
            self.tp.all_reduce(o)
        h = ops.add_rms_norm(o, residual, post.weight, post.eps)
        return ops.add_rms_norm(layer.mlp(h), residual, next_norm.weight, next_norm.eps)


@register("LlamaForCausalLM", "MistralForCausalLM")
class LlamaForCausalLM(nn.Module):
    """The decoder (`model`) and the LM head's weight (`lm_head`, or the embedding when
    tied); the LM head itself runs in the engine (engine_core/layers/lm_head.py)."""

    qk_norm = False  # Qwen3's per-head norms of q and k

    def __init__(self, config: Any, kit: ModelKit) -> None:
        super().__init__()
        qkv_bias, o_bias = self.biases(config)
        layers = [LlamaDecoderLayer(config, i, kit,
                                    LlamaAttention(config, i, kit, qkv_bias, o_bias, self.qk_norm))
                  for i in range(config.num_hidden_layers)]
        self.model = LlamaModel(config, kit, layers)
        self.shape = layers[0].self_attn.shape
        self.intermediate = int(config.intermediate_size)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.tp = kit.tp
        self.vocab = int(config.vocab_size)
        vocab = self.vocab if self.tp is None else self.tp.vocab_rows(self.vocab)
        self.lm_head = None if self.tied else nn.Linear(config.hidden_size, vocab, bias=False)

    @staticmethod
    def biases(config: Any) -> tuple[bool, bool]:
        """Whether the QKV product and the output product have biases."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @classmethod
    def unsupported(cls, config: Any, max_model_len: int) -> str | None:
        """Why this file cannot serve `config` exactly as transformers would, or None."""
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r} (this file runs SiLU)"
        if not rope_supported(config):
            return "a rotary embedding whose frequencies change with the sequence's length"
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or ()
        if "sliding_attention" in layer_types or (window is not None
                                                  and window < max_model_len):
            return "sliding-window attention"
        return None

    @classmethod
    def tp_error(cls, config: Any, size: int) -> str | None:
        """Why this model cannot be split over `size` tensor-parallel ranks, or None."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return split_error(heads, kv_heads, int(config.intermediate_size), size)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def packed(self) -> dict[str, Part]:
        """The checkpoint's projections that load into a merged product, by name."""
        qkv = (self.shape.heads * self.shape.head_dim,) + (self.shape.kv_heads
                                                            * self.shape.head_dim,) * 2
        width = mlp_width(self.intermediate, self.tp)
        gate_up = (width, width)
        return {"q_proj": Part("qkv_proj", 0, qkv), "k_proj": Part("qkv_proj", 1, qkv),
                "v_proj": Part("qkv_proj", 2, qkv), "gate_proj": Part("gate_up_proj", 0, gate_up),
                "up_proj": Part("gate_up_proj", 1, gate_up)}

    def tp_slice(self, name: str, part: Part | None) -> Slice | None:
        """This rank's part of the checkpoint tensor that loads into parameter `name` (`part`
        of it, for a merged one); None: the whole tensor (no tensor parallelism, or a norm)."""
        tp = self.tp
        if tp is None:
            return None
        split, dim = self.shape, self.shape.head_dim
        first = self.model.layer(0).self_attn.split
        *_, kind, what = name.split(".")
        if kind == "qkv_proj" and part is not None:
            if part.shard == 0:
                return Slice(0, first.first_head * dim, split.heads * dim)
            return Slice(0, first.first_kv_head * dim, split.kv_heads * dim)
        if kind == "gate_up_proj":
            return Slice(0, *tp.columns(self.intermediate))
        if kind in ("o_proj", "down_proj"):
            if what == "bias":  # added once, by rank 0's partial sum
                return None if tp.rank == 0 else Slice(0, 0, 0)
            if kind == "down_proj":  # its inputs: this rank's MLP columns
                return Slice(1, *tp.columns(self.intermediate))
            return Slice(1, tp.rank * split.heads * dim, split.heads * dim)
        if kind in ("embed_tokens", "lm_head"):
            rows = tp.vocab_rows(self.vocab)
            return Slice(0, tp.rank * rows, max(0, min(rows, self.vocab - tp.rank * rows)))
        return None
