"""Which fp8 scheme a model runs with: `--quantization fp8` on a full-precision checkpoint
(quantized here, as it loads), or an fp8 checkpoint's own `quantization_config`, loaded as it
is stored.

Two checkpoint formats are read: compressed-tensors' "float-quantized" (llm-compressor's
FP8 and FP8_DYNAMIC schemes: weights per tensor or per channel, activations per token or per
tensor, dynamic or static) and the "fp8" method (per-tensor `weight_scale`, optional
`input_scale`, `activation_scheme` dynamic or static). Anything else that config.json says
is quantized (block-wise fp8, int8/int4, GPTQ, AWQ, a KV-cache scheme, ...) is refused at
start-up with its name (`QuantizationError`). `fp8_linears` turns a model file's decoder
linears into `Fp8Linear`s (engine_core/quant/fp8.py) before its weights load; the LM head
and the embedding stay in the model's dtype.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from engine_core.quant.fp8 import Activations, Fp8Linear

QUANTIZATIONS = ("fp8",)  # --quantization's choices
DECODER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantizationError(ValueError):
    """A quantization this engine does not run; the message names it."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How the decoder's linears are held and computed in fp8."""

    # "dynamic": quantized here as the weights load (--quantization fp8); else the
    # checkpoint's format ("compressed-tensors" or "fp8"), its fp8 weights loaded as they are
    source: Literal["dynamic", "compressed-tensors", "fp8"]
    weight_scales: Literal["channel", "tensor"]  # as the checkpoint stores them
    activations: Activations  # on the fp8 GEMM: per token, per tensor, or static scales
    ignore: tuple[str, ...] = ()  # modules left in full precision: names, or "re:" patterns

    @property
    def prequantized(self) -> bool:
        return self.source != "dynamic"

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint keeps `module` (e.g. "model.layers.0.mlp.down_proj")
        unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif entry == module:
                return True
        return False

    def describe(self) -> str:
        """For the log."""
        where = ("quantized at load" if self.source == "dynamic"
                 else f"{'an' if self.source == 'fp8' else 'a'} {self.source} checkpoint")
        return (f"fp8 weights ({where}, per-{self.weight_scales} scales), activations "
                f"{'static' if self.activations == 'static' else 'per ' + self.activations}")


def fp8_scheme(hf_config: Any, quantization: str | None) -> Fp8Scheme | None:
    """The scheme for a model whose config is `hf_config` served with `--quantization`
    (None: only what the checkpoint says); None: full precision."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {quantization!r}: choose "
                                f"{', '.join(QUANTIZATIONS)}")
    stored = getattr(hf_config, "quantization_config", None)
    if stored is not None and not isinstance(stored, dict):
        stored = stored.to_dict() if hasattr(stored, "to_dict") else vars(stored)
    if stored:
        return _checkpoint_scheme(stored)
    if quantization == "fp8":
        return Fp8Scheme("dynamic", "channel", "token")
    return None


def _checkpoint_scheme(q: dict[str, Any]) -> Fp8Scheme:
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        if q.get("weight_block_size"):
            raise QuantizationError(
                f"this checkpoint's fp8 is block-wise (weight_block_size "
                f"{q['weight_block_size']}): only per-tensor and per-channel fp8 checkpoints "
                f"are supported")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise QuantizationError(f"fp8 checkpoint: activation_scheme {scheme!r} (supported: "
                                    "dynamic, static)")
        return Fp8Scheme("fp8", "tensor", "static" if scheme == "static" else "token",
                         tuple(q.get("ignored_layers") or ()))
    raise QuantizationError(f"this checkpoint is quantized with {method!r}: Tandem serves "
                            "fp8 checkpoints only (compressed-tensors float-quantized, or fp8)")


def _compressed_tensors(q: dict[str, Any]) -> Fp8Scheme:
    if q.get("kv_cache_scheme"):
        raise QuantizationError("compressed-tensors: a kv_cache_scheme (KV-cache scales in the "
                                "checkpoint) is not supported")
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise QuantizationError("compressed-tensors: no config_groups")
    schemes = {_group_scheme(g, q.get("format")) for g in groups}
    if len(schemes) > 1:
        raise QuantizationError(f"compressed-tensors: config_groups with different schemes "
                                f"{sorted(schemes)}: one scheme for every layer is supported")
    weights, activations = schemes.pop()
    return Fp8Scheme("compressed-tensors", weights, activations,
                     tuple(q.get("ignore") or ()))


def _group_scheme(group: dict[str, Any], top_format: str | None) -> tuple[Any, Activations]:
    fmt = group.get("format") or top_format
    if fmt != "float-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r}: only float-quantized "
                                "(fp8) is supported")
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type")) != (8, "float"):
        raise QuantizationError(f"compressed-tensors weights of {w.get('num_bits')} bits, type "
                                f"{w.get('type')!r}: only 8-bit float (fp8) is supported")
    if w.get("strategy") not in ("tensor", "channel") or w.get("dynamic"):
        raise QuantizationError(f"compressed-tensors weights with strategy "
                                f"{w.get('strategy')!r}{' (dynamic)' if w.get('dynamic') else ''}"
                                f": only static per-tensor or per-channel scales are supported")
    a = group.get("input_activations")
    if not a:
        raise QuantizationError("compressed-tensors: fp8 weights without input_activations "
                                "(weight-only fp8) are not supported")
    if (a.get("num_bits"), a.get("type")) != (8, "float"):
        raise QuantizationError(f"compressed-tensors activations of {a.get('num_bits')} bits, "
                                f"type {a.get('type')!r}: only fp8 is supported")
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if strategy == "token" and dynamic:
        return w["strategy"], "token"
    if strategy == "tensor":
        return w["strategy"], "tensor" if dynamic else "static"
    raise QuantizationError(f"compressed-tensors activations with strategy {strategy!r}"
                            f"{' (dynamic)' if dynamic else ' (static)'}: supported are per "
                            "token (dynamic) and per tensor (dynamic or static)")


def fp8_linears(model: nn.Module, scheme: Fp8Scheme, scaled_mm: bool,
                parts: dict[str, list[str]]) -> int:
    """Replace the decoder's linear layers under `model` (built on the meta device, before
    its weights load) by Fp8Linears, except those the checkpoint keeps unquantized; return
    how many. `parts`: a merged product's name -> the checkpoint's projections it holds (all
    of them ignored, or none)."""
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name not in DECODER_LINEARS or type(child) is not nn.Linear:
                continue
            sources = [f"{name}.{p}" for p in parts.get(child_name, [child_name])]
            ignored = [scheme.ignores(s) for s in sources]
            if all(ignored):
                continue
            if any(ignored):
                raise QuantizationError(f"{', '.join(sources)}: some ignored and some "
                                        "quantized; they run as one product here")
            setattr(module, child_name, Fp8Linear(child.in_features, child.out_features,
                                                  child.bias is not None, scheme.activations,
                                                  scaled_mm))
            swapped += 1
    return swapped
