"""Replaying a resource trace on a described cluster, without devices: three policies side by side.

For each event of the trace (scaled to the cluster, up or down, by :func:`scale`), the job's
devices change as ``tj.ElasticJob`` changes them (``tenplex_jax._src.elastic.events``'s rules);
the planner (``tj.planner.choose``, equal stages, on fewer of the devices when none fits all of
them: :meth:`Simulation.layout`) picks the new config; ``tj.allocate`` and ``tj.make_plan`` plan
the change on the PTCs of the model's abstract state over cluster device ids (``hosts`` = node
ids); the network model (:mod:`tenplex_jax._src.simulator.network`) turns each policy's bytes
into seconds:

- **tenplex**: the state lives in host-memory tensor stores (a commit every ``commit_every`` steps,
  ``replicas`` copies on the next nodes); a change is a new generation of processes that pull the
  plan's pieces from the stores (:func:`~tenplex_jax._src.simulator.network.store_traffic`). A
  notice
  (preempt, offer, redeploy) first commits the last step; a failure loses the steps since the last
  commit. Where a failure leaves some box in no live store, the **orbax fallback**: the
  checkpoint is restored and the work since it is lost.
- **central**: the same, every byte through one node (Tenplex-Central).
- **checkpoint-restart**: save to remote storage (with notice), restart, restore; a failure loses
  the work since the last periodic checkpoint.

Every policy is charged alike where the facts are alike (:class:`Costs`): it restarts processes
(``restart(policy)``) at every change; an announced change (preempt, offer, redeploy) finds its
step compiled ahead (``compile_ahead``: ``job.expect`` for tenplex, the new processes loading an
executable compiled before the change for checkpoint-restart), a failure compiles on demand
(``compile(policy)``) unless ``executable_cache``; every policy checkpoints at the same interval
(:func:`~tenplex_jax._src.simulator.costs.checkpoint_interval`: Young/Daly for the failure rate
unless given). Every policy trains the same layouts (the growth decision is tenplex's, by
``tenplex_jax._src.planner.growth`` with the network model's transfer time), and pays the blocking
part of its periodic checkpoints and, tenplex and central, of its commits (the device-to-host
copy; the rest overlaps training). Goodput is the fraction of wall time spent on training that is
kept; useful samples weigh it by each layout's throughput. The result's ``"assumptions"`` says
per policy what it was charged.

The job's devices, as a scheduler hands them out: the trace's devices are the cluster's; the job
holds every device it was given, used or not (the planner may leave some idle, and an offer the
growth rule declines stays with the job, idle, until a later offer makes growing pay). A
preemption or failure by count takes the job's highest ids, used or not; by ids, those ids. When
it takes only idle devices the layout stays (``"keep"``); else the job re-plans on what is left.
When it takes every device the job holds, the job **waits** (``"wait"``, a stall, not an error):
it trains nothing until an offer or redeploy gives it a live device, then resumes on those
(``"resume"``) from its stores, or from the checkpoint where a failure took them; with no such
event it waits to the end. A failure that empties the job loses the work since the last commit
(since the checkpoint where its stores died). A refusal is a :class:`PlanError` naming the
model, the cluster, the device count and the event: the model fits no layout on what is left.
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
from tenplex_jax._src.simulator.costs import (
    POLICIES,
    Costs,
    assumptions,
    checkpoint_interval,
)


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

    events = tuple(
        TraceEvent(
            e.step,
            e.kind,
            None if e.devices is None else tuple(sorted({i for d in e.devices for i in ids(d)})),
            None if e.count is None else count(e.count),
        )
        for e in trace.events
    )
    return dataclasses.replace(trace, devices=devices, events=events)


_NO_DEVICE = "(no device)"  # a row's config while the job holds no device


def _devices_after(
    e: TraceEvent, held: tuple[int, ...], devices: int, failed: set[int]
) -> tuple[tuple[int, ...], set[int]]:
    """The devices the job holds after ``e`` (sorted) and the devices ``e`` takes away.

    ``ElasticJob``'s rule (``devices_after``) on the simulator's side: a preemption or failure by
    count takes the job's highest ids, used or not, and may take all of them (the job then
    waits); one by ids takes those ids, held or not (a failed device is gone for good); an offer
    adds the devices offered that are not failed; a redeploy moves onto its live devices.
    """
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


def _layout_after(sim, trace: ResourceTrace, e: TraceEvent, devices) -> Layout:
    """``sim.layout(devices)``; a refusal names the event that left the job those devices."""
    try:
        return sim.layout(devices)
    except PlanError as error:
        raise PlanError(f"trace {trace.name!r}, {e.kind} at step {e.step}: {error}") from None


def _kept(decision: str, layout: Layout | None) -> dict:
    """A row's fields after an event that plans nothing: the layout stays, or there is none."""
    return {
        "used_after": len(layout.devices) if layout else 0,
        "config_after": layout.candidate.label() if layout else _NO_DEVICE,
        "step_seconds_after": layout.step_seconds if layout else None,
        "bytes_moved": 0,
        "bytes_kept": 0,
        "plan_seconds": 0.0,
        "decision": decision,
    }


