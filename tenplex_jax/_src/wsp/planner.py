"""Planning an asynchronous job: virtual workers, their stages, ``Nm`` and ``D``.

``plan_workers(cluster, profile, minibatch)`` tries HetPipe's groupings of the cluster's devices
into virtual workers (VWs) (:class:`Grouping`): ``node`` (each node a VW: its devices share fast
links), ``equal`` (VW ``i`` takes the ``i``-th device of every node: every VW holds the same mix
of types, so the VWs are equally fast) and ``hybrid`` (VW ``i`` takes the ``i``-th block of ``h``
adjacent devices of every node, ``h`` the largest divisor of the smallest node's device count
below it: the same mix in fewer, larger VWs). For each VW the planner's search
(``tj.planner.choose``) picks its layout and its stages, each stage's layers in proportion to its
devices' speed. ``Nm`` is at least the VW's stages (a minibatch in flight on each) and in
proportion to its speed (every VW's wave takes about as long), as far as its memory holds that
many in flight; the job's throughput is then ``sum(Nm) / (the longest wave)``. ``D = 1`` (0 for
one VW) absorbs a stall of one wave. The choice, the grouping with the most samples per second
or per dollar, is compared with one synchronous job over the same devices and samples per step.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, Objective, choose

MAX_MINIBATCHES = 16


class Grouping(enum.StrEnum):
    """How a cluster's devices are grouped into VWs (see the module docstring)."""

    NODE = "node"  # each node a VW
    EQUAL = "equal"  # VW i takes every node's i-th device
    HYBRID = "hybrid"  # VW i takes every node's i-th block of adjacent devices


GROUPINGS = tuple(Grouping)


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """One VW: its devices (cluster ids), the planner's layout for them and its ``Nm``.

    Attributes:
      devices: the VW's cluster device ids.
      candidate: the planner's :class:`tenplex_jax.planner.Candidate` for them (its ``devices``
        in cluster ids too).
      minibatches: ``Nm``: minibatches per wave, in proportion to the VW's speed and at least
        its stages.
    """

    devices: tuple[int, ...]
    candidate: Candidate
    minibatches: int

    @property
    def wave_seconds(self) -> float:
        """The estimated seconds of one wave: ``Nm`` steps."""
        return self.minibatches * self.candidate.step_time


