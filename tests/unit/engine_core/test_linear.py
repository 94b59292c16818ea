"""The decoder's linear layers stored transposed: same products, every nn.Linear swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_core.config import EngineConfig
from engine_core.linear import TransposedLinear, transpose_linears, transposed_is_faster
from engine_core.platform import Platform


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
