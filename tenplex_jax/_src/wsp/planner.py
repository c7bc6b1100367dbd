"""Planning an asynchronous job: virtual workers, their stages, ``Nm`` and ``D``.

``plan_workers(cluster, profile, minibatch)`` tries HetPipe's groupings of the cluster's devices
into virtual workers (VWs) (:class:`Grouping`): ``node`` (HetPipe's NP: each node a VW, its
devices share fast links), ``equal`` (ED: VW ``i`` takes the ``i``-th device of every node, so
every VW holds the same mix of types and the VWs are equally fast) and ``hybrid`` (HD: each VW
takes ``h`` devices of each of two types, ``h`` half the smallest node's device count, as the
slides' ``R,R,G,G`` and ``V,V,Q,Q`` on four nodes of four V, R, G and Q GPUs). HD pairs the
types: every way of cutting them into pairs of equal device counts is planned, and the pairing
whose VWs' estimated waves are the most balanced (the smallest ratio of the longest wave to the
shortest; ties: the most samples per second) is kept, since a VW that waits for the slowest
one's wave is what WSP loses to heterogeneity.

For each VW the planner's search (``tj.planner.choose``) picks its layout and its stages, each
stage's layers in proportion to its devices' speed. ``Nm`` is at least the VW's stages (a
minibatch in flight on each) and in proportion to its speed (every VW's wave takes about as
long), as far as its memory holds that many in flight. **A wave's estimate** models the pipelined
wave the runtime runs (``tenplex_jax._src.wsp.waves.program``): its ``Nm`` whole minibatches flow
through the ``S`` stages, so it takes ``(Nm + S - 1)`` ticks of the slowest stage (the pipeline
fills and drains once a wave), plus, per minibatch, what runs outside the pipeline (the
embedding and head, the data-parallel gradient all-reduce), plus one push and one pull of the
weights at the cluster's network bandwidth (:class:`WorkerPlan`). The job's throughput is
``sum(Nm) * minibatch / (the longest wave)``. ``D = 1`` (0 for one VW) absorbs a stall of one
wave. The choice, the grouping with the most samples per second or per dollar, says why
(:meth:`WSPChoice.explain`) and is compared with one synchronous job over the same devices.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math

from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, Objective, _Devices, _Facts, choose

MAX_MINIBATCHES = 16


class Grouping(enum.StrEnum):
    """How a cluster's devices are grouped into VWs (see the module docstring)."""

    NODE = "node"  # HetPipe's NP: each node a VW
    EQUAL = "equal"  # ED: VW i takes every node's i-th device
    HYBRID = "hybrid"  # HD: VW takes h devices of each of two paired types