def _changed(new: Layout, result: dict, decision: str) -> dict:
    """A row's fields after an event that planned a change to ``new`` (``Simulation.event``)."""
    plan = result["plan"]
    return {
        "used_after": len(new.devices),
        "config_after": new.candidate.label(),
        "step_seconds_after": new.step_seconds,
        "bytes_moved": plan.bytes_moved,
        "bytes_kept": plan.bytes_kept,
        "plan_seconds": result["plan_seconds"],
        "decision": decision,
    }


def _apply(sim, clocks: dict, row: dict, result: dict, kind: str, t: float) -> Layout:
    """Each policy's clock makes the change of ``result`` at ``t``; its costs go in ``row``.
    Returns the new layout."""
    target = result["target"]
    blocking = sim.blocking(target)
    row["policies"] = {}
    for p, clock in clocks.items():
        cost = dict(result["policies"][p])
        cost["lost_seconds"] = clock.change(t, cost, kind, target, blocking)
        row["policies"][p] = cost
    return target


def _wait(sim, clocks: dict, layout: Layout, failed_nodes, kind: str, t: float, resume: float):
    """The job lost its last device at ``t``: each policy stalls until ``resume``. A failure
    also loses work: since the last commit while the layout's stores live, else (and always for
    checkpoint-restart) since the last checkpoint. Returns each policy's row."""
    held_by = net.holders(sim._stored(layout.ptc))
    stores_lost = kind == "fail" and any(set(n) <= failed_nodes for n in held_by.values())
    idle = dataclasses.replace(layout, devices=())  # the clock shows no device while it waits
    blocking = sim.blocking(layout)
    out = {}
    for p, clock in clocks.items():
        wait = max(resume - max(t, clock.ready), 0.0)
        cost = {"seconds": wait, "wait": wait, "fallback": stores_lost}
        if p == "checkpoint-restart":
            cost["save"] = 0.0  # its loss is since the checkpoint; the save is paid on resume
        cost["lost_seconds"] = clock.change(t, cost, kind, idle, blocking)
        out[p] = cost
    return out


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
          PlanError: no layout fits the devices or any of those subsets (the model does not
            fit); the message names the model, the cluster and the device count.
        """
        devices = tuple(sorted(devices))
        if not devices:
            raise PlanError(f"a layout of {self.profile.name!r} needs at least one device")
        refused = []
        for used in self._subsets(devices):
            try:
                return self._layout(used)
            except PlanError as error:
                refused.append(f"{len(used)} devices: {str(error)[:300]}")
        reasons = "; ".join(refused[:3]).replace("\n", " ")
        raise PlanError(
            f"no layout of {self.profile.name!r} fits {len(devices)} devices of "
            f"{self.cluster.name!r} or fewer of them down to half (fewer devices of the last "
            f"node, whole nodes from the highest ids): {reasons}"
        )

    def _subsets(self, devices: tuple[int, ...]):
        """The device sets :meth:`layout` tries, largest first: all of them; fewer devices of the
        last node (a prime count on one node has no other layout); whole nodes dropped from the
        highest ids; none below half of the devices or of the nodes."""
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

        Every policy is charged alike where the facts are alike (:class:`Costs`): an announced
        change finds its step compiled ahead (``compile_ahead``), a failure compiles on demand
        (unless ``executable_cache``); each policy restarts in its own ``restart(policy)`` and
        compiles in its own ``compile(policy)`` seconds.

        Args:
          kind: the trace event's kind (``"fail"`` has no notice: nothing is committed or saved
            first); ``"preempt"``, ``"offer"``, ``"redeploy"`` come with notice.
          old: the layout before.
          new: the layout after (its device order is re-allocated to keep the most bytes).
          failed_nodes: the nodes whose stores are gone.

        Returns:
          ``{"plan", "target", "plan_seconds", "policies"}``: the plan, the allocated target
          layout, the planning time, and per policy a dict of its seconds (``"seconds"`` in all,
          and its parts: commit or save, transfer or restore, restart, compile, the latency
          among them, and ``"detect"``: a failure's ``detect_seconds``), whether its step was
          ``"compiled_ahead"`` and whether it fell back to the checkpoint.
        """
        c = self.costs
        tic = time.perf_counter()
        target = dataclasses.replace(new, ptc=allocate(old.ptc, new.ptc))
        plan = make_plan(old.ptc, target.ptc)
        plan_seconds = time.perf_counter() - tic
        objects = self._stored(old.ptc)
        reads = net.pulls(plan, self.network, net.holders(objects), failed_nodes)
        notice = kind != "fail"
        detect = 0.0 if notice else c.detect_seconds
        ahead = c.compiled_ahead(kind)
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
                "detect": detect,
                "restart": c.restart(policy),
                "compile": 0.0 if ahead else c.compile(policy),
                "compiled_ahead": ahead,
                "restore": 0.0,
                "latency": pull.latency + (commit.latency if commit else 0.0),
                "fallback": bool(traffic.lost),
                "lost_leaves": sorted({path for path, _ in traffic.lost}),
            }
            if traffic.lost:  # the orbax tier: the checkpoint onto the new layout, no pulls
                row |= {
                    "transfer": 0.0,
                    "restore": restore.seconds,
                    "bottleneck": restore.bottleneck,
                    "latency": restore.latency,
                }
            row["seconds"] = (
                row["detect"]
                + row["commit"]
                + row["transfer"]
                + row["restore"]
                + row["restart"]
                + row["compile"]
            )
            out["policies"][policy] = row
        policy = "checkpoint-restart"
        save = self.seconds(net.save_traffic(objects, self.network)) if notice else None
        row = {
            "save": save.seconds if save else 0.0,
            "restore": restore.seconds,
            "bottleneck": restore.bottleneck,
            "detect": detect,
            "restart": c.restart(policy),
            "compile": 0.0 if ahead else c.compile(policy),
            "compiled_ahead": ahead,
            "latency": restore.latency + (save.latency if save else 0.0),
            "fallback": False,
        }
        row["seconds"] = (
            row["detect"] + row["save"] + row["restore"] + row["restart"] + row["compile"]
        )
        out["policies"][policy] = row
        return out

    def blocking(self, layout: Layout) -> dict[str, float]:
        """Seconds a periodic commit (tenplex, central) and a periodic checkpoint (every policy)
        stop training: the device-to-host copy, which the writes then overlap; and the seconds
        of a whole checkpoint save, which bounds how often one can start.

        Args:
          layout: the job's layout.

        Returns:
          ``{"commit": seconds, "checkpoint": seconds, "save": seconds}``.
        """
        objects = self._stored(layout.ptc)
        save = self.seconds(net.save_traffic(objects, self.network))
        d2h = save.resources["d2h"]
        return {"commit": d2h, "checkpoint": d2h, "save": save.seconds}


