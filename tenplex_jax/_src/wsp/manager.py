"""What a job of virtual workers asks devices from: a cluster manager (Hydrozoa's serverless
containers, a Ray cluster's free resources, a lab's free GPUs).

:class:`ClusterManager` is the interface the scaling policy's :meth:`Scaler.grow` calls: a
quote for more devices, a request (the devices granted, maybe fewer), a release.
:class:`LocalPool` answers from a pool of this machine's device ids with their prices (the tests'
and the benchmarks' cluster). A manager on Ray would answer from the cluster's free resources;
WSP has no Ray launcher yet, so there is none here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from tenplex_jax._src.errors import WSPError


class ClusterManager(Protocol):
    """A source of devices for a job (see the module docstring)."""

    def quote(self, count: int) -> float | None:
        """The price, $/hour, of the next ``count`` devices a request would grant; None when
        it has fewer free."""

    def request(self, count: int) -> tuple[int, ...]:
        """Grant up to ``count`` devices: their ids (fewer, or none, when it has fewer)."""

    def release(self, devices: Sequence[int]) -> None:
        """Take ``devices`` back (their VW left)."""


class LocalPool:
    """A :class:`ClusterManager` over a pool of device ids, granted in the pool's order.

    >>> pool = LocalPool([2, 3, 4], usd_per_device_hour=1.5)
    >>> pool.quote(2), pool.request(2), pool.quote(2), pool.request(2)
    (3.0, (2, 3), None, (4,))

    Args:
      free: the device ids it may grant.
      usd_per_device_hour: each device's price, $/hour: a number, or ``f(device id)``.

    Attributes:
      free: the ids not granted, in order.
      granted: every grant, in order (``(count asked, ids granted)``).

    Raises:
      WSPError: a device is in the pool twice, or a price is negative (``"invalid"``).
    """

    def __init__(
        self, free: Iterable[int], usd_per_device_hour: float | Callable[[int], float] = 0.0
    ):
        self.free = list(free)
        self.price = (
            usd_per_device_hour
            if callable(usd_per_device_hour)
            else lambda device: float(usd_per_device_hour)
        )
        if len(set(self.free)) != len(self.free):
            raise WSPError(f"a pool holds each device once, got {self.free}", "invalid")
        if any(self.price(d) < 0 for d in self.free):
            raise WSPError(
                f"device prices are >= 0 $/hour, got {[self.price(d) for d in self.free]}",
                "invalid",
            )
        self.granted: list[tuple[int, tuple[int, ...]]] = []
        self._lock = threading.Lock()

    def quote(self, count: int) -> float | None:
        """The price, $/hour, of the pool's next ``count`` free devices; None when fewer are
        free."""
        with self._lock:
            if count > len(self.free):
                return None
            return sum(self.price(d) for d in self.free[:count])

    def request(self, count: int) -> tuple[int, ...]:
        """Grant up to ``count`` devices, the pool's next free ones in order: their ids."""
        with self._lock:
            ids, self.free = tuple(self.free[:count]), self.free[count:]
            self.granted.append((count, ids))
            return ids

    def release(self, devices: Sequence[int]) -> None:
        """Take ``devices`` back into the pool.

        Raises:
          WSPError: some of ``devices`` are free already (never granted, or released twice).
        """
        with self._lock:
            back = [d for d in devices if d in self.free]
            if back:
                raise WSPError(f"devices {back} were not granted: they are free", "invalid")
            self.free.extend(devices)
