"""Replaying a resource trace on a described cluster, without devices: three policies side by side.

For each event of the trace (scaled to the cluster: trace device ``i`` stands for cluster devices
``i*f .. i*f+f-1``), the job's devices change as ``tj.ElasticJob`` changes them
(``tenplex_jax._src.elastic.events.devices_after``); the planner (``tj.planner.choose``, equal
stages)
picks the new config; ``tj.allocate`` and ``tj.make_plan`` plan the change on the PTCs of the
model's abstract state over cluster device ids (``hosts`` = node ids); the network model
(:mod:`tenplex_jax._src.simulator.network`) turns each policy's bytes into seconds:

- **tenplex**: the state lives in host-memory tensor stores (a commit every ``commit_every`` steps,
  ``replicas`` copies on the next nodes); a change is a new generation of processes that pull the
  plan's pieces from the stores (:func:`~tenplex_jax._src.simulator.network.store_traffic`). A
  notice
  (preempt, offer, redeploy) first commits the last step; a failure loses the steps since the last
  commit. Announced layouts are compiled ahead (``job.expect``); a failure compiles on demand.
  Where a failure leaves some box in no live store, the **orbax fallback**: the checkpoint is
  restored and the work since it is lost.
- **central**: the same, every byte through one node (Tenplex-Central).
- **checkpoint-restart**: save to remote storage (with notice), restart, restore, compile; a
  failure loses the work since the last periodic checkpoint.

Every policy restarts processes (``restart_seconds``) at every change, trains the same layouts
(the growth decision is tenplex's, by ``tenplex_jax._src.planner.growth`` with the network
model's transfer time), and pays the blocking part of its periodic commits or checkpoints (the
device-to-host copy; the rest overlaps training). Goodput is the fraction of wall time spent on
training that is kept; useful samples weigh it by each layout's throughput.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from tenplex_jax._src.elastic.events import devices_after
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent
from tenplex_jax._src.errors import LayoutError, PlanError
from tenplex_jax._src.plan import allocate, make_plan
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.growth import growth
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, choose
from tenplex_jax._src.ptc import PTC
from tenplex_jax._src.simulator import network as net
from tenplex_jax._src.simulator.costs import POLICIES, Costs


@dataclasses.dataclass(frozen=True)
class Layout:
    """The job's layout on a set of devices: the planner's candidate and the state's PTC.

    What :meth:`Simulation.layout` returns.

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
    """A resource trace scaled to a cluster: trace device ``i`` stands for cluster devices
    ``i*f .. i*f+f-1`` with ``f = devices / trace.devices``.

    Args:
      trace: the :class:`tenplex_jax.elastic.ResourceTrace`.
      devices: the cluster's device count, a multiple of ``trace.devices``.

    Returns:
      The trace over ``devices`` devices: event counts multiplied by ``f``, device ids expanded.

    Raises:
      LayoutError: ``devices`` is not a multiple of the trace's.
    """
    if devices % trace.devices:
        raise LayoutError(
            f"trace {trace.name!r} of {trace.devices} devices scales to a multiple of them; the "
            f"cluster has {devices}"
        )
    f = devices // trace.devices
    events = tuple(
        TraceEvent(
            e.step,
            e.kind,
            None if e.devices is None else tuple(d * f + i for d in e.devices for i in range(f)),
            None if e.count is None else e.count * f,
        )
        for e in trace.events
    )
    return dataclasses.replace(trace, devices=devices, events=events)


