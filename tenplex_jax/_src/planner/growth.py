"""When growing pays: the rule every part of tenplex_jax uses to weigh new devices.

The in-process job (``ElasticJob.offer``), the launcher on Ray (a joining node) and the simulator
apply the same rule to their own numbers: grow when the step time saved over the remaining steps
exceeds what the change costs. Pure, and free of JAX, so that the launcher can use it.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Growth:
    """The growth rule's decision and the numbers behind it: what :func:`growth` returns
    (``EventRecord.estimate`` of an offer); ``dataclasses.asdict`` gives its JSON.

    Attributes:
      source: where the step times come from (``"planner"``, ``"launcher"``, ``"measured,
        scaled by the device count"``).
      step_seconds_now: the step time on the devices the job has.
      step_seconds_new: the estimated step time after growing.
      remaining_steps: the steps left to run (None: unknown, the gain is infinite).
      gain_seconds: the step time saved over the remaining steps.
      bytes_moved: the bytes the change moves.
      bandwidth: the bytes per second they move at.
      transfer_seconds: ``bytes_moved / bandwidth``.
      compile_seconds: the compile the change waits for (0 when compiled ahead).
      compiled_ahead: whether the new layout's step is compiled ahead.
      restart_seconds: what starting new processes costs (a new generation; 0 in one process).
      cost_seconds: transfer, compile and restart seconds.
      grow: whether the gain exceeds the cost.
    """

    source: str
    step_seconds_now: float
    step_seconds_new: float
    remaining_steps: int | None
    gain_seconds: float
    bytes_moved: int
    bandwidth: float
    transfer_seconds: float
    compile_seconds: float
    compiled_ahead: bool
    restart_seconds: float
    cost_seconds: float
    grow: bool


def growth(
    *,
    step_seconds_now: float,
    step_seconds_new: float,
    remaining_steps: int | None,
    bytes_moved: int,
    bandwidth: float,
    compile_seconds: float,
    compiled_ahead: bool,
    source: str,
    restart_seconds: float = 0.0,
) -> Growth:
    """Grow now? The estimated gain over the remaining steps against the reconfiguration's cost:
    the plan's bytes over the bandwidth, plus the compile unless the step is compiled ahead, plus
    ``restart_seconds`` where the change starts new processes (a new generation)."""
    gain = (
        math.inf
        if remaining_steps is None
        else (step_seconds_now - step_seconds_new) * remaining_steps
    )
    compile_s = 0.0 if compiled_ahead else compile_seconds
    transfer = bytes_moved / bandwidth
    cost = transfer + compile_s + restart_seconds
    return Growth(
        source=source,
        step_seconds_now=step_seconds_now,
        step_seconds_new=step_seconds_new,
        remaining_steps=remaining_steps,
        gain_seconds=gain,
        bytes_moved=bytes_moved,
        bandwidth=bandwidth,
        transfer_seconds=transfer,
        compile_seconds=compile_s,
        compiled_ahead=compiled_ahead,
        restart_seconds=restart_seconds,
        cost_seconds=cost,
        grow=bool(gain > cost),
    )
