"""The planner: the parallel config, microbatches and stage boundaries for a set of devices.

Given a cluster (devices with memory, speed and price), a model profile (per-layer FLOPs, parameter
and activation bytes) and the global batch, ``choose`` returns the ``(data, fsdp, tensor, pipe)``
config, the number of microbatches and the layers of every pipeline stage that minimise the
estimated step time under every device's memory limit, or (``objective="cost"``) maximise samples
per dollar over subsets of the cluster's devices. It explains itself: ``print(choice)`` shows the
best candidates with their estimated time and memory, and how many configs each rule rejected,
with an example.

**Cost model** (``estimate``; one function, used by the search and by the brute-force tests). The
devices are ordered fastest first and cut into ``pipe`` consecutive stage groups of
``data * fsdp * tensor`` devices (mesh order: ``pipe`` outermost). A stage runs in lockstep, so it
has the speed and memory of its slowest and smallest device. With ``b`` samples per microbatch and
replica, a stage's tick (forward + backward of one microbatch) is::

    sum over its layers of 4 * flops * b / (tensor * speed)    compute (fwd, recompute, bwd)
      + 4 all-reduces of the layer output over the tensor group (ring volume)   tensor parallelism
      + fsdp all-gathers and reduce-scatter of the stage's rows                  fsdp
      + send and receive of one microbatch to the next stage                     pipeline

and the step is ``(microbatches + pipe - 1) * slowest tick`` (the GPipe schedule of
``tenplex_jax._src.pipelining`` runs every stage in lockstep at every tick) plus the gradient
all-reduce over ``data`` and the part outside the pipeline (embedding, head), which every stage
runs. Links inside a node run at the device type's ``link_bandwidth``, others at the cluster's
network bandwidth. Memory per device: ``state_factor`` × (the stage's stacked rows + the outside
params) / (tensor × fsdp), plus every layer's input for every tick of the schedule (layers are
rematerialised, as in GPipe), plus one layer's activations while it is recomputed, plus the
outside part's activations. Uneven stages are stored padded to ``slots = max(layers per stage)``
rows, which the memory and communication terms count.

**Search.** Every ``(pipe, data, fsdp, tensor)`` whose product is the device count and whose
``data * fsdp`` replicas get at least one sample each (an uneven split is padded, as
``BatchLayout`` does, and the padded rows are counted), every microbatch count dividing the
per-replica rows (1 without pipelining); for each, the stage boundaries by dynamic programming:
for each slot count ``K``, the split into stages of at most ``K`` layers that minimises the
slowest tick (``O(pipe * layers * K)``). With identical stage groups and identical layers the most
even split is optimal and no DP runs, which keeps 4096 devices under a second.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import time
from collections.abc import Iterable, Sequence

import numpy as np

from tenplex_jax._src.errors import PlanError, one_of
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.planner.cluster import GIB, Cluster
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.ptc import ParallelConfig


class Objective(enum.StrEnum):
    """What :func:`choose` optimizes: ``"time"`` (the shortest step) or ``"cost"`` (the most
    samples per dollar)."""

    TIME = "time"
    COST = "cost"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One evaluated layout: its step time (s), peak memory per stage (bytes) and price.

    What :func:`estimate` returns, and what a :class:`Choice` ranks.

    Attributes:
      config: the parallel config.
      microbatches: GPipe microbatches per step (1 without pipelining).
      stages: the layers of every pipeline stage (:class:`tenplex_jax.pipelining.Stages`).
      devices: the cluster device indices in mesh order (fastest first).
      step_time: the estimated seconds of one training step.
      memory: the estimated peak bytes per device, per stage.
      memory_limit: the smallest device's memory, per stage.
      global_batch: samples per step.
      usd_per_hour: the price of the devices used.
    """

    config: ParallelConfig
    microbatches: int
    stages: Stages
    devices: tuple[int, ...]  # cluster device indices in mesh order
    step_time: float
    memory: tuple[int, ...]  # peak bytes per device, per stage
    memory_limit: tuple[int, ...]  # the smallest device's memory, per stage
    global_batch: int
    usd_per_hour: float = 0.0

    @property
    def fits(self) -> bool:
        """Whether every stage's peak memory is within its smallest device's."""
        return all(m <= lim for m, lim in zip(self.memory, self.memory_limit))

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.global_batch / self.step_time

    @property
    def samples_per_usd(self) -> float:
        """Samples per dollar (infinite when the devices have no price)."""
        return self.throughput * 3600 / self.usd_per_hour if self.usd_per_hour else math.inf

    def score(self, objective: str) -> float:
        """The candidate's rank under an objective; lower is better.

        Args:
          objective: ``"time"`` (the step time) or ``"cost"`` (minus the samples per dollar).

        Returns:
          The score.
        """
        return self.step_time if objective == Objective.TIME else -self.samples_per_usd

    def label(self) -> str:
        """``"pipe=2,data=4 mb=8 stages=3/5"``: the config, microbatches and stages, for a table."""
        stages = (
            "" if self.config.pipe == 1 else f" stages={'/'.join(map(str, self.stages.layers))}"
        )
        return f"{self.config} mb={self.microbatches}{stages}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The planner's answer: the best candidate, the runners-up, and what was rejected and why.

    What :func:`choose` returns; ``print(choice)`` shows :meth:`table`.

    Attributes:
      best: the chosen :class:`Candidate`.
      top: the best candidates, best first (``best`` among them).
      rejected: ``(rule, how many configs, one example)`` for every rule that rejected a config.
      objective: the :class:`Objective`.
      cluster: the cluster, as ``str(cluster)`` shows it.
      evaluated: how many layouts were evaluated.
      seconds: how long the search took.
    """

    best: Candidate
    top: tuple[Candidate, ...]
    rejected: tuple[tuple[str, int, str], ...]  # (rule, how many configs, one example)
    objective: Objective
    cluster: str
    evaluated: int
    seconds: float

    def table(self) -> str:
        """The answer as a table: the top candidates with their step time, throughput, peak
        memory, price and distance to the best, then the rejections."""
        time_ = self.objective == Objective.TIME
        goal = "minimum step time" if time_ else "maximum samples per dollar"
        head = (
            f"{'#':>2}  {'config':<44} {'step ms':>9} {'samples/s':>10} {'peak GiB':>9} "
            f"{'limit GiB':>9} {'$/h':>7} {'samples/$':>10}  vs best"
        )
        lines = [
            (
                f"planner: {self.cluster}; objective {goal}; {self.evaluated} layouts evaluated "
                f"in {self.seconds * 1e3:.0f} ms"
            ),
            head,
            "-" * len(head),
        ]
        for rank, c in enumerate(self.top, 1):
            if rank == 1:
                why = "chosen"
            elif time_:
                why = f"{c.step_time / self.best.step_time - 1:+.1%} time"
            else:
                why = f"{c.samples_per_usd / self.best.samples_per_usd - 1:+.1%} samples/$"
            per_usd = f"{c.samples_per_usd:10.0f}" if c.usd_per_hour else f"{'-':>10}"
            lines.append(
                f"{rank:2d}  {c.label():<44} {c.step_time * 1e3:9.2f} {c.throughput:10.1f} "
                f"{max(c.memory) / GIB:9.2f} {min(c.memory_limit) / GIB:9.2f} "
                f"{c.usd_per_hour:7.2f} {per_usd}  {why}"
            )
        if self.rejected:
            lines.append("rejected:")
            for rule, count, example in self.rejected:
                lines.append(f"  {count:5d} x {rule}: e.g. {example}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def choose(
    cluster: Cluster,
    model: ModelProfile,
    global_batch: int,
    *,
    objective: Objective | str = "time",
    even_stages: bool = False,
    max_microbatches: int = 64,
    min_throughput: float = 0.0,
    subsets: bool | None = None,
    configs: Iterable[ParallelConfig] | None = None,
    top: int = 8,
) -> Choice:
    """The best layout of ``model`` on ``cluster`` for ``global_batch``: every
    ``(pipe, data, fsdp, tensor)`` config of the device count, every microbatch count and the best
    stage boundaries for each, under the cost model of :func:`estimate` and every device's memory
    (the module docstring).

    >>> h100 = DeviceType("h100", memory=80 * GIB, flops=400e12, link_bandwidth=450e9)
    >>> layer = LayerProfile(flops=2e9, param_bytes=50_000_000, act_bytes=10**6, out_bytes=10**5)
    >>> profile = ModelProfile("toy", (layer,) * 8, LayerProfile(1e8, 10**7, 10**5, 0))
    >>> choice = choose(Cluster.uniform(16, h100), profile, global_batch=256)
    >>> choice.best.config, choice.best.stages.layers    # print(choice) shows the table
    (ParallelConfig(data=4, fsdp=1, tensor=1, pipe=4), (2, 2, 2, 2))

    Args:
      cluster: the :class:`Cluster` of devices.
      model: the :class:`ModelProfile`.
      global_batch: samples per step, split over ``data * fsdp`` replicas (padded when uneven).
      objective: an :class:`Objective` (``"cost"`` also chooses how many devices of a type to
        use: 0, a power of two, or all).
      even_stages: keep only equal pipeline stages (no padded layout).
      max_microbatches: the most GPipe microbatches tried.
      min_throughput: with ``"cost"``, the fewest samples/s a layout must reach (without a floor
        the cheapest is often one device).
      subsets: search subsets of the devices (default: with ``"cost"`` only); with ``"time"`` it
        finds, say, that a mixed cluster is faster without its slowest devices.
      configs: search only these mesh shapes (``ParallelConfig`` s).
      top: how many candidates :class:`Choice` keeps.

    Returns:
      A :class:`Choice`: the best candidate, the runners-up and the rejections.

    Raises:
      PlanError: the objective or global batch is invalid, ``"cost"`` meets a type without a
        price, or no config fits; the message names every rule that rejected one, with an
        example.
    """
    tic = time.perf_counter()
    objective = _checked_objective(cluster, global_batch, objective)
    search = _Search(model, global_batch, objective, even_stages, max_microbatches, min_throughput)
    subsets = objective == Objective.COST if subsets is None else subsets
    only = None if configs is None else set(configs)
    for devices in _subsets(cluster) if subsets else [tuple(range(cluster.num_devices))]:
        search.run(cluster, devices, only)
    return search.choice(cluster, top, tic)


def _checked_objective(cluster: Cluster, global_batch, objective) -> Objective:
    """The objective, once it and the global batch are valid for ``cluster``."""
    objective = one_of(Objective, objective, "objective", PlanError)
    if not isinstance(global_batch, (int, np.integer)) or global_batch < 1:
        raise PlanError(f"the global batch must be an integer >= 1, got {global_batch!r}")
    free = [t.name for t in cluster.types if t.usd_per_hour <= 0]
    if objective == Objective.COST and free:
        raise PlanError(
            f"the cost objective needs a price per device type; cluster {cluster.name!r} has "
            f"no usd_per_hour for {free}"
        )
    return objective


def estimate(
    cluster: Cluster,
    model: ModelProfile,
    global_batch: int,
    config: ParallelConfig,
    microbatches: int,
    stages: Stages,
    devices: Sequence[int] | None = None,
) -> Candidate:
    """The cost model's step time and memory for one layout (no validity checks beyond shapes).

    The model is in the module docstring; :func:`choose` ranks what this returns.

    >>> h100 = DeviceType("h100", memory=80 * GIB, flops=400e12, link_bandwidth=450e9)
    >>> layer = LayerProfile(flops=2e9, param_bytes=50_000_000, act_bytes=10**6, out_bytes=10**5)
    >>> profile = ModelProfile("toy", (layer,) * 8, LayerProfile(1e8, 10**7, 10**5, 0))
    >>> cluster, config = Cluster.uniform(16, h100), ParallelConfig(data=16)
    >>> c = estimate(cluster, profile, 256, config, microbatches=1, stages=Stages((8,)))
    >>> c.fits, round(c.step_time * 1e3, 1)      # milliseconds
    (True, 33.3)

    Args:
      cluster: the :class:`Cluster`.
      model: the :class:`ModelProfile`.
      global_batch: samples per step.
      config: the parallel config; its device count is that of ``devices``.
      microbatches: GPipe microbatches per step.
      stages: the layers of every stage: ``config.pipe`` stages of ``model.num_layers`` layers.
      devices: the cluster device indices used, in any order (default: all); they are ordered
        fastest first, as the search does.

    Returns:
      The :class:`Candidate` with its step time, memory and price.

    Raises:
      PlanError: the device count is not the config's, or ``stages`` does not split the
        model's layers into ``config.pipe`` stages.
    """
    facts = _Facts.of(_Devices.of(cluster, devices), model, global_batch, config, microbatches)
    if stages.num_stages != config.pipe or stages.num_layers != model.num_layers:
        raise PlanError(
            f"stages {stages.layers} must split the {model.num_layers} layers of {model.name!r} "
            f"into pipe={config.pipe} stages"
        )
    return facts.candidate(stages)


@dataclasses.dataclass(frozen=True)
class _Facts:
    """Everything about one (devices, config, microbatches) that the stage split does not change."""

    devices: _Devices
    model: ModelProfile
    global_batch: int
    config: ParallelConfig
    microbatches: int
    per_flop: np.ndarray  # [stage] seconds per layer FLOP of a microbatch (fwd, remat, bwd)
    per_out_byte: np.ndarray  # [stage] tensor-parallel seconds per output byte
    per_row: np.ndarray  # [stage] fsdp seconds per param byte of a stacked row, per tick
    send: float  # seconds to pass one microbatch on, per tick
    dp_bandwidth: np.ndarray  # [stage]
    memory_limit: np.ndarray  # [stage]
    outside_seconds: float
    flops: np.ndarray  # [layers + 1] prefix sums of forward FLOPs per sample
    outs: np.ndarray  # [layers + 1] prefix sums of output bytes per sample

    @classmethod
    def of(cls, devs: _Devices, model, global_batch, config, microbatches) -> _Facts:
        p, d, f, t = config.pipe, config.data, config.fsdp, config.tensor
        if len(devs.ids) != config.num_devices:
            raise PlanError(
                f"config {config} needs {config.num_devices} devices, got {len(devs.ids)}"
            )
        speed = devs.flops.reshape(p, -1).min(1)
        link = devs.link.reshape(p, -1).min(1)
        memory = devs.memory.reshape(p, -1).min(1)
        nodes = devs.nodes.reshape(p, d * f, t)
        net = devs.network
        tp_bw = np.where((nodes == nodes[..., :1]).all(axis=(1, 2)), link, net)
        one_node = (nodes == nodes[:, :1, :1]).all(axis=(1, 2))
        dp_bw = np.where(one_node, link, net)
        samples = -(-global_batch // (d * f))  # per replica; an uneven split is padded
        b = samples / microbatches
        ring = lambda n: 2 * (n - 1) / n
        per_flop = 4 * b / (t * speed)  # forward, recompute (remat), backward = 2 forwards
        per_out = (4 * ring(t) * b / tp_bw) if t > 1 else np.zeros(p)
        per_row = (1.5 * ring(f) / (t * dp_bw)) if f > 1 else np.zeros(p)
        out_bytes = max(layer.out_bytes for layer in model.layers)
        same = p > 1 and len(set(nodes[:, 0, 0].tolist())) == 1
        send = 2 * out_bytes * b / (min(link) if same else net) if p > 1 else 0.0
        out = model.outside
        outside = 3 * out.flops * samples / (t * speed.min())
        if d * f > 1:
            outside += ring(d * f) * out.param_bytes / t / dp_bw.min()
        return cls(
            devs,
            model,
            global_batch,
            config,
            microbatches,
            per_flop,
            per_out,
            per_row,
            send,
            dp_bw,
            memory,
            outside,
            np.concatenate([[0.0], np.cumsum([layer.flops for layer in model.layers])]),
            np.concatenate([[0.0], np.cumsum([layer.out_bytes for layer in model.layers])]),
        )

    @property
    def row_bytes(self) -> int:
        return max(layer.param_bytes for layer in self.model.layers)

    def tick(self, stage: int, start: int, stop: int, slots: int) -> float:
        """Seconds of one tick of ``stage`` holding layers ``start..stop-1`` in ``slots`` rows."""
        return (
            self.per_flop[stage] * (self.flops[stop] - self.flops[start])
            + self.per_out_byte[stage] * (self.outs[stop] - self.outs[start])
            + self.per_row[stage] * slots * self.row_bytes
            + self.send
        )

    def memory(self, slots: int) -> np.ndarray:
        """Peak bytes per device of every stage when each stage stores ``slots`` rows."""
        c, m = self.config, self.model
        samples = -(-self.global_batch // (c.data * c.fsdp))  # per replica, padded
        b = samples / self.microbatches
        ticks = self.microbatches + c.pipe - 1
        act = max(layer.act_bytes for layer in m.layers)
        out = max(layer.out_bytes for layer in m.layers)
        rows = slots * self.row_bytes + m.outside.param_bytes
        state = m.state_factor * rows / (c.tensor * c.fsdp)
        inputs = out * slots * b * ticks  # every layer's input, for every tick (remat)
        outside = m.outside.act_bytes * samples
        acts = (inputs + act * b + outside) / c.tensor
        return np.full(c.pipe, state + acts)

    def step(self, slowest_tick: float, slots: int) -> float:
        c = self.config
        ring = 2 * (c.data - 1) / c.data
        sync = ring * slots * self.row_bytes / (c.tensor * c.fsdp) / self.dp_bandwidth
        return (
            (self.microbatches + c.pipe - 1) * slowest_tick
            + float(sync.max())
            + self.outside_seconds
        )

    def candidate(self, stages: Stages) -> Candidate:
        slowest_tick = max(
            self.tick(j, start, start + n, stages.slots)
            for j, (start, n) in enumerate(zip(stages.boundaries, stages.layers))
        )
        return Candidate(
            self.config,
            self.microbatches,
            stages,
            self.devices.ids,
            float(self.step(slowest_tick, stages.slots)),
            tuple(int(m) for m in self.memory(stages.slots)),
            tuple(int(m) for m in self.memory_limit),
            self.global_batch,
            self.devices.usd_per_hour,
        )

    def uniform(self) -> bool:
        """Identical stage groups and identical layers: the most even split is optimal."""
        same = lambda a: bool(np.all(a == a[0]))
        layers = self.model.layers
        return (
            same(self.per_flop)
            and same(self.per_out_byte)
            and same(self.per_row)
            and all(layer == layers[0] for layer in layers)
        )

    def best_split(self, cap: int) -> tuple[Stages, float] | None:
        """The split into ``pipe`` stages of 1..``cap`` layers with the smallest slowest tick."""
        p, n = self.config.pipe, self.model.num_layers
        if self.uniform():
            base, extra = divmod(n, p)
            layers = (base,) * (p - extra) + (base + 1,) * extra
            if max(layers) > cap:
                return None
            stages = Stages(layers)
            return stages, max(
                self.tick(j, s, s + k, cap)
                for j, (s, k) in enumerate(zip(stages.boundaries, layers))
            )
        # ticks[j, k, i]: stage j holding layers k..i-1; infinite unless 1 <= i - k <= cap
        k, i = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
        ticks = (
            self.per_flop[:, None, None] * (self.flops[i] - self.flops[k])
            + self.per_out_byte[:, None, None] * (self.outs[i] - self.outs[k])
            + (self.per_row[:, None, None] * cap * self.row_bytes + self.send)
        )
        ticks = np.where((i - k >= 1) & (i - k <= cap), ticks, np.inf)
        best = np.full((p, n + 1), np.inf)  # best[j, i]: slowest tick of stages 0..j on layers < i
        back = np.zeros((p, n + 1), dtype=np.int64)
        best[0] = ticks[0, 0]
        for j in range(1, p):
            options = np.maximum(best[j - 1][:, None], ticks[j])  # [k, i]
            back[j] = np.argmin(options, axis=0)
            best[j] = options[back[j], np.arange(n + 1)]
        if not np.isfinite(best[p - 1, n]):
            return None
        cuts, i = [n], n
        for j in range(p - 1, 0, -1):
            i = int(back[j, i])
            cuts.append(i)
        cuts.append(0)
        cuts.reverse()
        return Stages(tuple(b - a for a, b in itertools.pairwise(cuts))), float(best[p - 1, n])


class _Search:
    """Enumerates layouts, keeps those that fit and counts the others by the rule they break."""

    def __init__(self, model, global_batch, objective, even_stages, max_microbatches, floor):
        self.model, self.global_batch = model, global_batch
        self.objective, self.even_stages, self.max_microbatches = (
            objective,
            even_stages,
            max_microbatches,
        )
        self.floor = floor
        self.found: list[Candidate] = []
        self.rejected: dict[str, list] = {}
        self.evaluated = 0

    def reject(self, rule: str, example: str) -> None:
        entry = self.rejected.setdefault(rule, [0, example])
        entry[0] += 1

    def why(self) -> tuple[tuple[str, int, str], ...]:
        return tuple((rule, n, ex) for rule, (n, ex) in self.rejected.items())

    def choice(self, cluster: Cluster, top: int, tic: float) -> Choice:
        """The candidates found, ranked; ``PlanError`` naming every rejection when none fits."""
        if not self.found:
            raise PlanError(
                f"no parallel config of {self.model.name!r} fits {cluster} with global batch "
                f"{self.global_batch}: "
                + "; ".join(f"{n} x {rule} (e.g. {ex})" for rule, n, ex in self.why())
            )
        ranked = sorted(self.found, key=lambda c: (c.score(self.objective), max(c.memory)))
        return Choice(
            best=ranked[0],
            top=tuple(ranked[:top]),
            rejected=self.why(),
            objective=self.objective,
            cluster=str(cluster),
            evaluated=self.evaluated,
            seconds=time.perf_counter() - tic,
        )

    def run(self, cluster: Cluster, devices: tuple[int, ...], only) -> None:
        model, batch = self.model, self.global_batch
        devs = _Devices.of(cluster, devices)
        n, layers = len(devices), model.num_layers
        for config in _configs(n):
            if only is not None and config not in only:
                continue
            broken = next(
                (
                    (axis, dim, size)
                    for axis, dim, size in model.divides
                    if size % getattr(config, axis)
                ),
                None,
            )
            if broken:
                axis, dim, size = broken
                self.reject(
                    f"{axis} size must divide the model's {dim}",
                    f"{config}: {axis}={getattr(config, axis)} does not divide {dim}={size}",
                )
                continue
            if config.pipe > layers:
                self.reject(
                    "at most one pipeline stage per layer",
                    f"{config}: {config.pipe} stages for {layers} layers",
                )
                continue
            if self.even_stages and layers % config.pipe:
                self.reject(
                    "even stages only: pipe must divide the layers",
                    f"{config}: {layers} layers over {config.pipe} stages",
                )
                continue
            replicas = config.data * config.fsdp
            if batch < replicas:
                self.reject(
                    "every data * fsdp replica needs at least one sample",
                    f"{config}: batch {batch} over {replicas} replicas",
                )
                continue
            per_replica = -(-batch // replicas)  # an uneven split is padded (BatchLayout)
            counts = [1] if config.pipe == 1 else _divisors(per_replica)
            for micro in (m for m in counts if m <= self.max_microbatches):
                self._evaluate(devs, config, micro)

    def _evaluate(self, devs: _Devices, config: ParallelConfig, micro: int) -> None:
        facts = _Facts.of(devs, self.model, self.global_batch, config, micro)
        layers, p = self.model.num_layers, config.pipe
        slot_counts = (
            [layers // p] if self.even_stages else range(math.ceil(layers / p), layers - p + 2)
        )
        best = None
        for slots in slot_counts:
            self.evaluated += 1
            memory, limit = facts.memory(slots), facts.memory_limit
            if np.any(memory > limit):
                if best is None:
                    worst = int(np.argmax(memory - limit))
                    self.reject(
                        "peak memory must fit the smallest device of each stage",
                        f"{config} mb={micro}: {memory[worst] / GIB:.2f} GiB > "
                        f"{limit[worst] / GIB:.2f} GiB on stage {worst}",
                    )
                break  # more slots only need more memory
            split = facts.best_split(slots)
            if split is None:
                continue
            candidate = facts.candidate(split[0])
            if best is None or candidate.score(self.objective) < best.score(self.objective):
                best = candidate
            if facts.uniform():
                break  # more slots cannot help identical stages
        if best is None:
            return
        if best.throughput < self.floor:
            self.reject(
                "throughput must reach the floor",
                f"{best.label()}: {best.throughput:.1f} < {self.floor:g} samples/s",
            )
            return
        self.found.append(best)


@dataclasses.dataclass(frozen=True)
class _Devices:
    """A device set in mesh order, as arrays: fastest first (stage 0), then by node and index, so
    that stage groups share a type."""

    ids: tuple[int, ...]  # cluster device indices
    flops: np.ndarray
    link: np.ndarray
    memory: np.ndarray
    nodes: np.ndarray
    network: float
    usd_per_hour: float

    @classmethod
    def of(cls, cluster: Cluster, devices: Iterable[int] | None = None) -> _Devices:
        devices = range(cluster.num_devices) if devices is None else devices
        kinds = np.array([cluster.kinds[i] for i in devices])
        ids = np.array(list(devices))
        nodes = np.array(cluster.nodes)[ids]
        flops = np.array([t.flops for t in cluster.types])[kinds]
        order = np.lexsort((ids, nodes, -flops))
        kinds, ids = kinds[order], ids[order]
        pick = lambda field: np.array([getattr(t, field) for t in cluster.types])[kinds]
        return cls(
            tuple(int(i) for i in ids),
            pick("flops"),
            pick("link_bandwidth"),
            pick("memory"),
            nodes[order],
            cluster.network_bandwidth,
            float(pick("usd_per_hour").sum()),
        )


def _configs(n: int) -> list[ParallelConfig]:
    out = []
    for pipe in _divisors(n):
        for tensor in _divisors(n // pipe):
            for fsdp in _divisors(n // (pipe * tensor)):
                data = n // (pipe * tensor * fsdp)
                out.append(ParallelConfig(data=data, fsdp=fsdp, tensor=tensor, pipe=pipe))
    return out


def _subsets(cluster: Cluster) -> list[tuple[int, ...]]:
    """Device subsets for the cost objective: per type 0, powers of two, or all of its devices."""
    by_type = [
        [i for i, k in enumerate(cluster.kinds) if k == t] for t in range(len(cluster.types))
    ]
    by_type = [ids for ids in by_type if ids]
    options = []
    for ids in by_type:
        counts = {0, len(ids)} | {2**e for e in range(len(ids).bit_length()) if 2**e <= len(ids)}
        options.append(sorted(counts))
    subsets = []
    for counts in itertools.product(*options):
        if sum(counts):
            subsets.append(tuple(sorted(i for ids, c in zip(by_type, counts) for i in ids[:c])))
    return subsets


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