GROUPINGS = tuple(Grouping)
RULES = {
    Grouping.NODE: "each node a VW",
    Grouping.EQUAL: "VW i takes every node's i-th device",
    Grouping.HYBRID: "each VW takes half a node of each of two paired types",
}


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    """One VW: its devices (cluster ids), the planner's layout for them, its ``Nm`` and the
    parts of its wave's estimate.

    Attributes:
      devices: the VW's cluster device ids.
      candidate: the planner's :class:`tenplex_jax.planner.Candidate` for them (its ``devices``
        in cluster ids too).
      minibatches: ``Nm``: minibatches per wave, in proportion to the VW's speed and at least
        its stages.
      stage_seconds: the slowest stage's tick: one whole minibatch through it, forward and
        backward.
      serial_seconds: per minibatch, what runs outside the pipeline (embedding, head, the
        data-parallel gradient all-reduce).
      sync_seconds: one push and one pull of the weights per wave.
      types: each device's type name.
    """

    devices: tuple[int, ...]
    candidate: Candidate
    minibatches: int
    stage_seconds: float
    serial_seconds: float
    sync_seconds: float
    types: tuple[str, ...]

    @property
    def stages(self) -> int:
        """``S``: the VW's pipeline stages."""
        return self.candidate.config.pipe

    @property
    def wave_seconds(self) -> float:
        """The estimated seconds of one wave: ``(Nm + S - 1)`` ticks of the slowest stage (the
        pipeline fills and drains once), ``Nm`` times the part outside the pipeline, one push
        and pull."""
        ticks = self.minibatches + self.stages - 1
        return (
            ticks * self.stage_seconds + self.minibatches * self.serial_seconds + self.sync_seconds
        )

    def formula(self) -> str:
        """``"(4 + 2 - 1) x 0.0500 + 4 x 0.0100 + 0.0300 = 0.3200 s"``: the wave's estimate."""
        return (
            f"({self.minibatches} + {self.stages} - 1) x {self.stage_seconds:.4f} + "
            f"{self.minibatches} x {self.serial_seconds:.4f} + {self.sync_seconds:.4f} = "
            f"{self.wave_seconds:.4f} s"
        )

    def kinds(self) -> str:
        """``"2xtitan-rtx+2xrtx2060"``: the VW's devices by type, in mesh order."""
        counts = {t: self.types.count(t) for t in self.types}
        return "+".join(f"{n}x{t}" for t, n in counts.items())


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
      how: how the grouping formed its VWs (for ``hybrid``: the pairs, and the balance of each
        pairing tried).
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
    how: str

    @property
    def samples_per_usd(self) -> float:
        """Samples per dollar (infinite when the devices have no price)."""
        return self.throughput * 3600 / self.usd_per_hour if self.usd_per_hour else math.inf

    @property
    def balance(self) -> float:
        """The longest VW wave over the shortest (1: every VW's wave takes as long)."""
        waves = [w.wave_seconds for w in self.workers]
        return max(waves) / min(waves)

    def table(self) -> str:
        """The plan as a table: each VW's devices, layout, slowest stage's tick, ``Nm`` and wave
        time, the estimate, the comparison with one synchronous job, and :meth:`explain`."""
        goal = "samples per second" if self.objective == "time" else "samples per dollar"
        lines = [
            f"wsp planner: {self.cluster}; objective {goal}; grouping {str(self.grouping)!r}, "
            f"D = {self.distance}, minibatch {self.minibatch}",
            f"{'vw':>3}  {'devices':<24} {'layout':<44} {'tick s':>8} {'Nm':>3} {'wave s':>8}",
        ]
        for i, w in enumerate(self.workers, 1):
            ids = ",".join(map(str, w.devices))
            lines.append(
                f"{i:3d}  {ids[:24]:<24} {w.candidate.label()[:44]:<44} "
                f"{w.stage_seconds:8.4f} {w.minibatches:3d} {w.wave_seconds:8.4f}"
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
        return "\n".join(lines + [self.explain()])

    def explain(self) -> str:
        """Why this grouping: every grouping tried, best first, with its VWs (devices by type,
        stages, ``Nm``, the wave's estimate worked out), its longest wave and throughput, and
        how far it falls behind the chosen one."""
        per_usd = self.objective == "cost" and self.usd_per_hour
        score = (lambda o: o.samples_per_usd) if per_usd else (lambda o: o.throughput)
        unit = "samples/$" if per_usd else "samples/s"
        lines = [
            "why: a wave of Nm minibatches through S stages takes (Nm + S - 1) x the slowest "
            "stage's tick + Nm x the part outside the pipeline + one push and pull; the job "
            f"runs sum(Nm) minibatches per longest wave; the most {unit} wins"
        ]
        for option in sorted((self, *self.alternatives), key=score, reverse=True):
            verdict = (
                "chosen"
                if option is self
                else f"{1 - score(option) / score(self):.1%} fewer {unit} than "
                f"{str(self.grouping)!r}"
            )
            longest = max(w.wave_seconds for w in option.workers)
            lines.append(
                f"  {str(option.grouping)!r} ({verdict}): {option.how}; {len(option.workers)} "
                f"VWs, longest wave {longest:.4f} s, {score(option):,.1f} {unit}"
            )
            for i, w in enumerate(option.workers, 1):
                stages = "/".join(map(str, w.candidate.stages.layers))
                lines.append(
                    f"    vw{i} {w.kinds()}: {w.candidate.config}, layers {stages}, "
                    f"Nm {w.minibatches}: {w.formula()}"
                )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def groups(
    cluster: Cluster, grouping: Grouping | str, pairs: tuple[tuple[int, int], ...] = ()
) -> list[tuple[int, ...]]:
    """The device ids of each VW under ``grouping``; ``hybrid`` takes ``pairs`` (type indices
    paired, one of :func:`pairings`): VW ``j`` of a pair holds the ``j``-th ``h`` devices of
    each of its two types (in node order), ``h`` half the smallest node's device count.

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
    h, of_type = _half(cluster), _by_type(cluster)
    return [
        tuple(of_type[a][j : j + h] + of_type[b][j : j + h])
        for a, b in pairs
        for j in range(0, len(of_type[a]), h)
    ]


def pairings(cluster: Cluster) -> list[tuple[tuple[int, int], ...]]:
    """Every way to cut the cluster's device types into pairs (type indices) of as many devices
    each, a multiple of half the smallest node's device count (see :func:`groups`).

    Raises:
      PlanError: the nodes' smallest device count is odd, the types are not an even number, or
        no pairing gives two types of each pair as many devices.
    """
    h, of_type = _half(cluster), _by_type(cluster)
    fits = lambda a, b: len(of_type[a]) == len(of_type[b]) and len(of_type[a]) % h == 0

    def cut(kinds: list[int]) -> list[tuple[tuple[int, int], ...]]:
        if not kinds:
            return [()]
        first, rest = kinds[0], kinds[1:]
        return [
            ((first, other), *more)
            for other in rest
            if fits(first, other)
            for more in cut([k for k in rest if k != other])
        ]

    counts = {cluster.types[k].name: len(ids) for k, ids in of_type.items()}
    if len(of_type) % 2:
        raise PlanError(
            f"a hybrid grouping pairs the device types: it needs an even number of them, got "
            f"{len(of_type)} ({counts} devices)"
        )
    found = cut(sorted(of_type))
    if not found:
        raise PlanError(
            f"a hybrid grouping pairs device types of as many devices, a multiple of {h}; "
            f"no pairing of {counts} devices does"
        )
    return found


def _half(cluster: Cluster) -> int:
    """``h``: half the smallest node's device count (what a hybrid VW takes of each type)."""
    counts = sorted(collections.Counter(cluster.nodes).values())
    if counts[0] % 2:
        raise PlanError(
            f"a hybrid grouping needs nodes of an even device count (a VW takes half of the "
            f"smallest node of each of two types); the nodes have {counts} devices"
        )
    return counts[0] // 2


def _by_type(cluster: Cluster) -> dict[int, list[int]]:
    """Each device type's device ids, in node order."""
    of_type: dict[int, list[int]] = {}
    for d in sorted(range(len(cluster.kinds)), key=lambda d: (cluster.nodes[d], d)):
        of_type.setdefault(cluster.kinds[d], []).append(d)
    return of_type


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


def _minibatches(candidates, seconds, profile: ModelProfile) -> list[int]:
    """Each VW's ``Nm``: in proportion to its speed (``seconds``: its wave's seconds per
    minibatch once the pipeline is full; ``r`` times the slowest VW's speed does ``r`` times the
    minibatches a wave), and at least its pipeline's stages (HetPipe: a minibatch in flight on
    every stage, none idle but at a wave's start and end); the proportion is scaled up until
    every VW has that many; at most ``MAX_MINIBATCHES`` and what its memory holds in flight
    (:func:`in_flight_limit`: fewer than its stages if it must)."""
    speed = [max(seconds) / s for s in seconds]
    scale = max(math.ceil(c.config.pipe / r) for c, r in zip(candidates, speed))
    return [
        min(MAX_MINIBATCHES, in_flight_limit(c, profile), max(c.config.pipe, round(scale * r)))
        for c, r in zip(candidates, speed)
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
        print(choice)        # the VWs, their Nm, the estimate, vs one synchronous job, and why
        print(choice.explain())   # every grouping's VWs and waves, best first

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
            options.append(_grouping(cluster, profile, minibatch, grouping, objective))
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


def _grouping(cluster, profile, minibatch: int, grouping, objective: str) -> WSPChoice:
    """One grouping's VWs and estimate; for ``hybrid``, the most balanced pairing's.

    Raises:
      PlanError: the grouping does not apply to the cluster, or a VW fits no layout.
    """
    if grouping != Grouping.HYBRID:
        vws = groups(cluster, grouping)
        return _grouped(cluster, profile, minibatch, grouping, objective, vws, RULES[grouping])
    tried = []
    for pairs in pairings(cluster):
        names = ", ".join(f"{cluster.types[a].name}+{cluster.types[b].name}" for a, b in pairs)
        vws = groups(cluster, grouping, pairs)
        tried.append(_grouped(cluster, profile, minibatch, grouping, objective, vws, names))
    best = min(tried, key=lambda o: (round(o.balance, 6), -o.throughput))
    others = ", ".join(f"{o.how} {o.balance:.2f}" for o in tried if o is not best)
    how = f"{RULES[grouping]}: pairs {best.how}, longest wave / shortest {best.balance:.2f}"
    return dataclasses.replace(best, how=how + (f" (other pairings: {others})" if others else ""))


def _grouped(cluster, profile, minibatch: int, grouping, objective, vws, how) -> WSPChoice:
    """The VWs ``vws`` (device ids), each laid out by the planner's search, and their estimate
    (without the comparison and the alternatives)."""
    candidates = []
    for ids in vws:
        best = choose(cluster.subset(ids), profile, minibatch).best
        candidates.append(dataclasses.replace(best, devices=tuple(ids[i] for i in best.devices)))
    parts = [_wave_parts(cluster, profile, c) for c in candidates]
    nms = _minibatches(candidates, [stage + serial for stage, serial in parts], profile)
    sync = 2 * profile.param_bytes / cluster.network_bandwidth  # one push and one pull
    plans = tuple(
        WorkerPlan(
            devices=ids,
            candidate=c,
            minibatches=nm,
            stage_seconds=stage,
            serial_seconds=serial,
            sync_seconds=sync,
            types=tuple(cluster.device_type(d).name for d in c.devices),
        )
        for ids, c, nm, (stage, serial) in zip(vws, candidates, nms, parts)
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
        how=how,
    )


def _wave_parts(cluster: Cluster, profile: ModelProfile, candidate: Candidate):
    """``(stage, serial)`` seconds of ``candidate``'s layout in a wave, by the search's cost
    model with one microbatch (a wave's tick is a whole minibatch on a stage): the slowest
    stage's tick, and per minibatch what runs outside the pipeline."""
    devices = _Devices.of(cluster, candidate.devices)
    facts = _Facts.of(devices, profile, candidate.global_batch, candidate.config, 1)
    stages = candidate.stages
    ticks = zip(stages.boundaries, stages.layers)
    stage = max(facts.tick(j, start, start + n, stages.slots) for j, (start, n) in enumerate(ticks))
    return float(stage), float(facts.step(0.0, stages.slots))
