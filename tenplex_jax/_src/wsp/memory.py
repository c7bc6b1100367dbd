"""A virtual worker's memory: what its compiled program needs per device, its devices' limit, and a
monitor of its peak while it trains (Hydrozoa's planner watches each worker's memory).

XLA's own numbers come first: ``compiled.memory_analysis()`` is the buffer assignment of the
program for one device (its arguments, outputs and temporaries; the CPU backend reports them on
jax 0.10.2 and 0.12). A device's limit is ``memory_stats()["bytes_limit"]`` where the backend keeps
statistics (GPU, TPU) or what the user gives (``WorkerOptions(memory_limit=...)``); the CPU
backend keeps none (``memory_stats()`` is None). While the VW trains, :class:`MemoryMonitor` reads
each device's ``peak_bytes_in_use`` where the backend has it, else the live arrays' bytes on the
device plus the program's temporaries, and keeps the largest: the VW's peak.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import jax

from tenplex_jax._src.errors import WSPError

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryUse:
    """A compiled program's bytes on one device, as XLA's buffer assignment has them.

    Attributes:
      arguments: the inputs' bytes.
      outputs: the outputs' bytes.
      temporaries: what the program allocates while it runs.
      aliased: outputs written in place of a donated input (counted once).
      code: the generated code's bytes.
      peak: XLA's peak (``peak_memory_in_bytes`` where jaxlib reports it, else the sum).
    """

    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    code: int
    peak: int

    @classmethod
    def of(cls, compiled) -> MemoryUse | None:
        """``compiled.memory_analysis()``'s numbers, or None where the executable has none."""
        try:
            stats = compiled.memory_analysis()
        except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
            return None
        if stats is None:
            return None
        sizes = {
            "arguments": stats.argument_size_in_bytes,
            "outputs": stats.output_size_in_bytes,
            "temporaries": stats.temp_size_in_bytes,
            "aliased": stats.alias_size_in_bytes,
            "code": stats.generated_code_size_in_bytes,
        }
        total = sum(sizes.values()) - 2 * sizes["aliased"]  # an alias is in args and outputs
        peak = getattr(stats, "peak_memory_in_bytes", None) or total
        return cls(**{k: int(v) for k, v in sizes.items()}, peak=int(peak))


def _local(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Those of ``devices`` this process addresses (a VW over several processes: each process
    watches its own; the backend keeps no statistics of another process's devices)."""
    return [d for d in devices if d.process_index == jax.process_index()]


def device_limit(devices: Sequence[jax.Device]) -> int | None:
    """The smallest ``bytes_limit`` of the memory statistics of those of ``devices`` this
    process addresses; None when the backend keeps none (the CPU backend)."""
    limits = []
    for device in _local(devices):
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


def refuse(vw: str, stages: int, batch: int, needed: int, limit: int, what: str) -> WSPError:
    """The error of a VW that would exceed its devices' memory: VW, stage, batch, bytes, limit."""
    return WSPError(
        f"a virtual worker's peak memory must fit its devices' memory: VW {vw!r} (stages "
        f"0..{stages - 1}, one program on every device) at minibatch {batch} needs {needed:,} "
        f"bytes ({needed / MIB:.1f} MiB) per device {what}, over the limit of {limit:,} bytes "
        f"({limit / MIB:.1f} MiB)",
        "memory",
    )


class MemoryMonitor:
    """A VW's memory on its devices: checked against the limit when it is built, observed as it
    trains (:meth:`observe`, as each wave reads its first minibatch), its :attr:`peak` reported.

    Args:
      vw: the VW's name.
      devices: its devices (those of other processes are left to them).
      program: its compiled program's :class:`MemoryUse` (None: unknown).
      limit: bytes per device it may use (None: the devices' own, if the backend says).
      stages: its pipeline stages (for the error).
      batch: samples per minibatch (for the error).

    Attributes:
      peak: the most bytes seen on one of its devices (the program's peak before it trains).
      source: ``"device"`` (the backend's statistics) or ``"arrays"`` (live arrays' bytes plus
        the program's temporaries).

    Raises:
      WSPError: the program's peak exceeds the limit (``"memory"``).
    """

    def __init__(
        self,
        vw: str,
        devices: Sequence[jax.Device],
        program: MemoryUse | None,
        limit: int | None,
        *,
        stages: int = 1,
        batch: int = 0,
    ):
        self.vw, self.devices, self.program = vw, _local(devices), program
        self.limit = limit if limit is not None else device_limit(self.devices)
        self.stages, self.batch = stages, batch
        self.source = "device" if device_limit(self.devices) is not None else "arrays"
        self.peak = program.peak if program is not None else 0
        self._lock = threading.Lock()  # any thread of the VW may observe
        if self.limit is not None and program is not None and program.peak > self.limit:
            raise refuse(vw, stages, batch, program.peak, self.limit, "by XLA's buffer assignment")

    def now(self) -> int:
        """The bytes in use on the VW's busiest device now."""
        if self.source == "device":
            stats = [d.memory_stats() for d in self.devices]
            return max(int(s.get("peak_bytes_in_use", s["bytes_in_use"])) for s in stats)
        ids = {d.id: 0 for d in self.devices}
        for array in jax.live_arrays():
            try:
                shards = array.addressable_shards
            except RuntimeError:  # deleted (donated) meanwhile
                continue
            for shard in shards:
                if shard.device.id in ids:
                    ids[shard.device.id] += shard.data.nbytes
        temporaries = self.program.temporaries if self.program is not None else 0
        return max(ids.values()) + temporaries

    def observe(self) -> int:
        """Read the bytes in use, keep the peak; the bytes now.

        Raises:
          WSPError: they exceed the limit (``"memory"``).
        """
        used = self.now()
        with self._lock:
            self.peak = max(self.peak, used)
        if self.limit is not None and used > self.limit:
            raise refuse(self.vw, self.stages, self.batch, used, self.limit, f"({self.source})")
        return used
