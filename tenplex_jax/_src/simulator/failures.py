"""Failures from a mean time to failure: a resource trace of ``fail`` events and their repairs.

A published MTTF is measured at some device count (e.g. 7.9 hours at 1,024 GPUs); failures are
independent per device, so ``N`` devices fail ``N / mttf_devices`` times as often. Exponential
gaps at the rate of the devices up; each failure takes a whole node (uniformly among those up,
never the last one), whose devices are offered back by id (repaired) after ``repair_minutes``.
The events are on a grid of one step per second, so :func:`merge` can lay them beside another's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent
from tenplex_jax._src.errors import LayoutError


def failure_trace(
    nodes: Sequence[int],
    minutes: float,
    mttf_hours: float,
    mttf_devices: int = 1024,
    *,
    repair_minutes: float | None = 60.0,
    seed: int = 0,
    name: str | None = None,
) -> ResourceTrace:
    """A trace of node failures over ``minutes``, at the rate a published MTTF implies.

    >>> trace = failure_trace([0] * 8 + [1] * 8, 600, mttf_hours=7.9, seed=1)
    >>> trace.devices, trace.steps, {e.kind for e in trace.events} <= {"fail", "offer"}
    (16, 36000, True)

    Args:
      nodes: the node of each device (``Cluster.nodes``): device ``i`` is on node ``nodes[i]``.
      minutes: the trace's wall-clock length.
      mttf_hours: the mean time to failure measured at ``mttf_devices`` devices.
      mttf_devices: the device count of that measurement; failures scale as 1/N.
      repair_minutes: how long a failed node is down before it is offered back (None: never).
      seed: the random generator's seed; the same seed gives the same trace.
      name: the trace's name (default: ``"mttf-<hours>h-seed<seed>"``).

    Returns:
      A :class:`tenplex_jax.elastic.ResourceTrace` over ``len(nodes)`` devices, one step per
      second: a ``fail`` of a node's device ids per failure, an ``offer`` of them at its repair.

    Raises:
      LayoutError: no devices, or an argument out of its range.
    """
    if not nodes or not minutes > 0 or not mttf_hours > 0 or mttf_devices < 1:
        raise LayoutError(
            f"a failure trace needs devices, minutes > 0, mttf_hours > 0 and mttf_devices >= 1; "
            f"got {len(nodes)} devices, {minutes} minutes, {mttf_hours} h at {mttf_devices}"
        )
    if repair_minutes is not None and repair_minutes < 0:
        raise LayoutError(f"repair_minutes must be >= 0 or None, got {repair_minutes}")
    members: dict[int, tuple[int, ...]] = {}
    for device, node in enumerate(nodes):
        members[node] = members.get(node, ()) + (device,)
    rate = 1.0 / (mttf_hours * 3600.0 * mttf_devices)  # failures per second per device
    repair = math.inf if repair_minutes is None else repair_minutes * 60.0
    drawn = _draw(members, minutes * 60.0, rate, repair, np.random.default_rng(seed))
    steps = max(math.ceil(minutes * 60.0), 2)
    return ResourceTrace(
        name=name or f"mttf-{mttf_hours:g}h-seed{seed}",
        devices=len(nodes),
        steps=steps,
        events=tuple(
            TraceEvent(step=min(max(int(t), 1), steps - 1), kind=kind, devices=devices)
            for t, _, kind, devices in sorted(drawn)
        ),
        description=(
            f"node failures at MTTF {mttf_hours:g} h per {mttf_devices} devices, repaired after "
            f"{repair_minutes} min, seed {seed}"
        ),
        minutes=float(minutes),
    )


def _draw(members: dict, end: float, rate: float, repair: float, rng) -> list[tuple]:
    """``(second, order, kind, devices)`` of each failure (order 0) and repair (1) before
    ``end``, at ``rate`` per device up (see the module docstring)."""
    down: dict[int, float] = {}  # node -> when it is repaired
    events, t = [], 0.0
    while True:
        up = [n for n in members if n not in down]
        live = sum(len(members[n]) for n in up)
        # the next failure among the devices up now; a repair before it changes the rate
        t_next = t + rng.exponential(1.0 / (rate * live))
        back = min(down.values(), default=math.inf)
        if back < t_next:
            t = back
            down = {n: r for n, r in down.items() if r != back}
            continue
        t = t_next
        if t >= end:
            return events
        if len(up) < 2:  # never the last node up: wait for a repair
            if not down:
                return events
            t = min(down.values())
            continue
        node = up[int(rng.integers(len(up)))]
        events.append((t, 0, "fail", members[node]))
        down[node] = t + repair
        if t + repair < end:
            events.append((t + repair, 1, "offer", members[node]))


def merge(a: ResourceTrace, b: ResourceTrace, name: str | None = None) -> ResourceTrace:
    """Two traces of one machine's devices as one, by wall-clock time, one step per second.

    Args:
      a: a :class:`tenplex_jax.elastic.ResourceTrace` with ``minutes`` (scale it to the
        cluster first).
      b: another over the same devices, with ``minutes``.
      name: the merged trace's name (default: ``"<a>+<b>"``).

    Returns:
      The trace as long as the longer one, its events in time order (``a``'s first at a tie),
      with ``a``'s ``checkpoint_every`` in steps of a second.

    Raises:
      LayoutError: the device counts differ, or a trace has no ``minutes``.
    """
    if a.devices != b.devices or a.minutes is None or b.minutes is None:
        raise LayoutError(
            f"merging traces needs the same devices and a length in minutes each: {a.name!r} "
            f"has {a.devices} devices, {a.minutes} min; {b.name!r} {b.devices}, {b.minutes} min"
        )
    minutes = max(a.minutes, b.minutes)
    steps = max(math.ceil(minutes * 60), 2)

    def timed(trace: ResourceTrace, order: int):
        seconds = trace.minutes * 60 / trace.steps
        return [(e.step * seconds, order, i, e) for i, e in enumerate(trace.events)]

    events = sorted(timed(a, 0) + timed(b, 1), key=lambda x: x[:3])
    every = None
    if a.checkpoint_every:
        every = max(round(a.checkpoint_every * a.minutes * 60 / a.steps), 1)
    return ResourceTrace(
        name=name or f"{a.name}+{b.name}",
        devices=a.devices,
        steps=steps,
        events=tuple(
            dataclasses.replace(e, step=min(max(int(t), 1), steps - 1)) for t, _, _, e in events
        ),
        checkpoint_every=every,
        description=f"{a.description} | {b.description}".strip(" |"),
        minutes=float(minutes),
    )
