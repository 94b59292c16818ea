"""`MemoryTrimmer`: freed heap pages go back to the OS (glibc), or nothing happens (elsewhere)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from shared.memory import MemoryTrimmer


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_trim_gives_back_what_was_freed() -> None:
    trimmer = MemoryTrimmer()
    if not trimmer.available:
        pytest.skip("no malloc_trim in this C library")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 KiB blocks: below glibc's mmap threshold, so they live in the heap and stay there
    blocks = [libc.malloc(64 << 10) for _ in range(1600)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:  # the last one pins the heap's top: only a trim reaches the rest
        libc.free(b)
    kept = rss_mb()
    trimmer.trim()
    assert kept - rss_mb() > 50, "the freed 100 MB stayed resident"
    libc.free(blocks[-1])
