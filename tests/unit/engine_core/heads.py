"""The LM-head kernels as the engine gets them on this machine, for tests that build heads."""

from __future__ import annotations

import functools

import pytest

from engine_core.config import EngineConfig
from engine_core.layers.native import Kernels
from engine_core.worker.platform import Platform


@functools.cache
def engine_kernels() -> Kernels | None:
    """The compiled kernels the platform loads here (None without a compiler, or with
    TANDEM_NATIVE=0): a head built with them runs the engine's own backend."""
    return Platform.detect(EngineConfig(model="unused", device="cpu")).head_kernels


def kernels_or_skip() -> Kernels:
    """engine_kernels(), or the calling test skipped where they do not build."""
    kernels = engine_kernels()
    if kernels is None:
        pytest.skip("no compiled CPU kernels here (no C compiler, or TANDEM_NATIVE=0)")
    return kernels
