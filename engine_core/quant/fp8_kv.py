"""The fp8 KV cache (`--kv-cache-dtype fp8`): K and V stored as float8_e4m3fn, one scale per
layer for K and one for V.

A value x is stored as q = saturate(x / scale) in e4m3 (saturate: clamped to ±448, e4m3's
largest finite value, so an outlier is stored as the largest value, never as NaN) and read
back as q * scale. The scales come, in this order of precedence, from the checkpoint
(`k_scale` / `v_scale` tensors of each attention layer, as vLLM reads them; a per-head scale is
folded into its layer's largest), from the first real batch's K and V with
`--calculate-kv-scales` (vLLM's rule: |K|max / 200, |V|max / 100, leaving headroom for later
tokens), or are 1.0.

The scales live in one device tensor [layers, SCALE_WIDTH] float32 (`KVScales.values`) that
every write and read takes a row of: a captured CUDA graph reads them from there at replay,
so scales calculated after the capture are the ones it uses. A row is 16 bytes, so each
layer's row is as aligned as the tensor (Triton specializes pointers on 16-byte alignment).

Which caches are fp8 is a fact of the cache tensor itself (`is_fp8`): a draft model's cache
stays in the model's dtype and goes through the same code unquantized.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
SCALE_WIDTH = 4  # floats per layer's row of scales: K's, V's, two unused (16-byte rows)
K_RANGE, V_RANGE = 200.0, 100.0  # --calculate-kv-scales: scale = |x|max / range (vLLM's)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The paged cache's element type for --kv-cache-dtype."""
    return model_dtype if kv_cache_dtype == "auto" else FP8


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated at ±448, as e4m3 (float32 arithmetic; `scale` a one-element
    tensor or a scalar tensor)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in `dtype`: what the cache's e4m3 entries stand for."""
    return (q.float() * scale).to(dtype)


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, scales: torch.Tensor | None) -> None:
    """k and v [T, Hkv, D] into their caches at `slots` [T], quantized with the layer's row of
    scales (K's at 0, V's at 1) where the caches are fp8."""
    index = slots.long()
    if is_fp8(k_cache):
        assert scales is not None, "an fp8 KV cache needs its layer's scales"
        # as bytes: the CPU's index_copy_ has no float8 kernel
        k_cache.view(torch.uint8).index_copy_(0, index, quantize(k, scales[0]).view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(0, index, quantize(v, scales[1]).view(torch.uint8))
        return
    k_cache.index_copy_(0, index, k)
    v_cache.index_copy_(0, index, v)


def read(cache_rows: torch.Tensor, scales: torch.Tensor | None, which: int,
         dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, in `dtype`: dequantized with scale `which` (0: K, 1: V) where
    they are fp8, as they are otherwise."""
    if not is_fp8(cache_rows):
        return cache_rows
    assert scales is not None, "an fp8 KV cache needs its layer's scales"
    return dequantize(cache_rows, scales[which], dtype)


def as_stored(x: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None,
              which: int) -> torch.Tensor:
    """x as `cache` holds it: rounded through e4m3 with scale `which` (0: K, 1: V) where the
    cache is fp8, x itself otherwise. A prefill chunk that attends to the step's own K/V
    (rather than gathering them from the cache) attends to these, so every query sees its
    keys and values as the cache stores them, whatever else the step holds."""
    if not is_fp8(cache):
        return x
    assert scales is not None, "an fp8 KV cache needs its layer's scales"
    return dequantize(quantize(x, scales[which]), scales[which], x.dtype)


class KVScales:
    """Each layer's K and V scales on the device, and the one calculation of them from the first
    real batch (`--calculate-kv-scales`): `arm` before that batch's forward, `disarm` after;
    between them each layer's `calibrate` sets its row from the batch's K and V before they are
    written. Under tensor parallelism the ranks agree on the largest |K| and |V| (one MAX
    all-reduce per layer, that one step), so every rank stores with the same scales."""

    def __init__(self, values: torch.Tensor, calculate: bool = False,
                 group: Any = None, distributed: bool = False) -> None:
        self.values = values  # [layers, SCALE_WIDTH] float32
        self.pending = calculate
        self.calibrating = False
        self.group, self.distributed = group, distributed

    @classmethod
    def build(cls, layers: int, device: torch.device, given: torch.Tensor | None = None,
              calculate: bool = False, group: Any = None, distributed: bool = False
              ) -> KVScales:
        """Scales of `layers` layers: `given` [layers, 2] (the checkpoint's) or 1.0."""
        values = torch.ones(layers, SCALE_WIDTH, dtype=torch.float32)
        if given is not None:
            values[:, :2] = given
        return cls(values.to(device), calculate and given is None, group, distributed)

    def row(self, layer: int) -> torch.Tensor:
        return self.values[layer]

    def arm(self) -> bool:
        """Start the calculation, if it is still to be done; whether it started."""
        if not self.pending:
            return False
        self.pending, self.calibrating = False, True
        return True

    def disarm(self) -> None:
        self.calibrating = False

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """While armed: layer `layer`'s scales from this batch's k and v (no host sync)."""
        if not self.calibrating:
            return
        amax = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(amax, dist.ReduceOp.MAX, group=self.group)
        ranges = torch.tensor([K_RANGE, V_RANGE], device=amax.device)
        self.values[layer, :2] = amax.clamp_min(1e-6) / ranges


# -- scales in the checkpoint -------------------------------------------------------------------
SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:attn\.)?(?:(k|v)_scale|(k|v)_proj\."
                        r"output_scale)$")


def checkpoint_scales(folder: str, hf_config: Any, layers: int) -> torch.Tensor | None:
    """[layers, 2] K and V scales from the checkpoint's safetensors (`...layers.N.self_attn.
    k_scale` / `v_scale`, or `k_proj.output_scale` / `v_proj.output_scale` as compressed-
    tensors writes them), or None where it has none. A compressed-tensors `kv_cache_scheme` in
    config.json must describe 8-bit floats; a per-head scale counts as its layer's largest."""
    scheme = (getattr(hf_config, "quantization_config", None) or {})
    scheme = scheme.get("kv_cache_scheme") if isinstance(scheme, dict) else None
    if scheme is not None and (scheme.get("num_bits") != 8 or scheme.get("type") != "float"):
        raise ValueError(f"the checkpoint's kv_cache_scheme {scheme} is not 8-bit float: "
                         "--kv-cache-dtype fp8 stores e4m3")
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    found: dict[tuple[int, int], float] = {}
    for path in files:
        found.update(_scales_in(path))
    if not found:
        if scheme is not None:
            log.warning("the checkpoint's kv_cache_scheme has no k_scale/v_scale tensors: "
                        "scales of 1.0")
        return None
    missing = [(i, "kv"[w]) for i in range(layers) for w in (0, 1) if (i, w) not in found]
    if missing:
        raise ValueError(f"the checkpoint has KV scales for some layers but not for {missing}")
    return torch.tensor([[found[i, 0], found[i, 1]] for i in range(layers)])


def _scales_in(path: Path) -> dict[tuple[int, int], float]:
    from safetensors import safe_open

    found = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            match = SCALE_NAME.search(name)
            if match is not None:
                which = 0 if (match.group(2) or match.group(3)) == "k" else 1
                found[int(match.group(1)), which] = float(f.get_tensor(name).float().max())
    return found
