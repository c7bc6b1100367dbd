"""Replaying a resource trace on a described cluster, without devices: three policies side by side.

For each event of the trace (scaled to the cluster by :func:`scale`), the job's devices change as
``tj.ElasticJob`` changes them; the planner picks the new layout (:meth:`Simulation.layout`), the
change is planned on the PTCs of the model's abstract state over cluster device ids and priced
per :class:`Policy` (:meth:`Simulation.event`), and each policy's clock (:class:`_Clock`) keeps
when the job trains, stalls and loses work. ``docs/simulator.md`` states the policies and rules.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

from tenplex_jax._src.elastic.events import devices_after
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent
from tenplex_jax._src.errors import LayoutError, PlanError
from tenplex_jax._src.plan import Plan, allocate, make_plan
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.growth import Growth, growth
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, choose
from tenplex_jax._src.ptc import PTC
from tenplex_jax._src.simulator import network as net
from tenplex_jax._src.simulator.costs import (
    Blocking,
    Costs,
    Policy,
    assumptions,
    checkpoint_interval,
)
from tenplex_jax._src.simulator.results import (
    NO_CHANGE,
    EventResult,
    Outcome,
    PolicyCost,
    PolicySummary,
    SimulationResult,
    TimelinePoint,
)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job's layout on a set of devices (what :meth:`Simulation.layout` returns).

    Attributes:
      devices: the cluster device ids the job holds, sorted (some may be left unused).
      candidate: the planner's :class:`tenplex_jax.planner.Candidate` for them.
      ptc: the state's PTC over the cluster device ids it uses (``hosts``: node ids).
    """

    devices: tuple[int, ...]  # cluster device ids, sorted
    candidate: Candidate
    ptc: PTC

    @property
    def step_seconds(self) -> float:
        """The planner's estimated seconds per training step."""
        return self.candidate.step_time

    @property
    def throughput(self) -> float:
        """The planner's estimated samples per second."""
        return self.candidate.throughput


