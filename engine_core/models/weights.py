"""A model file's weights, straight from the checkpoint's safetensors files onto the device.

The model is built on the meta device (no memory, no random init), given empty storage of the
serving dtype on the device, then each tensor of the checkpoint is copied into its place: a
projection that the model merges (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`: the
class's `packed()`) into its rows of the merged weight. Under tensor parallelism each rank
reads only its slice of each tensor (the class's `tp_slice`), through safetensors'
`get_slice`. Every place must be filled once and every tensor must have a place (a tied LM
head's copy and transformers' rotary buffers excepted): a checkpoint that does not fit the
class is an error that names the tensor.

With fp8 (models/quantization.py) the decoder's linears are `Fp8Linear`s: an fp8 checkpoint's
weights and scales are copied as they are stored (a per-tensor scale into every row of its
part, so q, k and v with their own scales make one per-channel vector of the merged product;
static input scales of the parts merged by their max), and a full-precision checkpoint's are
quantized tensor by tensor as they are read (`quantize_rows`), so the whole model is never in
memory in both forms. A row-parallel rank quantizes whole rows before it keeps its columns,
so every rank holds the weights one device would.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine_core.models.parts import ModelKit, Part, Slice
from engine_core.models.quantization import Fp8Scheme, fp8_linears
from engine_core.quant.fp8 import FP8, quantize_rows

SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # computed, in old checkpoints
SCALES = (".weight_scale", ".input_scale")


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (by its index when sharded); none: []."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = json.loads(index.read_text())["weight_map"].values()
        return sorted({folder / name for name in shards})
    return sorted(folder.glob("*.safetensors"))


def local_folder(model: str) -> Path | None:
    """The folder of `model` (a folder, or a hub id: its snapshot's config and safetensors
    files, from the local cache or the hub as huggingface_hub is set up); None if the hub
    cannot give it."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # no network, no such repository: the caller falls back
        return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(cls: Any, config: Any, kit: ModelKit, files: list[Path], dtype: torch.dtype,
               device: torch.device, positions: int, fp8: Fp8Scheme | None = None,
               scaled_mm: bool = False) -> Any:
    """`cls(config, kit)` with its weights from `files`, in `dtype` on `device`, ready for
    `positions` positions; with `fp8`, its decoder's linears in fp8 (on the fp8 GEMM where
    `scaled_mm`)."""
    with torch.device("meta"), _default_dtype(dtype):
        model = cls(config, kit)
        if fp8 is not None:
            merged: dict[str, list[str]] = {}
            for source, part in model.packed().items():
                merged.setdefault(part.target, []).append(source)
            fp8_linears(model, fp8, scaled_mm, merged)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    load_weights(model, files, device)
    model.model.prepare(positions)
    return model


