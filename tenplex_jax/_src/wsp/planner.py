"""Planning an asynchronous job: virtual workers, their stages, ``Nm`` and ``D``.

``plan_workers(cluster, profile, minibatch)`` tries two groupings of the cluster's devices into
virtual workers (VWs), as HetPipe's resource allocator does:

- ``node``: each node is a VW (a node's devices share fast links: pipeline and data parallelism
  inside it cost least);
- ``equal``: VW ``i`` takes the ``i``-th device of every node (HetPipe's equal distribution: every
  VW holds the same mix of device types, so the VWs are equally fast);
- ``hybrid``: between the two (HetPipe's hybrid distribution): VW ``i`` takes the ``i``-th block of
  ``h`` adjacent devices of every node, ``h`` the largest divisor of the smallest node's device
  count below it: the same mix of types in every VW as ``equal``, in fewer, larger VWs whose
  stages keep more of their devices inside one node.

For each VW the planner's search (``tj.planner.choose``, the cost model of ``search.py``) picks its
layout and its pipeline stages, each stage's layers in proportion to its devices' speed. ``Nm`` (the
minibatches of a wave, in flight together in the VW's pipeline) is at least the VW's stages, so
that every stage holds one, and set per VW in proportion to the VW's speed, so that every VW's
wave takes about as long and the clocks advance together, as far as its memory holds the weight
versions and activations of that many minibatches in flight; the job's throughput is
then ``sum(Nm) / (the longest wave)``. ``D = 1`` lets a VW start a wave before the slowest has
finished the previous one (a stall of one wave is absorbed), ``D = 0`` when there is one VW. The
choice is the grouping with the most samples per second (``objective="time"``) or per dollar
(``"cost"``); it is compared with one synchronous job over the same devices and the same samples
per step (the planner's best SPMD layout), where every step waits for the slowest device.
"""

from __future__ import annotations

import dataclasses
import math

from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, choose

GROUPINGS = ("node", "equal", "hybrid")
MAX_MINIBATCHES = 16


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
      grouping: ``"node"`` (each node a VW), ``"equal"`` (VW ``i`` takes every node's
        ``i``-th device) or ``"hybrid"`` (VW ``i`` takes every node's ``i``-th block of devices).
      workers: one :class:`WorkerPlan` per VW.
      distance: WSP's ``D`` (1, or 0 for one VW).
      minibatch: samples per minibatch.
      objective: ``"time"`` or ``"cost"``.
      throughput: the estimated samples per second of the whole job.
      usd_per_hour: the price of the devices used.
      synchronous: the planner's best single SPMD job over the same devices with ``sum(Nm)``
        minibatches a step, for comparison (None when none fits).
      alternatives: ``(grouping, samples/s, samples per $)`` of the groupings not chosen.
      cluster: the cluster, as ``str(cluster)`` shows it.
    """

    grouping: str
    workers: tuple[WorkerPlan, ...]
    distance: int
    minibatch: int
    objective: str
    throughput: float  # samples per second
    usd_per_hour: float
    synchronous: Candidate | None  # one SPMD job over the same devices, sum(Nm) minibatches a step
    alternatives: tuple[tuple[str, float, float], ...]  # (grouping, samples/s, samples per $)
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
            f"wsp planner: {self.cluster}; objective {goal}; grouping {self.grouping!r}, "
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
        for grouping, throughput, per_usd in self.alternatives:
            lines.append(
                f"grouping {grouping!r}: {throughput:.1f} samples/s"
                + (f", {per_usd:,.0f} samples/$" if math.isfinite(per_usd) else "")
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def groups(cluster: Cluster, grouping: str) -> list[tuple[int, ...]]:
    """The device ids of each VW under ``grouping``."""
    by_node: dict[int, list[int]] = {}
    for d, node in enumerate(cluster.nodes):
        by_node.setdefault(node, []).append(d)
    if grouping == "node":
        return [tuple(ids) for ids in by_node.values()]
    width = min(len(ids) for ids in by_node.values())
    if grouping == "equal":
        return [tuple(ids[i] for ids in by_node.values()) for i in range(width)]
    if grouping == "hybrid":
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
    raise PlanError(f"a grouping is one of {GROUPINGS}, got {grouping!r}")


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

    Returns:
      The :class:`WSPChoice`.

    Raises:
      PlanError: the objective is unknown, or no grouping fits the model (an unknown grouping
        fits none); the message names each grouping's refusal.
    """
    if objective not in ("time", "cost"):
        raise PlanError(f"objective must be 'time' or 'cost', got {objective!r}")
    options, refused = [], []
    for grouping in groupings:
        try:
            workers = []
            for ids in groups(cluster, grouping):
                best = choose(cluster.subset(ids), profile, minibatch).best
                workers.append(
                    (ids, dataclasses.replace(best, devices=tuple(ids[i] for i in best.devices)))
                )
        except PlanError as error:
            refused.append(f"{grouping}: {error}")
            continue
        plans = tuple(
            WorkerPlan(ids, c, nm) for (ids, c), nm in zip(workers, _minibatches(workers, profile))
        )
        wave = max(w.wave_seconds for w in plans)
        throughput = sum(w.minibatches for w in plans) * minibatch / wave
        price = sum(cluster.device_type(d).usd_per_hour for w in plans for d in w.devices)
        options.append((grouping, plans, throughput, price))
    if not options:
        raise PlanError(
            f"no grouping of {cluster} into virtual workers fits {profile.name!r}: "
            + "; ".join(refused)
        )
    score = lambda o: o[2] if objective == "time" else (o[2] / o[3] if o[3] else o[2])
    grouping, plans, throughput, price = max(options, key=score)
    total = sum(w.minibatches for w in plans) * minibatch
    try:
        sync = choose(cluster, profile, total).best
    except PlanError:
        sync = None
    alternatives = tuple(
        (g, t, t * 3600 / p if p else math.inf) for g, _, t, p in options if g != grouping
    )
    return WSPChoice(
        grouping,
        plans,
        1 if len(plans) > 1 else 0,
        minibatch,
        objective,
        throughput,
        price,
        sync,
        alternatives,
        str(cluster),
    )
