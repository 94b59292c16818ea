"""The decoder's linear layers stored transposed or packed in panels: same products, every
nn.Linear swapped."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from engine_core.config import EngineConfig
from engine_core.layers import native
from engine_core.layers.chunk_pool import ChunkPool
from engine_core.layers.linear import (
    PANEL_ROWS,
    DecoderLinear,
    TransposedLinear,
    prepare_linears,
    transpose_linears,
    transposed_is_faster,
)
from engine_core.worker.platform import Platform
from tests.unit.engine_core.heads import kernels_or_skip


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5)])
def test_transposed_linear_computes_what_the_linear_did(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(5, 7, bias=bias)
    x = torch.randn(*shape)
    expected = linear(x)
    got = TransposedLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_every_linear_is_swapped_and_nothing_else() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4),
                          nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))
    assert transpose_linears(model) == 3
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("TransposedLinear") == 3 and "Linear" not in kinds
    assert kinds.count("Embedding") == 1
    assert model(torch.tensor([1, 2])).shape == (2, 4)


def test_the_measurement_answers_and_the_environment_overrides_it() -> None:
    assert isinstance(transposed_is_faster(repeats=2), bool)
    config = EngineConfig(model="unused", device="cpu")
    assert Platform.detect(config, {"TANDEM_LINEAR": "transposed"}).transposed_linears
    assert not Platform.detect(config, {"TANDEM_LINEAR": "torch"}).transposed_linears


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 15, 16, 21, PANEL_ROWS, PANEL_ROWS + 1, 100, 130])
@pytest.mark.parametrize("threads", [1, 2])
def test_decoder_linear_computes_what_the_linear_did(transposed: bool, bias: bool, rows: int,
                                                     threads: int) -> None:
    """At most PANEL_ROWS rows through the compiled kernel, more through the layer itself,
    shared over the pool when the step has threads (by columns below COLUMNS_BELOW rows, by
    rows from there); an output width that is not a whole number of panels (37) is cut back
    to size."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 37, bias=bias)
    x = torch.randn(rows, 48)
    expected = linear(x)
    wide = TransposedLinear(linear) if transposed else linear
    pool = ChunkPool(2)
    pool.use(threads)
    got = DecoderLinear(wide, kernels_or_skip(), pool)(x.view(1, rows, 48))
    assert got.shape == (1, rows, 37) and got.is_contiguous()
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-5)


def test_both_register_tiles_give_the_same_bits(tmp_path: Path) -> None:
    """The AVX-512 build (16-row tiles) and the AVX2 one (6-row tiles) sum in the same order:
    every row count up to two tiles and a tail gives identical products."""
    compiler = native.find_compiler()
    if compiler is None or b"avx512f" not in native._cpu_flags():
        pytest.skip("needs a C compiler and an AVX-512 CPU to run both builds")
    obj, lib = tmp_path / "k.o", tmp_path / "k.so"
    subprocess.run([compiler, *native.FLAGS, "-mno-avx512f", "-c", str(native.SOURCE),
                    "-o", str(obj)], check=True, timeout=120)
    subprocess.run([compiler, "-shared", str(obj), "-o", str(lib), "-lm"], check=True,
                   timeout=120)
    avx2, avx512 = native.Kernels(ctypes.CDLL(str(lib))), kernels_or_skip()
    torch.manual_seed(0)
    panels = native.pack_panels(torch.randn(96, 48))
    for rows in range(1, 40):
        x = torch.randn(rows, 96)
        outs = []
        for k in (avx2, avx512):
            out = torch.empty(rows, 48)
            k.panel_matmul(x.data_ptr(), 96, rows, 96, panels.data_ptr(), 0, 3,
                           out.data_ptr(), 48)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), rows


@pytest.mark.parametrize(("rows", "parts"), [(16, 3), (64, 2), (200, 2), (1100, 4)])
def test_a_step_with_threads_shares_the_products_out(rows: int, parts: int) -> None:
    """16 rows: the kernel's 63 panels in parts of at least 16; 64 rows: by columns, a part a
    thread; 200: by rows, a part a thread; 1100: by rows, more parts of at least 256 rows;
    one thread: no sharing at all."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 1000)
    x = torch.randn(rows, 64)
    calls: list[int] = []
    pool = ChunkPool(2)
    real_map = pool.map
    pool.map = lambda fn, n: calls.append(n) or real_map(fn, n)  # type: ignore[method-assign]
    layer = DecoderLinear(linear, kernels_or_skip(), pool)
    pool.use(2)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    pool.use(1)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == [parts]


def test_prepare_wraps_every_float32_linear_and_drops_panels_when_told() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 64), nn.Sequential(nn.Linear(64, 32), nn.ReLU()))

    def layers(m: nn.Module) -> list[DecoderLinear]:
        return [x for x in m.modules() if isinstance(x, DecoderLinear)]

    forced = model()
    said = prepare_linears(forced, True, kernels_or_skip(), True, ChunkPool(2))
    kinds = [type(m).__name__ for m in forced.modules()]
    assert kinds.count("DecoderLinear") == 2 and kinds.count("TransposedLinear") == 2
    assert "packed panels" in said and "2 threads" in said
    assert all(x.panels is not None for x in layers(forced))
    off = model()
    assert "panels" not in prepare_linears(off, False, kernels_or_skip(), False, ChunkPool(1))
    assert len(layers(off)) == 2 and all(x.panels is None for x in layers(off))
    measured = model()
    said = prepare_linears(measured, False, kernels_or_skip(), None, ChunkPool(1))
    assert all((x.panels is not None) == ("panels" in said) for x in layers(measured))
    gpu = model()
    assert prepare_linears(gpu, False, None, False, None) == "torch's [out, in]"
    assert not layers(gpu)


def test_panels_are_off_without_kernels_or_float32_and_follow_the_environment() -> None:
    config = EngineConfig(model="unused", device="cpu")
    assert Platform.detect(config, {"TANDEM_NATIVE": "0"}).decoder_panels is False
    bf16 = EngineConfig(model="unused", device="cpu", dtype="bfloat16")
    assert Platform.detect(bf16, {}).decoder_panels is False
    kernels_or_skip()  # skips without a compiler
    assert Platform.detect(config, {}).decoder_panels is None  # measured on the model
    assert Platform.detect(config, {"TANDEM_PANELS": "1"}).decoder_panels is True
    assert Platform.detect(config, {"TANDEM_PANELS": "0"}).decoder_panels is False
