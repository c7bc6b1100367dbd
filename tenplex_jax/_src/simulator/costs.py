"""The policies the simulator compares, and the costs its network model does not derive.

Imports nothing heavy, so the command line can show the defaults without starting JAX.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from tenplex_jax._src.errors import PlanError

POLICIES = ("tenplex", "central", "checkpoint-restart")
"""The policies ``simulate`` compares: tenplex's transformation from the tensor stores, the same
with every byte through one node (Tenplex-Central), and checkpoint-restart through storage."""


FIXED = {
    "latency_seconds": "request",
    "piece_seconds": "piece received",
    "shard_seconds": "shard built",
    "leaf_seconds": "leaf rebuilt",
    "run_seconds": "run copied",
}
"""The network model's fixed costs (seconds each, which :class:`Costs` passes on to it), and
what each one is paid per."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the network model does not derive, for a job at the cluster's scale.

    Every policy is charged alike where the facts are alike: a change announced in advance
    (preempt, offer, redeploy) is compiled ahead by every policy (``compile_ahead``), a failure
    compiles on demand for every policy (unless ``executable_cache``), and every policy
    checkpoints at the same interval.

    Attributes:
      restart_seconds: new processes up to their first collective (start-up,
        ``jax.distributed`` initialize, the runtime's communicators): one number for every
        policy, or ``{policy: seconds}`` (policies left out take the class default, 60).
      compile_seconds: the new layout's train step, compiled cold: a number, or per policy as
        ``restart_seconds`` (default 120).
      commit_every: steps between commits to the stores.
      checkpoint_minutes: minutes between orbax checkpoints, every policy (None: see
        ``young_daly``).
      replicas: store copies beyond the writer's.
      piece_seconds: host work per piece a node's devices receive (a slice, a kernel launch,
        a buffer): with ``shard_seconds``, ``leaf_seconds`` and ``run_seconds``, a node's
        process does it in sequence; it adds to the transfer on CPU devices and overlaps it on
        accelerators (:mod:`~tenplex_jax._src.simulator.network`).
      latency_seconds: a round trip per request or message (a store pull, a put, a storage
        read or write, a send across nodes), paid in sequence by each node's process, on top
        of the transfer.
      shard_seconds: host work per new shard a node builds.
      leaf_seconds: host work per leaf a node's process rebuilds.
      run_seconds: host work per contiguous run a piece is copied as (CPU devices).
      store_get_bandwidth: bytes per second a node's tensor store serves (None: not a limit).
      store_put_bandwidth: bytes per second a node's tensor store takes in (None: not a limit).
      detect_seconds: from a failure to its notice (a coordinator's health checks or a
        heartbeat timeout), charged to every policy at a failure; announced changes have none.
      compile_ahead: a change announced in advance has its layout's step compiled before it
        happens, by every policy (checkpoint-restart's new processes load that executable);
        False: every change compiles on demand.
      executable_cache: a failure's layout loads its step from an executable cache compiled
        earlier, so no policy compiles after a failure either.
      young_daly: with no ``checkpoint_minutes``, checkpoint at Young/Daly's interval
        ``sqrt(2 * C * MTTF)`` (``C``: the seconds a checkpoint stops training; MTTF: the job's,
        from ``mttf_hours`` or the trace's failures) even where the trace gives
        ``checkpoint_every``. False: the trace's ``checkpoint_every`` first, then Young/Daly,
        then 30 minutes when no failure rate is known.
      mttf_hours: a published mean time to failure, at ``mttf_devices`` devices (None: the
        trace's failures give the rate).
      mttf_devices: the device count ``mttf_hours`` was measured at; failures scale as 1/N
        with the job's devices.

    Raises:
      PlanError: a per-policy mapping names an unknown policy, or a cost is negative.
    """

    restart_seconds: float | Mapping[str, float] = 60.0
    compile_seconds: float | Mapping[str, float] = 120.0
    commit_every: int = 10
    checkpoint_minutes: float | None = None
    replicas: int = 1
    piece_seconds: float = 0.0
    latency_seconds: float = 0.0
    compile_ahead: bool = True
    executable_cache: bool = False
    young_daly: bool = False
    mttf_hours: float | None = None
    mttf_devices: int = 1024
    shard_seconds: float = 0.0
    leaf_seconds: float = 0.0
    run_seconds: float = 0.0
    store_get_bandwidth: float | None = None
    store_put_bandwidth: float | None = None
    detect_seconds: float = 0.0

    def __post_init__(self):
        for name in ("restart_seconds", "compile_seconds"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                unknown = sorted(set(value) - set(POLICIES))
                if unknown:
                    raise PlanError(f"Costs.{name}: policies are {POLICIES}, got {unknown}")
                object.__setattr__(self, name, {p: float(s) for p, s in value.items()})
            values = value.values() if isinstance(value, Mapping) else (value,)
            if any(not s >= 0 for s in values):
                raise PlanError(f"Costs.{name} must be >= 0, got {value!r}")
        for name in (*FIXED, "detect_seconds"):
            if not getattr(self, name) >= 0:
                raise PlanError(f"Costs.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("store_get_bandwidth", "store_put_bandwidth"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise PlanError(f"Costs.{name} must be > 0 or None, got {getattr(self, name)!r}")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            raise PlanError(f"Costs.checkpoint_minutes must be > 0, got {self.checkpoint_minutes}")
        if self.mttf_hours is not None and not (self.mttf_hours > 0 and self.mttf_devices >= 1):
            raise PlanError(
                f"Costs.mttf_hours must be > 0 and mttf_devices >= 1, got {self.mttf_hours} "
                f"and {self.mttf_devices}"
            )

    def network_costs(self) -> dict:
        """The fixed costs and store rates the network model takes, as keyword arguments of
        :class:`~tenplex_jax._src.simulator.network.Network`."""
        names = (*FIXED, "store_get_bandwidth", "store_put_bandwidth")
        return {name: getattr(self, name) for name in names}

    def restart(self, policy: str) -> float:
        """The seconds ``policy`` takes to restart processes.

        Args:
          policy: one of ``POLICIES``.

        Returns:
          ``restart_seconds`` for it.
        """
        return _of(self.restart_seconds, policy, 60.0)

    def compile(self, policy: str) -> float:
        """The seconds ``policy`` takes to compile a layout's step cold.

        Args:
          policy: one of ``POLICIES``.

        Returns:
          ``compile_seconds`` for it.
        """
        return _of(self.compile_seconds, policy, 120.0)

    def compiled_ahead(self, kind: str) -> bool:
        """Whether a change of this kind finds its step compiled (the same for every policy).

        Args:
          kind: the event's kind (``"fail"`` has no notice).

        Returns:
          True for an announced change with ``compile_ahead``, or a failure with
          ``executable_cache``.
        """
        return self.executable_cache if kind == "fail" else self.compile_ahead

    def mttf_seconds(self, devices: int) -> float | None:
        """The mean time to failure of a job on ``devices`` devices from ``mttf_hours``.

        Args:
          devices: the job's device count.

        Returns:
          ``mttf_hours * mttf_devices / devices`` in seconds, or None without ``mttf_hours``.
        """
        if self.mttf_hours is None:
            return None
        return self.mttf_hours * 3600 * self.mttf_devices / devices


def young_daly(checkpoint_seconds: float, mttf_seconds: float) -> float:
    """Young's optimal checkpoint interval, the first order of Daly's: ``sqrt(2 * C * MTTF)``.

    >>> round(young_daly(10.0, 3600.0))
    268

    Args:
      checkpoint_seconds: ``C``, what one checkpoint costs the job in seconds.
      mttf_seconds: the job's mean time to failure in seconds.

    Returns:
      The seconds between checkpoints that minimise checkpoint cost plus expected lost work.

    Raises:
      PlanError: a negative cost or a non-positive MTTF.
    """
    if not (checkpoint_seconds >= 0 and mttf_seconds > 0):
        raise PlanError(
            f"Young/Daly needs a checkpoint cost >= 0 and an MTTF > 0, got {checkpoint_seconds} "
            f"and {mttf_seconds}"
        )
    return math.sqrt(2.0 * checkpoint_seconds * mttf_seconds)


def _of(value, policy: str, default: float) -> float:
    if isinstance(value, Mapping):
        return float(value.get(policy, default))
    return float(value)


def checkpoint_interval(
    costs: Costs, trace, minutes: float, blocking: Mapping, devices: int
) -> dict:
    """The minutes between the periodic checkpoints every policy takes, and why.

    In order: ``costs.checkpoint_minutes``; the trace's ``checkpoint_every`` unless
    ``costs.young_daly``; Young/Daly (:func:`young_daly`) with ``C`` the seconds a checkpoint
    stops training and the job's MTTF from ``costs.mttf_hours`` or else the trace's failures
    (its length over their number), no shorter than a whole save nor a minute; the trace's
    ``checkpoint_every``; 30 minutes.

    Args:
      costs: the :class:`Costs`.
      trace: the :class:`tenplex_jax.elastic.ResourceTrace`, scaled to the cluster.
      minutes: the trace's wall-clock length.
      blocking: ``Simulation.blocking`` of the first layout (``"checkpoint"``, ``"save"``).
      devices: the job's device count, for ``costs.mttf_hours``.

    Returns:
      ``{"minutes", "rule", "mttf_hours", "cost_seconds", "note"}``: the interval, which rule
      gave it (``"given"``, ``"trace"``, ``"young-daly"``, ``"default"``), the MTTF used (or
      None), ``C``, and a sentence for a table.
    """
    out = {"mttf_hours": None, "cost_seconds": float(blocking["checkpoint"])}
    given = trace.checkpoint_every / trace.steps * minutes if trace.checkpoint_every else None
    if costs.checkpoint_minutes:
        m = float(costs.checkpoint_minutes)
        return out | {"minutes": m, "rule": "given", "note": f"checkpoint every {m:.1f} min"}
    if given and not costs.young_daly:
        note = f"checkpoint every {given:.1f} min (the trace's checkpoint_every)"
        return out | {"minutes": given, "rule": "trace", "note": note}
    mttf = costs.mttf_seconds(devices)
    source = f"{costs.mttf_hours} h at {costs.mttf_devices} devices, {devices} here"
    if mttf is None:
        fails = sum(e.kind == "fail" for e in trace.events)
        mttf = minutes * 60 / fails if fails else None
        source = f"the trace's {fails} failures in {minutes:.0f} min"
    if mttf is not None:
        seconds = max(young_daly(blocking["checkpoint"], mttf), blocking["save"], 60.0)
        note = (
            f"checkpoint every {seconds / 60:.1f} min (Young/Daly: C {blocking['checkpoint']:.3g}"
            f" s, MTTF {mttf / 3600:.3g} h from {source})"
        )
        return out | {
            "minutes": seconds / 60,
            "rule": "young-daly",
            "mttf_hours": mttf / 3600,
            "note": note,
        }
    if given:
        note = f"checkpoint every {given:.1f} min (the trace's; no failure rate known)"
        return out | {"minutes": given, "rule": "trace", "note": note}
    note = "checkpoint every 30 min (no failure rate known)"
    return out | {"minutes": 30.0, "rule": "default", "note": note}


def assumptions(costs: Costs, policy: str, checkpoint: Mapping | None = None) -> list[str]:
    """What a policy was charged, in words, for a table or the JSON.

    Args:
      costs: the :class:`Costs`.
      policy: one of ``POLICIES``.
      checkpoint: what :func:`checkpoint_interval` returned (None: no periodic checkpoints
        to state, as for one change).

    Returns:
      One sentence per assumption.
    """
    compile_s = costs.compile(policy)
    out = [f"restart {costs.restart(policy):g} s at every change"]
    out.append(
        "announced changes compiled ahead"
        if costs.compile_ahead
        else f"announced changes compiled on demand ({compile_s:g} s)"
    )
    out.append(
        "failures load the step from an executable cache"
        if costs.executable_cache
        else f"failures compile on demand ({compile_s:g} s)"
    )
    if checkpoint is not None:
        out.append(checkpoint["note"])
    if policy != "checkpoint-restart":
        out.append(
            f"commits to the stores every {costs.commit_every} steps, {costs.replicas} "
            f"replica(s); a failure beyond them falls back to the checkpoint"
        )
    else:
        out.append("saves a checkpoint at an announced change; a failure loses the work since one")
    if policy == "central":
        out.append("every byte through one node")
    fixed = [f"{getattr(costs, n):g} s per {w}" for n, w in FIXED.items() if getattr(costs, n)]
    if fixed:
        out.append(", ".join(fixed))
    rates = [
        f"{getattr(costs, f'store_{op}_bandwidth') / 1e9:g} GB/s {op}"
        for op in ("get", "put")
        if getattr(costs, f"store_{op}_bandwidth")
    ]
    if rates and policy != "checkpoint-restart":
        out.append("each node's store serves " + " and ".join(rates))
    if costs.detect_seconds:
        out.append(f"a failure is noticed after {costs.detect_seconds:g} s")
    return out
