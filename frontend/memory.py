"""Giving freed memory back to the OS, so that a frontend's resident size is what it holds.

CPython frees through the C allocator, and glibc's malloc keeps what was freed for reuse rather
than returning it: after a peak (loading a tokenizer.json whose merges are stored as pairs, as
transformers 5 saves them, peaks ~100 MB above what the tokenizer keeps; a burst of echoed
prompts with logprobs) the process stays at its high-water mark. `malloc_trim(0)` returns the
free pages (docs/benchmarks.md, "Frontend memory"). Where the C library has no such call
(musl, macOS), `MemoryTrimmer` does nothing.

`settle_gc` sets the cyclic garbage collector for a serving frontend, once it has started.

A frontend trims once, when its tokenizer is loaded. (Trimming again when a burst of requests
is over gave back ~3 MB in the benchmarks: what a burst leaves is mostly the token caches that
grew during it, in pymalloc's arenas, which malloc_trim cannot reach.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

# Young collections every this many container allocations (CPython's default: 700).
YOUNG_GC_THRESHOLD = 10_000


class MemoryTrimmer:
    """glibc's malloc_trim where the C library has it (found once, at start-up)."""

    def __init__(self) -> None:
        self._trim = None
        name = ctypes.util.find_library("c")
        try:
            self._trim = ctypes.CDLL(name).malloc_trim if name else None
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
            self._trim = None
        if self._trim is not None:
            self._trim.argtypes = [ctypes.c_size_t]
            self._trim.restype = ctypes.c_int

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim(self) -> None:
        """Return the allocator's free memory to the OS (if it can)."""
        if self._trim is not None:
            self._trim(0)



def settle_gc() -> None:
    """Freeze what start-up built (modules, tokenizer, templates: never garbage) out of the
    collector's way, and collect the young generation every YOUNG_GC_THRESHOLD allocations.

    Streaming allocates a few containers per token (rows, logprobs, entries); at CPython's 700
    the young generation was collected ~500 times a second at 50k tokens/s, each time
    promoting the objects of requests still in flight, so the old generations grew and their
    collections scanned every live request: 0.16 s of the frontend's CPU in the echo + logprobs
    benchmark's timed round (~12%), 0.05 s frozen with 10,000 (docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)
