"""The policies the simulator compares, and the costs its network model does not derive.

Imports nothing heavy, so the command line can show the defaults without starting JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterable, Mapping

from tenplex_jax._src.errors import PlanError, one_of


class Policy(enum.StrEnum):
    """A policy ``simulate`` compares (a ``str``: ``Policy.CENTRAL == "central"``)."""

    TENPLEX = "tenplex"  # tenplex's transformation, pulled from the tensor stores
    CENTRAL = "central"  # the same, every byte through one node (Tenplex-Central)
    CHECKPOINT_RESTART = "checkpoint-restart"  # an orbax save, a restart, a restore

    @classmethod
    def parse(cls, names: Iterable[str], what: str = "a policy") -> tuple[Policy, ...]:
        """``names`` as policies, in order; a :class:`PlanError` names an unknown one as
        ``what``."""
        return tuple(one_of(cls, name, what, PlanError) for name in names)


class CheckpointRule(enum.StrEnum):
    """Which rule gave the checkpoint interval (:func:`checkpoint_interval`)."""

    GIVEN = "given"  # Costs.checkpoint_minutes
    TRACE = "trace"  # the trace's checkpoint_every
    YOUNG_DALY = "young-daly"  # sqrt(2 * C * MTTF)
    DEFAULT = "default"  # 30 minutes: no failure rate known


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointInterval:
    """The minutes between the periodic checkpoints every policy takes, and why.

    Attributes:
      minutes: the interval.
      rule: the :class:`CheckpointRule` that gave it.
      mttf_hours: the job's mean time to failure Young/Daly used (None: another rule).
      cost_seconds: ``C``, the seconds one checkpoint stops training.
      note: a sentence for a table (``"checkpoint every 13.4 min (Young/Daly: ...)"``).
    """

    minutes: float
    rule: CheckpointRule
    mttf_hours: float | None = None
    cost_seconds: float
    note: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Blocking:
    """What a layout's periodic writes cost training (``Simulation.blocking``).

    Attributes:
      copy: the seconds a periodic commit (tenplex, central) or checkpoint (every policy) stops
        training: its device-to-host copy, which the writes then overlap.
      save: the seconds of a whole checkpoint save, which bounds how often one can start.
    """

    copy: float
    save: float


FIXED = {
    "latency_seconds": "request",
    "piece_seconds": "piece received",
    "shard_seconds": "shard built",
    "leaf_seconds": "leaf rebuilt",
    "run_seconds": "run copied",
}
"""The network model's fixed costs (seconds each, which :class:`Costs` passes on to it), and
what each one is paid per."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Costs:
    """What the network model does not derive, for a job at the cluster's scale; every policy
    is charged alike where the facts are alike (:func:`assumptions` says it in words).

    Attributes:
      restart_seconds: new processes up to their first collective (start-up,
        ``jax.distributed`` initialize, the runtime's communicators): one number for every
        policy, or ``{policy: seconds}`` (policies left out take the class default, 60).
      compile_seconds: the new layout's train step compiled cold, as ``restart_seconds``
        (default 120).
      commit_every: steps between commits to the stores.
      checkpoint_minutes: minutes between orbax checkpoints, every policy (None: by
        :func:`checkpoint_interval`'s rules).
      replicas: store copies beyond the writer's.
      piece_seconds: host work per piece a node's devices receive; this and the next six are
        passed on to :class:`~tenplex_jax._src.simulator.network.Network`, which says how.
      latency_seconds: a round trip per request or message, in sequence per node's process.
      shard_seconds: host work per new shard a node builds.
      leaf_seconds: host work per leaf a node's process rebuilds.
      run_seconds: host work per contiguous run a piece is copied as (CPU devices).
      store_get_bandwidth: bytes per second a node's tensor store serves (None: not a limit).
      store_put_bandwidth: bytes per second a node's tensor store takes in (None: not a limit).
      detect_seconds: from a failure to its notice (a coordinator's health checks or a
        heartbeat timeout), charged to every policy at a failure.
      compile_ahead: a change announced in advance (preempt, offer, redeploy) has its step
        compiled before it happens, by every policy (False: every change compiles on demand).
      executable_cache: a failure's layout loads its step from an executable cache, so no
        policy compiles after a failure either.
      young_daly: Young/Daly's interval before the trace's ``checkpoint_every``
        (:func:`checkpoint_interval`).
      mttf_hours: a published mean time to failure at ``mttf_devices`` devices (None: the
        trace's failures give the rate).
      mttf_devices: the device count ``mttf_hours`` was measured at (failures scale as 1/N).

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
                keys = Policy.parse(value, f"a policy of Costs.{name}")
                object.__setattr__(self, name, {p: float(value[p]) for p in keys})
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

    def restart(self, policy: Policy) -> float:
        """``restart_seconds`` for ``policy``: the seconds it takes to restart processes."""
        return _of(self.restart_seconds, policy, 60.0)

    def compile(self, policy: Policy) -> float:
        """``compile_seconds`` for ``policy``: the seconds it takes to compile a step cold."""
        return _of(self.compile_seconds, policy, 120.0)

    def compiled_ahead(self, kind: str) -> bool:
        """Whether a change of this kind finds its step compiled, the same for every policy:
        an announced one with ``compile_ahead``, a ``"fail"`` with ``executable_cache``."""
        return self.executable_cache if kind == "fail" else self.compile_ahead

    def mttf_seconds(self, devices: int) -> float | None:
        """A job's mean time to failure on ``devices`` devices, in seconds, from ``mttf_hours``
        (``mttf_hours * mttf_devices / devices``; None without it)."""
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
    costs: Costs, trace, minutes: float, blocking: Blocking, devices: int
) -> CheckpointInterval:
    """The minutes between the periodic checkpoints every policy takes, and why, by the rules
    docs/simulator.md lists in order, for ``trace`` scaled to the cluster (``devices`` devices,
    ``minutes`` long) and the first layout's ``blocking``."""
    given = trace.checkpoint_every / trace.steps * minutes if trace.checkpoint_every else None
    interval = functools.partial(CheckpointInterval, cost_seconds=float(blocking.copy))
    if costs.checkpoint_minutes:
        m = float(costs.checkpoint_minutes)
        return interval(minutes=m, rule=CheckpointRule.GIVEN, note=f"checkpoint every {m:.1f} min")
    if given and not costs.young_daly:
        note = f"checkpoint every {given:.1f} min (the trace's checkpoint_every)"
        return interval(minutes=given, rule=CheckpointRule.TRACE, note=note)
    mttf = costs.mttf_seconds(devices)
    source = f"{costs.mttf_hours} h at {costs.mttf_devices} devices, {devices} here"
    if mttf is None:
        fails = sum(e.kind == "fail" for e in trace.events)
        mttf = minutes * 60 / fails if fails else None
        source = f"the trace's {fails} failures in {minutes:.0f} min"
    if mttf is not None:
        seconds = max(young_daly(blocking.copy, mttf), blocking.save, 60.0)
        note = (
            f"checkpoint every {seconds / 60:.1f} min (Young/Daly: C {blocking.copy:.3g}"
            f" s, MTTF {mttf / 3600:.3g} h from {source})"
        )
        rule = CheckpointRule.YOUNG_DALY
        return interval(minutes=seconds / 60, rule=rule, mttf_hours=mttf / 3600, note=note)
    if given:
        note = f"checkpoint every {given:.1f} min (the trace's; no failure rate known)"
        return interval(minutes=given, rule=CheckpointRule.TRACE, note=note)
    note = "checkpoint every 30 min (no failure rate known)"
    return interval(minutes=30.0, rule=CheckpointRule.DEFAULT, note=note)