def scale(trace: ResourceTrace, devices: int) -> ResourceTrace:
    """A resource trace scaled to a cluster, up or down, by proportion: with ``r = devices /
    trace.devices``, trace device ``i`` stands for cluster devices ``floor(i*r) ..
    max(floor((i+1)*r), floor(i*r)+1) - 1`` (``i*f .. i*f+f-1`` for a whole ``f = r``; on a
    smaller cluster several trace devices share one), and a count ``c`` becomes ``round(c*r)``
    (halves up), at least 1.

    Args:
      trace: the :class:`tenplex_jax.elastic.ResourceTrace`.
      devices: the cluster's device count, at least 1.

    Returns:
      The trace over ``devices`` devices: event counts scaled, device ids mapped.

    Raises:
      LayoutError: ``devices`` is below 1.
    """
    if devices < 1:
        raise LayoutError(f"a trace scales to a cluster of at least 1 device, got {devices}")
    n = trace.devices

    def ids(d: int) -> range:  # integer arithmetic: a whole multiple maps exactly
        lo = d * devices // n
        return range(lo, max((d + 1) * devices // n, lo + 1))

    def count(c: int) -> int:
        return max(1, (2 * c * devices + n) // (2 * n))  # round(c * r), halves up

    def mapped(e: TraceEvent) -> TraceEvent:
        if e.devices is not None:
            return dataclasses.replace(
                e, devices=tuple(sorted({i for d in e.devices for i in ids(d)}))
            )
        return dataclasses.replace(e, count=None if e.count is None else count(e.count))

    events = tuple(map(mapped, trace.events))
    return dataclasses.replace(trace, devices=devices, events=events)


_NO_DEVICE = "(no device)"  # a row's config while the job holds no device


def _devices_after(
    e: TraceEvent, held: tuple[int, ...], devices: int, failed: set[int]
) -> tuple[tuple[int, ...], set[int]]:
    """The devices the job holds after ``e`` (sorted) and those ``e`` takes away, by
    ``ElasticJob``'s rule (``devices_after``): a preemption or failure takes the ids it names or
    the job's highest, used or not, maybe all; an offer adds those offered that are not failed; a
    redeploy moves onto its live devices."""
    if e.kind in ("preempt", "fail"):
        gone = set(e.devices) if e.devices is not None else set(sorted(held)[-e.count :])
        return tuple(sorted(set(held) - gone)), gone
    if e.kind == "redeploy":
        return tuple(sorted(set(e.devices) - failed)), set()
    offered = devices_after("offer", held, e.devices, e.count, usable=range(devices), failed=failed)
    return offered, set()


def _resume_at(events, devices: int, failed: set[int], at, end: float) -> float:
    """When a job that holds no device gets some back: the time of the first of ``events`` that
    gives it a live one (it takes any: some training beats none), else ``end``."""
    failed = set(failed)
    for e in events:
        if e.kind == "offer" and e.devices is not None:
            failed -= set(e.devices)
        got, gone = _devices_after(e, (), devices, failed)
        if e.kind == "fail":
            failed |= gone
        if got:
            return at(e.step)
    return end


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedChange:
    """One change priced under every policy: what :meth:`Simulation.event` returns.

    Attributes:
      plan: the :class:`tenplex_jax.typing.Plan` from the old layout's PTC to the target's.
      target: the new :class:`Layout`, its device order re-allocated to keep the most bytes.
      plan_seconds: how long planning took.
      policies: every :class:`Policy`'s :class:`PolicyCost`.
    """

    plan: Plan
    target: Layout
    plan_seconds: float
    policies: Mapping[Policy, PolicyCost]


class Simulation:
    """One model on one cluster: layouts per device set, and each event's costs per policy.

    What :func:`simulate` replays a trace on; no devices are used. Example::

        sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=1024)
        result = tj.simulator.simulate(sim, tj.elastic.ResourceTrace.load("meshes/philly.toml"))

    Args:
      cluster: the :class:`tenplex_jax.planner.Cluster`.
      profile: the model's :class:`tenplex_jax.planner.ModelProfile`.
      abstract_state: the train state, abstract (``nnx.eval_shape``): its PTCs are planned over
        cluster device ids.
      rules: its logical-axis rules.
      global_batch: samples per step.
      costs: the :class:`Costs` the network model does not derive.

    Attributes:
      network: the cluster's :class:`Network` (with the fixed costs and store rates of
        ``costs``).
    """

    def __init__(
        self,
        cluster: Cluster,
        profile: ModelProfile,
        abstract_state,
        rules,
        global_batch: int,
        costs: Costs = Costs(),
    ):
        self.cluster, self.profile, self.global_batch = cluster, profile, global_batch
        self.costs = costs
        self.network = net.Network(cluster, **costs.network_costs())
        self.state, self.rules = abstract_state, rules
        self._base: PTC | None = None
        self._objects: tuple[PTC, list] | None = None  # the last layout's stored objects
        self._layouts: dict[tuple[int, ...], Layout] = {}  # a trace comes back to device sets

    def _stored(self, ptc: PTC) -> list:
        """The objects a commit of ``ptc`` writes (the last one asked for is kept: each layout is
        asked for as a target, then as the next change's source)."""
        if self._objects is None or self._objects[0] is not ptc:
            self._objects = (ptc, net.stored(ptc, self.costs.replicas))
        return self._objects[1]

    def layout(self, devices: Sequence[int]) -> Layout:
        """The job's layout on some devices: the planner's fastest config of equal stages that
        lays the state out on them, or, when none does (a device count with a large prime
        factor, or more devices than the batch or the model's dims split over), on as many of
        them as can be used: fewer devices of the last node, then whole nodes dropped from the
        highest ids, down to half.

        Args:
          devices: the cluster device ids the job holds.

        Returns:
          The :class:`Layout`.

        Raises:
          PlanError: the model fits none of them (naming the model, cluster and device count).
        """
        devices = tuple(sorted(devices))
        if not devices:
            raise PlanError(f"a layout of {self.profile.name!r} needs at least one device")
        if devices in self._layouts:
            return self._layouts[devices]
        refused = []
        for used in self._subsets(devices):
            try:
                self._layouts[devices] = self._layout(used)
                return self._layouts[devices]
            except PlanError as error:
                refused.append(f"{len(used)} devices: {str(error)[:300]}")
        reasons = "; ".join(refused[:3]).replace("\n", " ")
        raise PlanError(
            f"no layout of {self.profile.name!r} fits {len(devices)} devices of "
            f"{self.cluster.name!r} or fewer of them down to half (fewer devices of the last "
            f"node, whole nodes from the highest ids): {reasons}"
        )

    def _subsets(self, devices: tuple[int, ...]):
        """The device sets :meth:`layout` tries, largest first, none below half of the devices
        or of the nodes (a prime count on one node has no other layout than fewer devices)."""
        node = self.cluster.nodes
        nodes = sorted({node[d] for d in devices})
        yield devices
        last = sum(node[d] == nodes[-1] for d in devices)  # devices of the last node
        for m in range(len(devices) - 1, max(len(devices) - last, (len(devices) + 1) // 2 - 1), -1):
            yield devices[:m]
        for k in range(len(nodes) - 1, len(nodes) // 2 - 1, -1):
            keep = set(nodes[:k])
            yield tuple(d for d in devices if node[d] in keep)

    def _layout(self, devices: tuple[int, ...]) -> Layout:
        choice = choose(
            self.cluster.subset(devices), self.profile, self.global_batch, even_stages=True, top=16
        )
        errors = []
        for candidate in choice.top:
            try:
                return Layout(
                    devices=devices, candidate=candidate, ptc=self._ptc(candidate, devices)
                )
            except LayoutError as error:
                errors.append(str(error))
        raise PlanError(
            f"none of the planner's {len(choice.top)} best configs for {len(devices)} devices lays "
            f"the state out: " + "; ".join(errors[:3])
        )

    def _ptc(self, candidate: Candidate, devices: tuple[int, ...]) -> PTC:
        """The state's PTC as ``candidate`` lays it out on ``devices`` (which its ``devices``
        index), ``hosts`` the nodes: one PTC of the state relaid out for every layout."""
        ids = tuple(devices[i] for i in candidate.devices)
        hosts = [self.cluster.nodes[d] for d in ids]
        if self._base is None:
            self._base = PTC.of(self.state, self.rules, candidate.config, ids, hosts=hosts)
            return self._base
        return self._base.relayout(candidate.config, ids, hosts=hosts)

    def event(self, kind: str, old: Layout, new: Layout, failed_nodes: frozenset) -> PlannedChange:
        """The change from ``old`` to ``new`` priced under every policy (:class:`Costs` says
        what each is charged beyond its bytes).

        Args:
          kind: the trace event's kind (``"fail"`` has no notice: nothing is committed or saved
            first); ``"preempt"``, ``"offer"``, ``"redeploy"`` come with notice.
          old: the layout before.
          new: the layout after (its device order is re-allocated to keep the most bytes).
          failed_nodes: the nodes whose stores are gone.

        Returns:
          The :class:`PlannedChange`: the plan, the target layout and every policy's cost.
        """
        tic = time.perf_counter()
        target = dataclasses.replace(new, ptc=allocate(old.ptc, new.ptc))
        plan = make_plan(old.ptc, target.ptc)
        plan_seconds = time.perf_counter() - tic
        objects, network = self._stored(old.ptc), self.network
        notice = kind != "fail"
        commit = network.seconds(net.commit_traffic(objects, network)) if notice else None
        save = network.seconds(net.save_traffic(objects, network)) if notice else None
        restore = network.seconds(net.restore_traffic(target.ptc, network))
        reads = net.pulls(plan, network, net.holders(objects), failed_nodes)
        policies = {
            p: self._pulled(p, kind, plan, reads, commit, restore)
            for p in (Policy.TENPLEX, Policy.CENTRAL)
        }
        policies[Policy.CHECKPOINT_RESTART] = PolicyCost(
            save=save.seconds if save else 0.0,
            restore=restore.seconds,
            bottleneck=restore.bottleneck,
            latency=restore.latency + (save.latency if save else 0.0),
            **self._fixed(Policy.CHECKPOINT_RESTART, kind),
        )
        return PlannedChange(plan=plan, target=target, plan_seconds=plan_seconds, policies=policies)

    def _fixed(self, policy: Policy, kind: str) -> dict:
        """What a change costs ``policy`` beyond its bytes: detection, restart and compile."""
        c, ahead = self.costs, self.costs.compiled_ahead(kind)
        return {
            "detect": 0.0 if kind != "fail" else c.detect_seconds,
            "restart": c.restart(policy),
            "compile": 0.0 if ahead else c.compile(policy),
            "compiled_ahead": ahead,
        }

    def _pulled(self, policy: Policy, kind: str, plan, reads, commit, restore) -> PolicyCost:
        """Tenplex's or central's cost: the last step committed first (with notice),
        then the pulls from the stores, or, where some box is in no live store, the orbax tier:
        the checkpoint onto the new layout, no pulls."""
        central = policy == Policy.CENTRAL  # Tenplex-Central's node: the target's first
        via = self.network.node_of(plan.dst.device_ids[0]) if central else None
        traffic = net.store_traffic(reads, self.network, via=via)
        if traffic.lost:
            moved = {"restore": restore.seconds, "latency": restore.latency}
            moved["bottleneck"] = restore.bottleneck
        else:
            pull = self.network.seconds(traffic)
            latency = pull.latency + (commit.latency if commit else 0.0)
            moved = {"transfer": pull.seconds, "bottleneck": pull.bottleneck, "latency": latency}
        return PolicyCost(
            commit=commit.seconds if commit else 0.0,
            network_bytes=traffic.network_bytes,
            fallback=bool(traffic.lost),
            lost_leaves=tuple(sorted({path for path, _ in traffic.lost})),
            **moved,
            **self._fixed(policy, kind),
        )

    def blocking(self, layout: Layout) -> Blocking:
        """What ``layout``'s periodic commits and checkpoints cost training: a
        :class:`~tenplex_jax._src.simulator.costs.Blocking`."""
        save = self.network.seconds(net.save_traffic(self._stored(layout.ptc), self.network))
        return Blocking(copy=save.resources["d2h"], save=save.seconds)


def simulate(
    sim: Simulation, trace: ResourceTrace, policies: Sequence[str] = tuple(Policy), log=None
) -> SimulationResult:
    """Replay ``trace`` (scaled to the cluster) on ``sim``: a row per event and each policy's
    goodput over the whole trace (see the module docstring). ``tenplex-jax simulate`` is its
    command line; :class:`Simulation` has an example.

    Args:
      sim: the :class:`Simulation` (model, cluster, costs).
      trace: the :class:`tenplex_jax.elastic.ResourceTrace`; it is scaled to the cluster with
        :func:`scale`.
      policies: the :class:`Policy` values to compare (default: all).
      log: called with one line of text per event (default: silent).

    Returns:
      The :class:`SimulationResult`: an :class:`EventResult` per event, each policy's
      :class:`PolicySummary` and timeline, and what it ran with.

    Raises:
      PlanError: an unknown policy, or the model fits no layout on the devices the job holds at
        the start or after some event (the message names the model, cluster, device count and
        event).
    """
    replay = _Replay(sim, scale(trace, sim.cluster.num_devices), Policy.parse(policies))
    rows = []
    for number, e in enumerate(replay.trace.events):
        rows.append(replay.event(number, e))
        if log is not None:
            log(_line(rows[-1]))
    return replay.result(tuple(rows))


class _Replay:
    """One replay's state as it goes: the job's devices and layout, the failed devices, and
    each policy's :class:`_Clock`; :meth:`event` is one step."""

    def __init__(self, sim: Simulation, trace: ResourceTrace, policies: tuple[Policy, ...]):
        self.start = time.perf_counter()
        self.sim, self.trace = sim, trace
        self.layout = self.initial = sim.layout(range(trace.devices))
        self.minutes = trace.minutes or trace.steps * self.layout.step_seconds / 60
        self.end = self.minutes * 60
        blocking, costs = sim.blocking(self.layout), sim.costs
        self.checkpoint = checkpoint_interval(costs, trace, self.minutes, blocking, trace.devices)
        period = self.checkpoint.minutes * 60
        self.clocks = {
            p: _Clock(p, self.layout, blocking, costs.commit_every, period) for p in policies
        }
        self.failed: set[int] = set()
        self.held = tuple(range(trace.devices))  # the devices the job has (some may be unused)
        self.emptied = ""  # while the job holds no device: the kind of the event that took them

    def at(self, step: int) -> float:
        """The wall-clock second of a trace step."""
        return step / self.trace.steps * self.minutes * 60

    def event(self, number: int, e: TraceEvent) -> EventResult:
        """Apply the trace's event ``number``: the job's devices change, then it waits, resumes,
        keeps its layout or changes it (each policy's clock pays), and the row says which."""
        tic, t = time.perf_counter(), self.at(e.step)
        if e.kind == "offer" and e.devices is not None:  # failed devices offered by id: repaired
            self.failed -= set(e.devices)
        devices, gone = _devices_after(e, self.held, self.trace.devices, self.failed)
        if e.kind == "fail":
            self.failed |= gone
        layout, held = self.layout, bool(self.held)
        before = {
            "devices_before": len(self.held),
            "used_before": len(layout.devices) if held else 0,
            "config_before": layout.candidate.label() if held else _NO_DEVICE,
            "step_seconds_before": layout.step_seconds if held else None,
        }
        if not devices:  # nothing left to train on: the job waits
            after = self._wait(number, e.kind, t)
        elif not held:  # devices back after a wait: from the last layout's stores or checkpoint
            after = self._resume(e, devices, t)
        elif set(devices) == set(self.held) or (
            e.kind in ("preempt", "fail") and set(layout.devices) <= set(devices)
        ):  # nothing new, or only devices the job left idle went: the layout stays
            after = self._kept(Outcome.KEEP, layout)
        else:
            after = self._change(e, devices, t)
        self.held = devices
        return EventResult(
            event=number,
            minute=t / 60,
            kind=e.kind,
            devices_after=len(devices),
            state_bytes=layout.ptc.nbytes,
            **before,
            **after,
            simulate_seconds=time.perf_counter() - tic,
        )

    def _failed_nodes(self) -> frozenset[int]:  # the nodes whose stores are gone
        return frozenset(self.sim.cluster.nodes[d] for d in self.failed)

    def _layout_after(self, e: TraceEvent, devices) -> Layout:
        """``sim.layout(devices)``; a refusal names the event that left the job those devices."""
        try:
            return self.sim.layout(devices)
        except PlanError as error:
            where = f"trace {self.trace.name!r}, {e.kind} at step {e.step}"
            raise PlanError(f"{where}: {error}") from None

    def _kept(self, decision: Outcome, layout: Layout | None, policies=None) -> dict:
        """A row's fields after an event that plans nothing: the layout stays, or there is none."""
        return {
            "used_after": len(layout.devices) if layout else 0,
            "config_after": layout.candidate.label() if layout else _NO_DEVICE,
            "step_seconds_after": layout.step_seconds if layout else None,
            "decision": decision,
            "policies": policies or dict.fromkeys(self.clocks, NO_CHANGE),
        }

    def _changed(self, change: PlannedChange, decision: Outcome, policies, **extra) -> dict:
        """A row's fields after an event that planned ``change``."""
        plan, kept = change.plan, self._kept(decision, change.target, policies)
        moved = {"bytes_moved": plan.bytes_moved, "bytes_kept": plan.bytes_kept}
        return kept | extra | moved | {"plan_seconds": change.plan_seconds}

    def _wait(self, number: int, kind: str, t: float) -> dict:
        """The job holds no device after the event. If it held some, each policy stalls until
        a later event gives it a live one (:func:`_resume_at`); a failure also loses work: since
        the last commit while the layout's stores live, else (and always for checkpoint-restart)
        since the last checkpoint."""
        if not self.held:
            return self._kept(Outcome.WAIT, None)
        rest = self.trace.events[number + 1 :]
        resume = _resume_at(rest, self.trace.devices, self.failed, self.at, self.end)
        held_by = net.holders(self.sim._stored(self.layout.ptc))
        failed = self._failed_nodes()
        stores_lost = kind == "fail" and any(set(n) <= failed for n in held_by.values())
        idle = dataclasses.replace(self.layout, devices=())  # the clock shows no device
        blocking = self.sim.blocking(self.layout)
        policies = {}
        for p, clock in self.clocks.items():
            cost = PolicyCost(wait=max(resume - max(t, clock.ready), 0.0), fallback=stores_lost)
            lost = clock.change(t, cost, kind, idle, blocking)
            policies[p] = dataclasses.replace(cost, lost_seconds=lost)
        self.emptied = kind
        return self._kept(Outcome.WAIT, None, policies)

    def _resume(self, e: TraceEvent, devices, t: float) -> dict:
        """Devices back after a wait: a change from the last layout (from its stores, or from the
        checkpoint where a failure took them)."""
        new = self._layout_after(e, devices)
        kind = self.emptied if self.emptied == "fail" else e.kind
        change = self.sim.event(kind, self.layout, new, self._failed_nodes())
        self.emptied = ""
        return self._apply(change, e.kind, t, Outcome.RESUME)

    def _change(self, e: TraceEvent, devices, t: float) -> dict:
        """A new layout on the devices the job holds now; an offer is taken only when the
        growth rule says the gain outweighs the cost (declined, its devices stay, idle)."""
        new = self._layout_after(e, devices)
        change = self.sim.event(e.kind, self.layout, new, self._failed_nodes())
        if e.kind != "offer":
            return self._apply(change, e.kind, t, Outcome.CHANGE)
        rule = self._growth(change, e.kind, t)
        if rule.grow:
            return self._apply(change, e.kind, t, Outcome.GROW, growth=rule)
        return self._changed(change, Outcome.STAY, None, growth=rule)

    def _growth(self, change: PlannedChange, kind: str, t: float) -> Growth:
        """The growth rule on tenplex's numbers for ``change`` at ``t``."""
        tenplex, now, costs = change.policies[Policy.TENPLEX], self.layout, self.sim.costs
        moving = tenplex.transfer + tenplex.commit + tenplex.restore
        moved = change.plan.bytes_moved  # none (every piece stays on its device): no transfer
        return growth(
            step_seconds_now=now.step_seconds,
            step_seconds_new=change.target.step_seconds,
            remaining_steps=int(max(self.end - t, 0) / now.step_seconds),
            bytes_moved=moved,
            bandwidth=moved / moving if moving and moved else math.inf,
            compile_seconds=costs.compile(Policy.TENPLEX),
            compiled_ahead=costs.compiled_ahead(kind),
            source="planner",
            restart_seconds=costs.restart(Policy.TENPLEX),
        )

    def _apply(self, change: PlannedChange, kind: str, t: float, decision, **extra) -> dict:
        """Each policy's clock makes ``change`` at ``t``; the job's layout is its target."""
        blocking = self.sim.blocking(change.target)
        policies = {}
        for p, clock in self.clocks.items():
            lost = clock.change(t, change.policies[p], kind, change.target, blocking)
            policies[p] = dataclasses.replace(change.policies[p], lost_seconds=lost)
        self.layout = change.target
        return self._changed(change, decision, policies, **extra)

    def result(self, rows: tuple[EventResult, ...]) -> SimulationResult:
        """The replay's result once every event is in ``rows``."""
        sim, policies = self.sim, tuple(self.clocks)
        summaries = {p: clock.finish(self.end) for p, clock in self.clocks.items()}
        return SimulationResult(
            cluster=str(sim.cluster),
            model=sim.profile.name,
            global_batch=sim.global_batch,
            trace=self.trace.name,
            minutes=self.minutes,
            checkpoint=self.checkpoint,
            costs=sim.costs,
            initial_config=self.initial.candidate.label(),
            assumptions={p: assumptions(sim.costs, p, self.checkpoint) for p in policies},
            events=rows,
            policies=summaries,
            timeline={p: tuple(clock.timeline) for p, clock in self.clocks.items()},
            seconds=time.perf_counter() - self.start,
        )


class _Clock:
    """One policy's wall clock over the trace: when the job trains, stalls, and loses work."""

    def __init__(self, policy: Policy, layout: Layout, blocking, commit_every: int, period: float):
        self.layout, self.blocking, self.period = layout, blocking, period
        # checkpoint-restart commits nothing to stores: no commit stops it, a failure loses the
        # work since the checkpoint, and an announced change saves one
        self.checkpoints_only = policy == Policy.CHECKPOINT_RESTART
        self.commit_every = 0 if self.checkpoints_only else commit_every
        self.ready = 0.0  # when the job trains again after its last change
        self.saved = 0.0  # the last save at a change (periodic checkpoints: multiples of period)
        self.segments: list[tuple[float, float, float, float]] = []  # (start, end, rate, samples/s)
        self.stalled = self.lost = 0.0
        self.timeline = [TimelinePoint(0.0, len(layout.devices), 0.0)]

    def _train(self, until: float) -> None:
        """Train from ``ready`` to ``until``; periodic commits and checkpoints stop it for their
        device-to-host copies, so a second of it is worth ``rate`` seconds of training."""
        if until > self.ready:
            self.segments.append((self.ready, until, self._rate(), self.layout.throughput))

    def _rate(self) -> float:
        overhead = self.blocking.copy / self.period
        if self.commit_every:
            overhead += self.blocking.copy / (self.commit_every * self.layout.step_seconds)
        return max(1.0 - overhead, 0.0)

    def _since(self, t0: float) -> tuple[float, float]:
        """Training seconds and samples of the segments after ``t0``."""
        seconds = sum(max(0.0, e - max(s, t0)) * r for s, e, r, _ in self.segments)
        samples = sum(max(0.0, e - max(s, t0)) * r * x for s, e, r, x in self.segments)
        return seconds, samples

    def _discard(self, t0: float, t1: float) -> float:
        """Take the training between wall times ``t0`` and ``t1`` out of the segments (work a
        failure lost, so a later failure cannot lose it again); its seconds."""
        kept, seconds = [], 0.0
        for s, e, r, x in self.segments:
            lo, hi = max(s, t0), min(e, t1)
            if hi <= lo:
                kept.append((s, e, r, x))
                continue
            seconds += (hi - lo) * r
            kept += [(s, lo, r, x)] * (s < lo) + [(hi, e, r, x)] * (hi < e)
        self.segments = kept
        return seconds

    def change(self, t: float, cost: PolicyCost, kind: str, new: Layout, blocking) -> float:
        """Apply a change at ``t``; the seconds of training it loses."""
        self._train(t)
        lost = 0.0
        if kind == "fail":
            checkpoint = max(self.saved, math.floor(t / self.period) * self.period)
            if cost.fallback or self.checkpoints_only:  # back to the last checkpoint
                lost = self._discard(checkpoint, t)
            else:  # back to the last commit (every commit_every steps since the last change),
                # or to the last checkpoint where it is newer
                wall = max(t - self.ready, 0.0)
                since = wall % (self.commit_every * self.layout.step_seconds)
                lost = self._discard(max(t - since, checkpoint), t)
        elif self.checkpoints_only:
            self.saved = t
        self.lost += lost
        self.stalled += cost.seconds
        self.ready = max(t, self.ready) + cost.seconds
        self.layout, self.blocking = new, blocking
        self.timeline.append(TimelinePoint(t / 60, len(new.devices), self._since(0.0)[0]))
        return lost

    def finish(self, end: float) -> PolicySummary:
        self._train(end)
        productive, samples = self._since(0.0)  # lost work is out of the segments already
        self.timeline.append(TimelinePoint(end / 60, len(self.layout.devices), productive))
        return PolicySummary(
            goodput=productive / end,
            useful_samples=samples,
            stall_seconds=self.stalled,
            lost_seconds=self.lost,
            productive_seconds=productive,
            wall_seconds=end,
        )


def _line(row: EventResult) -> str:
    costs = "  ".join(f"{p} {c.seconds:7.1f} s" for p, c in row.policies.items())
    return (
        f"  {row.minute:6.1f} min {row.kind:8s} {row.devices_before:5d} -> "
        f"{row.devices_after:5d} {row.decision:6s} moved "
        f"{row.bytes_moved / 1e9:9.1f} GB  {costs}  ({row.simulate_seconds:.2f} s)"
    )