def simulate(
    sim: Simulation, trace: ResourceTrace, policies: Sequence[str] = POLICIES, log=None
) -> dict:
    """Replay ``trace`` (scaled to the cluster) on ``sim``: per-event rows and, per policy, its
    goodput over the whole trace (see the module docstring).

    Each event changes the job's devices as ``tj.ElasticJob`` would; an offer is taken only when
    the growth rule says the gain outweighs the cost; a job that loses every device waits (the
    module docstring). A row's ``"decision"`` is ``change``, ``grow``, ``stay`` (an offer
    declined), ``keep`` (only idle devices went), ``wait`` or ``resume``; a waiting row's policies
    say their ``"wait"`` seconds. ``tenplex-jax simulate`` is its command line. See
    :class:`Simulation` for an example.

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
      PlanError: an unknown policy, or the model fits no layout on the devices the job holds at
        the start or after some event (the message names the model, cluster, device count and
        event).
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
    checkpoint = checkpoint_interval(sim.costs, trace, minutes, sim.blocking(layout), trace.devices)
    ckpt_minutes = checkpoint["minutes"]
    period = ckpt_minutes * 60
    clocks = {  # checkpoint-restart commits nothing to stores: no commit stops it
        p: _Clock(
            layout,
            sim.blocking(layout),
            0 if p == "checkpoint-restart" else sim.costs.commit_every,
            period,
        )
        for p in policies
    }
    failed: set[int] = set()
    held = tuple(range(trace.devices))  # the devices the job has (it may leave some unused)
    emptied = ""  # while the job holds no device: the kind of the event that took the last
    rows = []
    for number, e in enumerate(trace.events):
        t = at(e.step)
        if e.kind == "offer" and e.devices is not None:  # failed devices offered by id: repaired
            failed -= set(e.devices)
        devices, gone = _devices_after(e, held, trace.devices, failed)
        if e.kind == "fail":
            failed |= gone
        failed_nodes = frozenset(sim.cluster.nodes[d] for d in failed)
        tic = time.perf_counter()
        row = {
            "event": number,
            "minute": t / 60,
            "kind": e.kind,
            "devices_before": len(held),
            "devices_after": len(devices),
            "used_before": len(layout.devices) if held else 0,
            "config_before": layout.candidate.label() if held else _NO_DEVICE,
            "step_seconds_before": layout.step_seconds if held else None,
            "state_bytes": layout.ptc.nbytes,
        }
        if not devices:  # nothing left to train on: the job waits (see the module docstring)
            row |= _kept("wait", None)
            row["policies"] = {p: {"seconds": 0.0, "wait": 0.0} for p in policies}
            if held:
                resume = _resume_at(trace.events[number + 1 :], trace.devices, failed, at, end)
                row["policies"] = _wait(sim, clocks, layout, failed_nodes, e.kind, t, resume)
                emptied = e.kind
        elif not held:  # devices back after a wait: from the last layout's stores or checkpoint
            new = _layout_after(sim, trace, e, devices)
            result = sim.event(emptied if emptied == "fail" else e.kind, layout, new, failed_nodes)
            row |= _changed(new, result, "resume")
            layout, emptied = _apply(sim, clocks, row, result, e.kind, t), ""
        elif set(devices) == set(held) or (
            e.kind in ("preempt", "fail") and set(layout.devices) <= set(devices)
        ):  # nothing new, or only devices the job left idle went: the layout stays
            row |= _kept("keep", layout)
            row["policies"] = {p: {"seconds": 0.0} for p in policies}
        else:
            new = _layout_after(sim, trace, e, devices)
            result = sim.event(e.kind, layout, new, failed_nodes)
            plan, tenplex = result["plan"], result["policies"]["tenplex"]
            decision = "change"
            if e.kind == "offer":
                moving = tenplex["transfer"] + tenplex["commit"] + tenplex["restore"]
                moved = plan.bytes_moved  # none (every piece stays on its device): no transfer
                rule = growth(
                    step_seconds_now=layout.step_seconds,
                    step_seconds_new=new.step_seconds,
                    remaining_steps=int(max(end - t, 0) / layout.step_seconds),
                    bytes_moved=moved,
                    bandwidth=moved / moving if moving and moved else math.inf,
                    compile_seconds=sim.costs.compile("tenplex"),
                    compiled_ahead=sim.costs.compiled_ahead(e.kind),
                    source="planner",
                    restart_seconds=sim.costs.restart("tenplex"),
                )
                row["growth"] = rule
                decision = "grow" if rule["grow"] else "stay"
            row |= _changed(new, result, decision)
            if decision == "stay":  # the offered devices are the job's, idle until it grows
                row["policies"] = {p: {"seconds": 0.0} for p in policies}
            else:
                layout = _apply(sim, clocks, row, result, e.kind, t)
        held = devices
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
        "checkpoint": checkpoint,
        "assumptions": {p: assumptions(sim.costs, p, checkpoint) for p in policies},
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

    def _discard(self, t0: float, t1: float) -> tuple[float, float]:
        """Take the training between wall times ``t0`` and ``t1`` out of the segments (work a
        failure lost, so a later failure cannot lose it again); its seconds and samples."""
        kept, seconds, samples = [], 0.0, 0.0
        for s, e, r, x in self.segments:
            lo, hi = max(s, t0), min(e, t1)
            if hi <= lo:
                kept.append((s, e, r, x))
                continue
            seconds, samples = seconds + (hi - lo) * r, samples + (hi - lo) * r * x
            kept += [(s, lo, r, x)] * (s < lo) + [(hi, e, r, x)] * (hi < e)
        self.segments = kept
        return seconds, samples

    def change(self, t: float, cost: dict, kind: str, new: Layout, blocking: dict) -> float:
        """Apply a change at ``t``; the seconds of training it loses."""
        self._train(t)
        lost = samples = 0.0
        if kind == "fail":
            checkpoint = max(self.saved, math.floor(t / self.period) * self.period)
            if cost["fallback"] or "save" in cost:  # back to the last checkpoint
                lost, samples = self._discard(checkpoint, t)
            else:  # back to the last commit (every commit_every steps since the last change),
                # or to the last checkpoint where it is newer
                wall = max(t - self.ready, 0.0)
                since = wall % (self.commit_every * self.layout.step_seconds)
                lost, samples = self._discard(max(t - since, checkpoint), t)
        elif "save" in cost:
            self.saved = t
        self.lost += lost
        self.lost_samples += samples
        self.stalled += cost["seconds"]
        self.ready = max(t, self.ready) + cost["seconds"]
        self.layout, self.blocking = new, blocking
        self.timeline.append((t / 60, len(new.devices), self._since(0.0)[0]))
        return lost

    def finish(self, end: float) -> dict:
        self._train(end)
        productive, samples = self._since(0.0)  # lost work is out of the segments already
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
