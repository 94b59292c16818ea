"""Copies between the host and the engine's device that never stall the host on the device.

On CUDA a copy to the host, or a blocking copy to the device, waits for every kernel queued
before it: each one is a host sync, and a step that makes several loses the overlap of Python
work with the GPU's. `HostLink` uploads step inputs from pinned memory without blocking and
brings a step's results back together, into pinned memory, with one wait for the lot. On the
CPU the same calls are plain copies. The platform says which (engine_core/worker/platform.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

ALIGN = 16  # bytes: where each array of `upload_many` starts

class HostLink:
    def __init__(self, device: torch.device, pinned: bool, synchronize: Callable[[], None],
                 align: bool = False) -> None:
        """`pinned`: host buffers in page-locked memory, so copies run asynchronously;
        `synchronize` waits for the device's queued work (a no-op on the CPU); `align`: each
        array of `upload_many` starts 16-byte aligned (for the Triton kernels)."""
        self.device = device
        self.pinned = pinned
        self.align = align
        self._synchronize = synchronize

    def upload(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """`array` on the device, its copy queued behind the work already there."""
        host = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) \
            else array
        if self.pinned:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=self.pinned)

    def upload_many(self, arrays: Sequence[np.ndarray], dtype: type[np.generic]
                    ) -> list[torch.Tensor]:
        """Several arrays on the device in one copy (as `dtype`), each a view of it; with
        `align`, each starts 16-byte aligned (Triton specializes kernels on their pointers'
        alignment: a view at an odd offset would compile another variant)."""
        if not self.align:
            packed = np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])
            flat = self.upload(packed)
            return [part.view(np.shape(a)) for part, a in
                    zip(flat.split([int(np.size(a)) for a in arrays]), arrays, strict=True)]
        step = max(1, ALIGN // np.dtype(dtype).itemsize)
        sizes = [int(np.size(a)) for a in arrays]
        starts = np.cumsum([0] + [-(-n // step) * step for n in sizes])
        packed = np.zeros(int(starts[-1]), dtype=dtype)
        for a, at, n in zip(arrays, starts, sizes, strict=False):
            packed[at:at + n] = np.asarray(a).reshape(-1)
        flat = self.upload(packed)
        return [flat[at:at + n].view(np.shape(a))
                for a, at, n in zip(arrays, starts, sizes, strict=False)]

    def download(self, tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
        """Every tensor on the host, copied back together: one wait for the device, after the
        last copy is queued."""
        return self.download_later(tensors).wait()

    def download_later(self, tensors: Sequence[torch.Tensor]) -> Download:
        """The copies to the host queued now, behind the work that computes them; `wait()`
        waits for them alone (an overlapped step queues the next step's work first)."""
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned) for t in tensors]
        for host, t in zip(out, tensors, strict=True):
            host.copy_(t, non_blocking=self.pinned)
        done = None
        if self.pinned:
            done = torch.cuda.Event()
            done.record()
        return Download(out, done)


class Download:
    """Copies to the host queued on the device; `wait()` returns them as arrays."""

    def __init__(self, host: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._host = host
        self._done = done

    def wait(self) -> list[np.ndarray]:
        if self._done is not None:
            self._done.synchronize()
        return [host.numpy() for host in self._host]