def load_weights(model: nn.Module, files: list[Path], device: torch.device) -> None:
    params = dict(model.named_parameters())
    packed: dict[str, Part] = model.packed()  # type: ignore[operator]
    filled: set[tuple[str, int]] = set()
    # safetensors' own device names: "cpu", "cuda:N"
    where = str(device) if device.type == "cpu" or device.index is not None else \
        f"{device.type}:{torch.cuda.current_device()}"
    with torch.no_grad():
        for scale_name, param in params.items():
            if scale_name.endswith(".input_scale"):  # the parts' static scales merge by max
                param.zero_()
        for file in files:
            with safe_open(str(file), framework="pt", device=where) as f:
                for key in f.keys():
                    name, part = _place(key, packed)
                    if name is None or (key == "lm_head.weight" and name not in params):
                        continue  # transformers' buffers; a tied head's copy
                    if name not in params:
                        raise ValueError(f"{file.name}: {key} has no place in "
                                         f"{type(model).__name__}")
                    shard = -1 if part is None else part.shard
                    if name.endswith(SCALES):
                        _load_scale(model, params, name, part, f.get_tensor(key), key)
                        filled.add((name, shard))
                        continue
                    target: torch.Tensor = params[name]
                    if part is not None:
                        target = target.narrow(0, *part.rows)
                    cut = model.tp_slice(name, part)  # type: ignore[operator]
                    if target.dtype == FP8 and f.get_slice(key).get_dtype() != "F8_E4M3":
                        scale_name = name[:-len("weight")] + "weight_scale"
                        scale = params[scale_name]
                        _quantize_into(target, scale if part is None
                                       else scale.narrow(0, *part.rows), f, key, cut)
                        filled |= {(name, shard), (scale_name, shard)}
                        continue
                    if cut is None:
                        tensor = f.get_tensor(key)
                    else:
                        target = _zeroed_head(target, cut)
                        tensor = _read_slice(f, key, cut)
                    if target.shape != tensor.shape:
                        raise ValueError(f"{file.name}: {key} is {tuple(tensor.shape)}, its "
                                         f"place {name} {tuple(target.shape)}")
                    if tensor.dtype == FP8 and target.dtype != FP8:
                        raise ValueError(f"{file.name}: {key} is stored in fp8, but its place "
                                         f"{name} is not quantized here (only the decoder's "
                                         f"linear layers are)")
                    target.copy_(tensor)
                    filled.add((name, shard))
    expected = {(name, i) for name, count in _places(params, packed)
                for i in (range(count) if count else [-1])}
    missing = sorted({name for name, _ in expected - filled})
    if missing:
        raise ValueError(f"the checkpoint has no weights for {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def _place(key: str, packed: dict[str, Part]) -> tuple[str | None, Part | None]:
    """Where checkpoint tensor `key` goes: (parameter name, its part of a merged one)."""
    if key.endswith(SKIPPED_SUFFIXES):
        return None, None
    names = key.split(".")
    for i, name in enumerate(names):
        part = packed.get(name)
        if part is not None:
            return ".".join(names[:i] + [part.target] + names[i + 1:]), part
    return key, None


def _places(params: dict[str, nn.Parameter], packed: dict[str, Part]
            ) -> Iterator[tuple[str, int]]:
    """Each parameter with the number of parts it loads from (0: one whole tensor)."""
    merged = {part.target: len(part.sizes) for part in packed.values()}
    for name in params:
        parts = [merged[n] for n in name.split(".") if n in merged]
        yield name, parts[0] if parts else 0


def _zeroed_head(target: torch.Tensor, cut: Slice) -> torch.Tensor:
    """The part of `target` a rank's slice fills; the rest (a last rank's rows past the
    vocabulary, a bias off rank 0) zeros."""
    if cut.size < target.shape[cut.dim]:
        target.zero_()
    return target.narrow(cut.dim, 0, cut.size)


def _read_slice(f: Any, key: str, cut: Slice) -> torch.Tensor:
    """Only `cut` of checkpoint tensor `key`, read from the file as such."""
    whole = f.get_slice(key)
    span = slice(cut.start, cut.start + cut.size)
    return whole[span] if cut.dim == 0 else whole[:, span]


def _quantize_into(target: torch.Tensor, scale: torch.Tensor, f: Any, key: str,
                   cut: Slice | None) -> None:
    """Full-precision checkpoint tensor `key`, this rank's part of it, quantized per row into
    `target` (e4m3) and `scale`: whole rows first, then a row-parallel rank's columns."""
    q, scales = quantize_rows(f.get_tensor(key) if cut is None or cut.dim == 1
                              else _read_slice(f, key, cut))
    if cut is not None and cut.dim == 1:
        q = q.narrow(1, cut.start, cut.size)
    if target.shape != q.shape:
        raise ValueError(f"{key} is {tuple(q.shape)} here, its place {tuple(target.shape)}")
    target.copy_(q)
    scale.copy_(scales)


def _load_scale(model: Any, params: dict[str, nn.Parameter], name: str, part: Part | None,
                tensor: torch.Tensor, key: str) -> None:
    """A checkpoint's `weight_scale` (one per tensor, or one per output channel) into its rows
    of the layer's per-channel scales, this rank's rows where the layer's outputs are split;
    an `input_scale` into the layer's, the largest of a merged product's parts'."""
    target: torch.Tensor = params[name]
    values = tensor.float().reshape(-1)
    if name.endswith(".input_scale"):
        if values.numel() != 1:
            raise ValueError(f"{key} has {values.numel()} values: static input scales are "
                             "supported per tensor only")
        target.copy_(torch.maximum(target, values[0]))
        return
    if part is not None:
        target = target.narrow(0, *part.rows)
    cut = model.tp_slice(name[:-len("_scale")], part)
    if values.numel() > 1 and cut is not None and cut.dim == 0:  # column-parallel channels
        values = values[cut.start:cut.start + cut.size]
    if values.numel() not in (1, target.numel()):
        raise ValueError(f"{key} has {values.numel()} values for {target.numel()} channels")
    target.copy_(values.expand(target.shape) if values.numel() == 1 else values)
