"""Memory probes for the benchmarks: process RSS on CPU, device bytes in use on GPU.

``settle()`` reads the memory at rest (after garbage collection, with freed heap handed back to the
system, so that freed buffers do not count); ``MemorySampler`` records the peak while a block runs,
from a thread sampling every millisecond (JAX's copies and NumPy's release the GIL). During the
block, RSS also counts blocks that glibc keeps in its heap after a free (it raises its ``mmap``
threshold as large blocks are freed, up to 32 MiB): the peak is an upper bound on live memory.
Fixing that threshold low would make RSS exact but slowed every copy here several times.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Self

import jax
import psutil

from tenplex_jax._src.libc import release_host_memory


def metric() -> str:
    """What ``current()`` measures on this backend."""
    return "device_bytes_in_use" if jax.default_backend() == "gpu" else "process_rss"


def current() -> int:
    if metric() == "device_bytes_in_use":
        return sum((d.memory_stats() or {}).get("bytes_in_use", 0) for d in jax.local_devices())
    return psutil.Process().memory_info().rss


def settle() -> int:
    """The memory at rest: collect garbage, return freed heap to the system, then read it."""
    gc.collect()
    release_host_memory()  # else freed heap stays in RSS
    return current()


class MemorySampler:
    """``with MemorySampler() as s: ...`` → ``s.peak``: the largest reading while the block ran."""

    def __init__(self, interval: float = 1e-3):
        self.interval = interval
        self.metric = metric()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current())
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self.peak = current()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current())
