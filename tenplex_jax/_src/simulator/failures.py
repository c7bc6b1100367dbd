"""Failures from a mean time to failure: a resource trace of ``fail`` events and their repairs.

A published MTTF is measured at some device count (e.g. 7.9 hours at 1,024 GPUs); failures are
independent per device, so a job on ``N`` devices fails ``N / mttf_devices`` times as often. The
generator draws exponential gaps at the rate of the devices that are up, takes one whole node
(chosen uniformly among the nodes that are up) at each failure, and offers its devices back by id
after ``repair_minutes``: the simulator treats failed devices offered by id as repaired. It never
takes the last node that is up (a job needs one). The events are on a grid of one step per
second, so :func:`merge` can lay them beside another trace's.
"""

from __future__ import annotations

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
      repair_minutes: how long a failed node stays down before its devices are offered back
        (None: never).
      seed: the random generator's seed; the same seed gives the same trace.
      name: the trace's name (default: ``"mttf-<hours>h-seed<seed>"``).

    Returns:
      A :class:`tenplex_jax.elastic.ResourceTrace` over ``len(nodes)`` devices, one step per
      second, ``minutes`` long: a ``fail`` event with a node's device ids per failure and an
      ``offer`` of the same ids at its repair (within the trace).

    Raises:
      LayoutError: no devices, ``minutes`` or ``mttf_hours`` not positive, ``mttf_devices``
        below 1, or a negative repair time.
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
    rng = np.random.default_rng(seed)
    end = minutes * 60.0
    per_device = 1.0 / (mttf_hours * 3600.0 * mttf_devices)  # failures per second per device
    down: dict[int, float] = {}  # node -> when it is repaired
    events: list[tuple[float, int, str, tuple[int, ...]]] = []
    t = 0.0
    while True:
        up = [n for n in members if n not in down]
        live = sum(len(members[n]) for n in up)
        # the next failure among the devices up now; a repair before it changes the rate
        t_next = t + rng.exponential(1.0 / (per_device * live))
        repair = min(down.values(), default=math.inf)
        if repair < t_next:
            t = repair
            down = {n: r for n, r in down.items() if r != repair}
            continue
        t = t_next
        if t >= end:
            break
        if len(up) < 2:  # never the last node up: wait for a repair
            if not down:
                break
            t = min(down.values())
            continue
        node = up[int(rng.integers(len(up)))]
        events.append((t, 0, "fail", members[node]))
        if repair_minutes is not None:
            back = t + repair_minutes * 60.0
            down[node] = back
            if back < end:
                events.append((back, 1, "offer", members[node]))
        else:
            down[node] = math.inf
    steps = max(math.ceil(end), 2)
    events.sort()
    trace_events = tuple(
        TraceEvent(min(max(int(t), 1), steps - 1), kind, devices) for t, _, kind, devices in events
    )
    return ResourceTrace(
        name or f"mttf-{mttf_hours:g}h-seed{seed}",
        len(nodes),
        steps,
        trace_events,
        description=(
            f"node failures at MTTF {mttf_hours:g} h per {mttf_devices} devices, repaired after "
            f"{repair_minutes} min, seed {seed}"
        ),
        minutes=float(minutes),
    )


def merge(a: ResourceTrace, b: ResourceTrace, name: str | None = None) -> ResourceTrace:
    """Two traces of one machine's devices as one, by wall-clock time, one step per second.

    Args:
      a: a :class:`tenplex_jax.elastic.ResourceTrace` with ``minutes`` (scale it to the
        cluster first).
      b: another over the same devices, with ``minutes``.
      name: the merged trace's name (default: ``"<a>+<b>"``).

    Returns:
      The trace as long as the longer one, its events in time order (at one time, ``a``'s
      first), ``a``'s ``checkpoint_every`` carried over in seconds.

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
        name or f"{a.name}+{b.name}",
        a.devices,
        steps,
        tuple(
            TraceEvent(min(max(int(t), 1), steps - 1), e.kind, e.devices, e.count)
            for t, _, _, e in events
        ),
        every,
        f"{a.description} | {b.description}".strip(" |"),
        float(minutes),
    )
