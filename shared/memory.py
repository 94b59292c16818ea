"""Giving freed memory back to the OS, so that a process's resident size is what it holds.

CPython and torch's CPU tensors free through the C allocator, and glibc's malloc keeps what was
freed for reuse rather than returning it: its heap stays at its high-water mark, and that mark
moves with the largest step or burst seen (docs/reliability.md, the engine's RSS in the soak).
`malloc_trim(0)` returns every free page. Where the C library has no such call (musl, macOS),
`MemoryTrimmer` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


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
