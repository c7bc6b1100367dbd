"""Functions of the C library this process runs with (glibc on Linux), looked up once."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def function(name: str):
    """The C library's ``name`` (errno kept for ``ctypes.get_errno``), or None where it has none."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None


def release_host_memory() -> None:
    """Give freed heap memory back to the system: glibc keeps freed blocks below its dynamic mmap
    threshold (up to 32 MiB) in the heap, so arrays of that size stay in the process's memory
    after they are freed. Nothing where the C library has no ``malloc_trim``."""
    trim = function("malloc_trim")
    if trim is not None:
        trim(0)