def assumptions(
    costs: Costs, policy: Policy, checkpoint: CheckpointInterval | None = None
) -> tuple[str, ...]:
    """What ``policy`` was charged under ``costs``, a sentence per assumption, for a table or
    the JSON; with the ``checkpoint`` interval (None: none to state, as for one change)."""
    compile_s = costs.compile(policy)
    out = [f"restart {costs.restart(policy):g} s at every change"]
    ahead = "compiled ahead" if costs.compile_ahead else f"compiled on demand ({compile_s:g} s)"
    out.append(f"announced changes {ahead}")
    out.append(
        "failures load the step from an executable cache"
        if costs.executable_cache
        else f"failures compile on demand ({compile_s:g} s)"
    )
    if checkpoint is not None:
        out.append(checkpoint.note)
    if policy != Policy.CHECKPOINT_RESTART:
        out.append(
            f"commits to the stores every {costs.commit_every} steps, {costs.replicas} "
            f"replica(s); a failure beyond them falls back to the checkpoint"
        )
    else:
        out.append("saves a checkpoint at an announced change; a failure loses the work since one")
    if policy == Policy.CENTRAL:
        out.append("every byte through one node")
    fixed = [f"{getattr(costs, n):g} s per {w}" for n, w in FIXED.items() if getattr(costs, n)]
    if fixed:
        out.append(", ".join(fixed))
    rates = [
        f"{getattr(costs, f'store_{op}_bandwidth') / 1e9:g} GB/s {op}"
        for op in ("get", "put")
        if getattr(costs, f"store_{op}_bandwidth")
    ]
    if rates and policy != Policy.CHECKPOINT_RESTART:
        out.append("each node's store serves " + " and ".join(rates))
    if costs.detect_seconds:
        out.append(f"a failure is noticed after {costs.detect_seconds:g} s")
    return tuple(out)