@dataclasses.dataclass(frozen=True)
class WSPChoice:
    """The chosen VWs, ``D``, the estimate, and how the alternatives and one synchronous job
    compare: what :func:`plan_workers` returns; ``print(choice)`` shows :meth:`table`.

    Attributes:
      grouping: the :class:`Grouping` chosen.
      workers: one :class:`WorkerPlan` per VW.
      distance: WSP's ``D`` (1, or 0 for one VW).
      minibatch: samples per minibatch.
      objective: ``"time"`` or ``"cost"``.
      throughput: the estimated samples per second of the whole job.
      usd_per_hour: the price of the devices used.
      synchronous: the planner's best single SPMD job over the same devices with ``sum(Nm)``
        minibatches a step, for comparison (None when none fits).
      alternatives: the choice of each grouping not chosen (without its own alternatives).
      cluster: the cluster, as ``str(cluster)`` shows it.
    """

    grouping: Grouping
    workers: tuple[WorkerPlan, ...]
    distance: int
    minibatch: int
    objective: str
    throughput: float  # samples per second
    usd_per_hour: float
    synchronous: Candidate | None  # one SPMD job over the same devices, sum(Nm) minibatches a step
    alternatives: tuple[WSPChoice, ...]
    cluster: str

    @property
    def samples_per_usd(self) -> float:
        """Samples per dollar (infinite when the devices have no price)."""
        return self.throughput * 3600 / self.usd_per_hour if self.usd_per_hour else math.inf

    def table(self) -> str:
        """The plan as a table: each VW's devices, layout, step time, ``Nm`` and wave time, the
        estimate, and the comparisons."""
        goal = "samples per second" if self.objective == "time" else "samples per dollar"
        lines = [
            f"wsp planner: {self.cluster}; objective {goal}; grouping {str(self.grouping)!r}, "
            f"D = {self.distance}, minibatch {self.minibatch}",
            f"{'vw':>3}  {'devices':<24} {'layout':<44} {'s/minibatch':>11} {'Nm':>3} "
            f"{'wave s':>8}",
        ]
        for i, w in enumerate(self.workers, 1):
            ids = ",".join(map(str, w.devices))
            lines.append(
                f"{i:3d}  {ids[:24]:<24} {w.candidate.label()[:44]:<44} "
                f"{w.candidate.step_time:11.4f} {w.minibatches:3d} {w.wave_seconds:8.4f}"
            )
        lines.append(
            f"estimated {self.throughput:.1f} samples/s"
            + (f", {self.samples_per_usd:,.0f} samples/$" if self.usd_per_hour else "")
        )
        if self.synchronous is not None:
            s = self.synchronous
            lines.append(
                f"one synchronous job on the same devices ({s.label()}): "
                f"{s.throughput:.1f} samples/s, WSP {self.throughput / s.throughput:.2f}x"
            )
        for other in self.alternatives:
            per_usd = other.samples_per_usd
            lines.append(
                f"grouping {str(other.grouping)!r}: {other.throughput:.1f} samples/s"
                + (f", {per_usd:,.0f} samples/$" if math.isfinite(per_usd) else "")
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def groups(cluster: Cluster, grouping: Grouping | str) -> list[tuple[int, ...]]:
    """The device ids of each VW under ``grouping``.

    Raises:
      PlanError: an unknown grouping, or a hybrid one the cluster's nodes do not allow.
    """
    if grouping not in GROUPINGS:
        raise PlanError(f"a grouping is one of {[str(g) for g in Grouping]}, got {grouping!r}")
    by_node: dict[int, list[int]] = {}
    for d, node in enumerate(cluster.nodes):
        by_node.setdefault(node, []).append(d)
    if grouping == Grouping.NODE:
        return [tuple(ids) for ids in by_node.values()]
    width = min(len(ids) for ids in by_node.values())
    if grouping == Grouping.EQUAL:
        return [tuple(ids[i] for ids in by_node.values()) for i in range(width)]
    block = max((h for h in range(2, width) if width % h == 0), default=None)
    if block is None or len(by_node) < 2:
        raise PlanError(
            f"a hybrid grouping needs two nodes or more whose smallest has a device count "
            f"with a divisor between 1 and itself; the nodes have "
            f"{sorted(len(ids) for ids in by_node.values())} devices"
        )
    return [
        tuple(d for ids in by_node.values() for d in ids[i : i + block])
        for i in range(0, width, block)
    ]


def in_flight_limit(candidate: Candidate, profile: ModelProfile) -> int:
    """The most minibatches a VW laid out as ``candidate`` keeps in flight within its devices'
    memory: each one past the first adds, on every device of a stage, a version of the stage's
    weights (HetPipe's weight stashing: it runs on the weights it read) and what it keeps for its
    backward pass (each layer's input, the layers recomputed as the search's memory model has
    them, and the part outside the pipeline's); the candidate's estimate holds one. At least 1."""
    c = candidate.config
    slots = candidate.stages.slots
    weights = slots * max(layer.param_bytes for layer in profile.layers)
    weights = (weights + profile.outside.param_bytes) / (c.tensor * c.fsdp)
    samples = -(-candidate.global_batch // (c.data * c.fsdp))
    per_sample = slots * max(layer.out_bytes for layer in profile.layers)
    acts = (per_sample + profile.outside.act_bytes) * samples / c.tensor
    free = min(limit - used for used, limit in zip(candidate.memory, candidate.memory_limit))
    return 1 + max(0, int(free // (weights + acts)))


def _minibatches(workers, profile: ModelProfile) -> list[int]:
    """Each VW's ``Nm``: in proportion to its speed (``r`` times the slowest VW's speed does
    ``r`` times the minibatches a wave), and at least its pipeline's stages (HetPipe: a minibatch
    in flight on every stage, none idle but at a wave's start and end); the proportion is scaled
    up until every VW has that many; at most ``MAX_MINIBATCHES`` and what its memory holds in
    flight (:func:`in_flight_limit`: fewer than its stages if it must)."""
    slowest = max(c.step_time for _, c in workers)
    speed = [slowest / c.step_time for _, c in workers]
    scale = max(math.ceil(c.config.pipe / r) for (_, c), r in zip(workers, speed))
    return [
        min(MAX_MINIBATCHES, in_flight_limit(c, profile), max(c.config.pipe, round(scale * r)))
        for (_, c), r in zip(workers, speed)
    ]


def plan_workers(
    cluster: Cluster,
    profile: ModelProfile,
    minibatch: int,
    *,
    objective: str = "time",
    groupings=GROUPINGS,
) -> WSPChoice:
    """The VWs, their layouts, ``Nm`` and ``D`` for ``profile`` on ``cluster`` with minibatches
    of ``minibatch`` samples (see the module docstring). Example::

        choice = plan_workers(tj.planner.Cluster.load("meshes/hetpipe.toml"), profile, 32)
        print(choice)        # the VWs, their Nm, the estimate, vs one synchronous job

    Args:
      cluster: the :class:`tenplex_jax.planner.Cluster`.
      profile: the model's :class:`tenplex_jax.planner.ModelProfile`.
      minibatch: samples per minibatch (each VW's global batch).
      objective: ``"time"`` (most samples per second) or ``"cost"`` (per dollar).
      groupings: the groupings to try: ``"node"``, ``"equal"``, ``"hybrid"`` (one that does
        not apply to the cluster is refused, as one that does not fit).

    Raises:
      PlanError: the objective is unknown, or no grouping fits the model (an unknown grouping
        fits none); the message names each grouping's refusal.
    """
    if objective not in tuple(Objective):
        raise PlanError(f"objective must be 'time' or 'cost', got {objective!r}")
    options, refused = [], []
    for grouping in groupings:
        try:
            options.append(_grouped(cluster, profile, minibatch, grouping, objective))
        except PlanError as error:
            refused.append(f"{grouping}: {error}")
    if not options:
        raise PlanError(
            f"no grouping of {cluster} into virtual workers fits {profile.name!r}: "
            + "; ".join(refused)
        )
    cost = lambda o: objective == "cost" and o.usd_per_hour  # free devices: by throughput
    best = max(options, key=lambda o: o.throughput / o.usd_per_hour if cost(o) else o.throughput)
    try:  # one SPMD job over the same devices, sum(Nm) minibatches a step
        sync = choose(cluster, profile, sum(w.minibatches for w in best.workers) * minibatch).best
    except PlanError:
        sync = None
    others = tuple(o for o in options if o is not best)
    return dataclasses.replace(best, synchronous=sync, alternatives=others)


def _grouped(cluster, profile, minibatch: int, grouping, objective: str) -> WSPChoice:
    """The VWs of one grouping, each laid out by the planner's search, and their estimate
    (without the comparison and the alternatives).

    Raises:
      PlanError: the grouping does not apply to the cluster, or a VW fits no layout.
    """
    workers = []
    for ids in groups(cluster, grouping):
        best = choose(cluster.subset(ids), profile, minibatch).best
        workers.append(
            (ids, dataclasses.replace(best, devices=tuple(ids[i] for i in best.devices)))
        )
    plans = tuple(
        WorkerPlan(devices=ids, candidate=c, minibatches=nm)
        for (ids, c), nm in zip(workers, _minibatches(workers, profile))
    )
    wave = max(w.wave_seconds for w in plans)
    return WSPChoice(
        grouping=Grouping(grouping),
        workers=plans,
        distance=1 if len(plans) > 1 else 0,
        minibatch=minibatch,
        objective=objective,
        throughput=sum(w.minibatches for w in plans) * minibatch / wave,
        usd_per_hour=sum(cluster.device_type(d).usd_per_hour for w in plans for d in w.devices),
        synchronous=None,
        alternatives=(),
        cluster=str(cluster),
    )