class Simulation:
    """One model on one cluster: layouts per device set, and each event's costs per policy.

    What :func:`simulate` replays a trace on; no devices are used (see the module docstring).
    Example::

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
      network: the cluster's :class:`Network` (with ``costs.piece_seconds``).
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
        self.network = net.Network(cluster, costs.piece_seconds)
        self.state, self.rules = abstract_state, rules
        self._base: PTC | None = None
        self._objects: tuple[PTC, list] | None = None  # the last layout's stored objects

    def _stored(self, ptc: PTC) -> list:
        """The objects a commit of ``ptc`` writes (the last one asked for is kept: each layout is
        asked for as a target, then as the next change's source)."""
        if self._objects is None or self._objects[0] is not ptc:
            self._objects = (ptc, net.stored(ptc, self.costs.replicas))
        return self._objects[1]

    def layout(self, devices: Sequence[int]) -> Layout:
        """The job's layout on some devices: the planner's fastest config of equal stages that
        lays the state out on them, or, when none does (a device count with a large prime
        factor), on as many of them as can be used, dropping whole nodes from the highest ids.

        Args:
          devices: the cluster device ids the job holds.

        Returns:
          The :class:`Layout`.

        Raises:
          PlanError: no layout fits the devices or any subset of whole nodes down to half.
        """
        devices = tuple(sorted(devices))
        refused = []
        for used in self._subsets(devices):
            try:
                return self._layout(used)
            except PlanError as error:
                refused.append(f"{len(used)} devices: {str(error)[:300]}")
        raise PlanError(
            f"no layout of {self.profile.name!r} fits {len(devices)} devices of "
            f"{self.cluster.name!r} or any subset of whole nodes down to half: "
            + "; ".join(refused[:3])
        )

    def _subsets(self, devices: tuple[int, ...]):
        nodes = sorted({self.cluster.nodes[d] for d in devices})
        yield devices
        for k in range(len(nodes) - 1, len(nodes) // 2 - 1, -1):
            keep = set(nodes[:k])
            yield tuple(d for d in devices if self.cluster.nodes[d] in keep)

    def _layout(self, devices: tuple[int, ...]) -> Layout:
        choice = choose(
            self.cluster.subset(devices), self.profile, self.global_batch, even_stages=True, top=16
        )
        errors = []
        for candidate in choice.top:
            ids = tuple(devices[i] for i in candidate.devices)
            hosts = [self.cluster.nodes[d] for d in ids]
            try:
                if self._base is None:
                    self._base = PTC.of(self.state, self.rules, candidate.config, ids, hosts=hosts)
                    ptc = self._base
                else:
                    ptc = self._base.relayout(candidate.config, ids, hosts=hosts)
            except LayoutError as error:
                errors.append(str(error))
                continue
            return Layout(devices, candidate, ptc)
        raise PlanError(
            f"none of the planner's {len(choice.top)} best configs for {len(devices)} devices lays "
            f"the state out: " + "; ".join(errors[:3])
        )

    def seconds(self, traffic: net.Traffic) -> net.Estimate:
        """``network.seconds(traffic)``: how long a transfer takes on the cluster.

        Args:
          traffic: the transfer's :class:`Traffic`.

        Returns:
          Its :class:`Estimate`.
        """
        return self.network.seconds(traffic)

    def event(self, kind: str, old: Layout, new: Layout, failed_nodes: frozenset) -> dict:
        """The change from ``old`` to ``new`` under every policy: seconds and what they are.

        Args:
          kind: the trace event's kind (``"fail"`` has no notice: nothing is committed or saved
            first, and the step is compiled on demand); ``"preempt"``, ``"offer"``,
            ``"redeploy"`` come with notice.
          old: the layout before.
          new: the layout after (its device order is re-allocated to keep the most bytes).
          failed_nodes: the nodes whose stores are gone.

        Returns:
          ``{"plan", "target", "plan_seconds", "policies"}``: the plan, the allocated target
          layout, the planning time, and per policy a dict of its seconds (``"seconds"`` in all,
          and its parts: commit or save, transfer or restore, restart, compile) and whether it
          fell back to the checkpoint.
        """
        c = self.costs
        tic = time.perf_counter()
        target = dataclasses.replace(new, ptc=allocate(old.ptc, new.ptc))
        plan = make_plan(old.ptc, target.ptc)
        plan_seconds = time.perf_counter() - tic
        objects = self._stored(old.ptc)
        reads = net.pulls(plan, self.network, net.holders(objects), failed_nodes)
        notice = kind != "fail"
        compile_s = 0.0 if notice else c.compile_seconds
        out = {"plan": plan, "target": target, "plan_seconds": plan_seconds, "policies": {}}
        commit = self.seconds(net.commit_traffic(objects, self.network)) if notice else None
        restore = self.seconds(net.restore_traffic(target.ptc, self.network))
        for policy, via in (("tenplex", None), ("central", net.central_node(plan, self.network))):
            traffic = net.store_traffic(reads, self.network, via=via)
            pull = self.seconds(traffic)
            row = {
                "commit": commit.seconds if commit else 0.0,
                "transfer": pull.seconds,
                "bottleneck": pull.bottleneck,
                "network_bytes": traffic.network_bytes,
                "restart": c.restart_seconds,
                "compile": compile_s,
                "restore": 0.0,
                "fallback": bool(traffic.lost),
                "lost_leaves": sorted({path for path, _ in traffic.lost}),
            }
            if traffic.lost:  # the orbax tier: the checkpoint onto the new layout, no pulls
                row |= {
                    "transfer": 0.0,
                    "restore": restore.seconds,
                    "bottleneck": restore.bottleneck,
                }
            row["seconds"] = (
                row["commit"] + row["transfer"] + row["restore"] + c.restart_seconds + compile_s
            )
            out["policies"][policy] = row
        save = self.seconds(net.save_traffic(objects, self.network)) if notice else None
        row = {
            "save": save.seconds if save else 0.0,
            "restore": restore.seconds,
            "bottleneck": restore.bottleneck,
            "restart": c.restart_seconds,
            "compile": c.compile_seconds,
            "fallback": False,
        }
        row["seconds"] = row["save"] + row["restore"] + c.restart_seconds + c.compile_seconds
        out["policies"]["checkpoint-restart"] = row
        return out

    def blocking(self, layout: Layout) -> dict[str, float]:
        """Seconds a periodic commit (tenplex, central) and a periodic checkpoint (every policy)
        stop training: the device-to-host copy, which the writes then overlap.

        Args:
          layout: the job's layout.

        Returns:
          ``{"commit": seconds, "checkpoint": seconds}``.
        """
        objects = self._stored(layout.ptc)
        d2h = self.seconds(net.save_traffic(objects, self.network)).resources["d2h"]
        return {"commit": d2h, "checkpoint": d2h}


def simulate(
    sim: Simulation, trace: ResourceTrace, policies: Sequence[str] = POLICIES, log=None
) -> dict:
    """Replay ``trace`` (scaled to the cluster) on ``sim``: per-event rows and, per policy, its
    goodput over the whole trace (see the module docstring).

    Each event changes the job's devices as ``tj.ElasticJob`` would; an offer is taken only when
    the growth rule says the gain outweighs the cost. ``tenplex-jax simulate`` is its command
    line. See :class:`Simulation` for an example.

    Args:
      sim: the :class:`Simulation` (model, cluster, costs).
      trace: the :class:`tenplex_jax.elastic.ResourceTrace`; it is scaled to the cluster with
        :func:`scale`.
      policies: the policies to compare, a subset of ``POLICIES``.
      log: called with one line of text per event (default: silent).

    Returns:
      A JSON-able dict: ``"events"`` (a row per event: devices, configs, bytes moved, the
      growth decision, each policy's seconds and lost seconds), ``"policies"`` (per policy:
      ``goodput``, ``useful_samples``, stall, lost and productive seconds), ``"timeline"``, and
      the cluster, model, trace, minutes and costs it ran with.

    Raises:
      PlanError: an unknown policy, or no layout fits some device set.
      LayoutError: the cluster's device count is not a multiple of the trace's.
    """
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise PlanError(f"policies are {POLICIES}, got {sorted(unknown)}")
    trace = scale(trace, sim.cluster.num_devices)
    start = time.perf_counter()
    layout = sim.layout(range(trace.devices))
    minutes = trace.minutes or trace.steps * layout.step_seconds / 60
    at = lambda step: step / trace.steps * minutes * 60
    end = minutes * 60
    ckpt_minutes = sim.costs.checkpoint_minutes or (
        trace.checkpoint_every / trace.steps * minutes if trace.checkpoint_every else 30.0
    )
    period = ckpt_minutes * 60
    clocks = {
        p: _Clock(layout, sim.blocking(layout), sim.costs.commit_every, period) for p in policies
    }
    failed: set[int] = set()
    held = tuple(range(trace.devices))  # the devices the job has (it may leave some unused)
    rows = []
    for number, e in enumerate(trace.events):
        t = at(e.step)
        devices = devices_after(
            e.kind, held, e.devices, e.count, usable=range(trace.devices), failed=failed
        )
        if e.kind == "fail":
            failed |= set(held) - set(devices)
        failed_nodes = frozenset(sim.cluster.nodes[d] for d in failed)
        tic = time.perf_counter()
        new = sim.layout(devices)
        row = {
            "event": number,
            "minute": t / 60,
            "kind": e.kind,
            "devices_before": len(held),
            "devices_after": len(devices),
            "used_before": len(layout.devices),
            "used_after": len(new.devices),
            "config_before": layout.candidate.label(),
            "config_after": new.candidate.label(),
            "step_seconds_before": layout.step_seconds,
            "step_seconds_after": new.step_seconds,
            "state_bytes": layout.ptc.nbytes,
        }
        result = sim.event(e.kind, layout, new, failed_nodes)
        plan, tenplex = result["plan"], result["policies"]["tenplex"]
        row |= {
            "bytes_moved": plan.bytes_moved,
            "bytes_kept": plan.bytes_kept,
            "plan_seconds": result["plan_seconds"],
        }
        decision = "change"
        if e.kind == "offer":
            moving = tenplex["transfer"] + tenplex["commit"] + tenplex["restore"]
            rule = growth(
                step_seconds_now=layout.step_seconds,
                step_seconds_new=new.step_seconds,
                remaining_steps=int(max(end - t, 0) / layout.step_seconds),
                bytes_moved=plan.bytes_moved,
                bandwidth=plan.bytes_moved / moving if moving else math.inf,
                compile_seconds=sim.costs.compile_seconds,
                compiled_ahead=True,
                source="planner",
                restart_seconds=sim.costs.restart_seconds,
            )
            row["growth"] = rule
            decision = "grow" if rule["grow"] else "stay"
        row["decision"] = decision
        row["policies"] = {}
        if decision == "stay":
            row["policies"] = {p: {"seconds": 0.0} for p in policies}
        else:
            target = result["target"]
            blocking = sim.blocking(target)
            for p in policies:
                cost = dict(result["policies"][p])
                cost["lost_seconds"] = clocks[p].change(t, cost, e.kind, target, blocking)
                row["policies"][p] = cost
            layout, held = target, devices
        row["simulate_seconds"] = time.perf_counter() - tic
        rows.append(row)
        if log is not None:
            log(_line(row, policies))
    summary = {p: clocks[p].finish(end) for p in policies}
    return {
        "cluster": str(sim.cluster),
        "model": sim.profile.name,
        "global_batch": sim.global_batch,
        "trace": trace.name,
        "minutes": minutes,
        "checkpoint_minutes": ckpt_minutes,
        "costs": dataclasses.asdict(sim.costs),
        "initial_config": rows[0]["config_before"] if rows else layout.candidate.label(),
        "events": rows,
        "policies": summary,
        "timeline": {p: clocks[p].timeline for p in policies},
        "seconds": time.perf_counter() - start,
    }


class _Clock:
    """One policy's wall clock over the trace: when the job trains, stalls, and loses work."""

    def __init__(self, layout: Layout, blocking: dict, commit_every: int, period: float):
        self.layout, self.blocking = layout, blocking
        self.commit_every, self.period = commit_every, period
        self.ready = 0.0  # when the job trains again after its last change
        self.saved = 0.0  # the last save at a change (periodic checkpoints: multiples of period)
        self.segments: list[tuple[float, float, float, float]] = []  # (start, end, rate, samples/s)
        self.stalled = self.lost = self.lost_samples = 0.0
        self.timeline = [(0.0, len(layout.devices), 0.0)]  # (minute, devices, productive seconds)

    def _train(self, until: float) -> None:
        """Train from ``ready`` to ``until``; periodic commits and checkpoints stop it for their
        device-to-host copies, so a second of it is worth ``rate`` seconds of training."""
        if until > self.ready:
            self.segments.append((self.ready, until, self._rate(), self.layout.throughput))

    def _rate(self) -> float:
        overhead = self.blocking["checkpoint"] / self.period
        if self.commit_every:
            overhead += self.blocking["commit"] / (self.commit_every * self.layout.step_seconds)
        return max(1.0 - overhead, 0.0)

    def _since(self, t0: float) -> tuple[float, float]:
        """Training seconds and samples of the segments after ``t0``."""
        seconds = sum(max(0.0, e - max(s, t0)) * r for s, e, r, _ in self.segments)
        samples = sum(max(0.0, e - max(s, t0)) * r * x for s, e, r, x in self.segments)
        return seconds, samples

    def change(self, t: float, cost: dict, kind: str, new: Layout, blocking: dict) -> float:
        """Apply a change at ``t``; the seconds of training it loses."""
        self._train(t)
        lost = samples = 0.0
        if kind == "fail":
            if cost["fallback"] or "save" in cost:  # back to the last checkpoint
                checkpoint = max(self.saved, math.floor(t / self.period) * self.period)
                lost, samples = self._since(checkpoint)
            else:  # back to the last commit: every commit_every steps since the last change
                wall = max(t - self.ready, 0.0)
                lost = wall % (self.commit_every * self.layout.step_seconds) * self._rate()
                samples = lost * self.layout.throughput
        elif "save" in cost:
            self.saved = t
        self.lost += lost
        self.lost_samples += samples
        self.stalled += cost["seconds"]
        self.ready = max(t, self.ready) + cost["seconds"]
        self.layout, self.blocking = new, blocking
        self.timeline.append((t / 60, len(new.devices), self._since(0.0)[0] - self.lost))
        return lost

    def finish(self, end: float) -> dict:
        self._train(end)
        productive, samples = self._since(0.0)
        productive, samples = productive - self.lost, samples - self.lost_samples
        self.timeline.append((end / 60, len(self.layout.devices), productive))
        return {
            "goodput": productive / end,
            "useful_samples": samples,
            "stall_seconds": self.stalled,
            "lost_seconds": self.lost,
            "productive_seconds": productive,
            "wall_seconds": end,
        }


def _line(row: dict, policies) -> str:
    costs = "  ".join(f"{p} {row['policies'][p]['seconds']:7.1f} s" for p in policies)
    return (
        f"  {row['minute']:6.1f} min {row['kind']:8s} {row['devices_before']:5d} -> "
        f"{row['devices_after']:5d} {row['decision']:6s} moved "
        f"{row['bytes_moved'] / 1e9:9.1f} GB  {costs}  ({row['simulate_seconds']:.2f} s)"
    )
