"""When growing pays: the rule every part of tenplex_jax uses to weigh new devices.

The in-process job (``ElasticJob.offer``), the launcher on Ray (a joining node) and the simulator
apply the same rule to their own numbers: grow when the step time saved over the remaining steps
exceeds what the change costs. Pure, and free of JAX, so that the launcher can use it.
"""

from __future__ import annotations

import math


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
) -> dict:
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
    return {
        "source": source,
        "step_seconds_now": step_seconds_now,
        "step_seconds_new": step_seconds_new,
        "remaining_steps": remaining_steps,
        "gain_seconds": gain,
        "bytes_moved": bytes_moved,
        "bandwidth": bandwidth,
        "transfer_seconds": transfer,
        "compile_seconds": compile_s,
        "compiled_ahead": compiled_ahead,
        "restart_seconds": restart_seconds,
        "cost_seconds": transfer + compile_s + restart_seconds,
        "grow": bool(gain > transfer + compile_s + restart_seconds),
    }
