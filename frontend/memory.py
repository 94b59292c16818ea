"""A serving frontend's memory: the garbage collector settled once it has started, and the
heap trimmed once its tokenizer is loaded (`shared.memory.MemoryTrimmer`, glibc's malloc_trim:
loading a tokenizer.json whose merges are stored as pairs, as transformers 5 saves them, peaks
~100 MB above what the tokenizer keeps, and glibc would keep that high-water mark;
docs/benchmarks.md, "Frontend memory").

A frontend trims once, when its tokenizer is loaded. (Trimming again when a burst of requests
is over gave back ~3 MB in the benchmarks: what a burst leaves is mostly the token caches that
grew during it, in pymalloc's arenas, which malloc_trim cannot reach.)
"""

from __future__ import annotations

import gc

# Young collections every this many container allocations (CPython's default: 700).
YOUNG_GC_THRESHOLD = 10_000


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
