"""One fixed change, with no planner choosing the configs: ``(tensor 4, pipe 2, data 1) ->
(tensor 4, pipe 2, data 2)`` on the cluster's first devices, each policy's seconds and their parts.

The configs are the caller's; the planner only picks each one's microbatches (its step time, for
the table). The change is :meth:`Simulation.event` between the two layouts, so it is charged
exactly as a trace's event of the same kind is.
"""

from __future__ import annotations

from collections.abc import Iterable

from tenplex_jax._src.errors import LayoutError, PlanError
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.planner.search import choose, estimate
from tenplex_jax._src.ptc import PTC, ParallelConfig
from tenplex_jax._src.simulator.costs import assumptions
from tenplex_jax._src.simulator.replay import Layout, Simulation

KINDS = ("offer", "preempt", "redeploy", "fail")


def fixed_change(
    sim: Simulation,
    source: ParallelConfig,
    target: ParallelConfig,
    kind: str | None = None,
    *,
    failed_nodes: Iterable[int] = (),
) -> dict:
    """The change from ``source`` on the cluster's first devices to ``target`` on its first
    devices, under every policy.

    Example (the Tenplex paper's scale-out)::

        sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=128)
        row = fixed_change(sim, C(tensor=4, pipe=2), C(tensor=4, pipe=2, data=2))
        row["policies"]["tenplex"]["seconds"]

    Args:
      sim: the :class:`Simulation` (model, cluster, costs).
      source: the config before, on devices ``0 .. source.num_devices - 1``.
      target: the config after, on devices ``0 .. target.num_devices - 1`` (re-allocated by
        ``tj.allocate`` to keep the most bytes in place).
      kind: the event's kind: ``"offer"``, ``"preempt"``, ``"redeploy"`` (with notice) or
        ``"fail"`` (default: ``"offer"`` for more devices, ``"preempt"`` for fewer, else
        ``"redeploy"``).
      failed_nodes: nodes whose stores are gone (with ``"fail"``).

    Returns:
      A JSON-able dict: the configs and their labels, devices, state bytes, the plan's bytes
      moved and kept, the planning seconds, both step times, whether each layout fits memory,
      ``"policies"`` (per policy its seconds and parts as :meth:`Simulation.event` gives them,
      with ``"bytes_moved"``), and ``"assumptions"`` per policy.

    Raises:
      PlanError: an unknown kind, a config needing more devices than the cluster has, or one
        the model's shapes do not divide.
    """
    n = sim.cluster.num_devices
    if kind is None:
        more, fewer = (
            target.num_devices > source.num_devices,
            target.num_devices < source.num_devices,
        )
        kind = "offer" if more else "preempt" if fewer else "redeploy"
    if kind not in KINDS:
        raise PlanError(f"a change's kind is one of {KINDS}, got {kind!r}")
    for config in (source, target):
        if config.num_devices > n:
            raise PlanError(
                f"config {config} needs {config.num_devices} devices; cluster {sim.cluster.name!r} "
                f"has {n}"
            )
    old = _layout(sim, source, None)
    new = _layout(sim, target, old.ptc)
    result = sim.event(kind, old, new, frozenset(failed_nodes))
    plan = result["plan"]
    policies = {}
    for policy, row in result["policies"].items():
        policies[policy] = {"bytes_moved": plan.bytes_moved} | row
    return {
        "cluster": str(sim.cluster),
        "model": sim.profile.name,
        "global_batch": sim.global_batch,
        "kind": kind,
        "from": str(source),
        "to": str(target),
        "config_before": old.candidate.label(),
        "config_after": new.candidate.label(),
        "devices_before": source.num_devices,
        "devices_after": target.num_devices,
        "state_bytes": old.ptc.nbytes,
        "bytes_moved": plan.bytes_moved,
        "bytes_kept": plan.bytes_kept,
        "plan_seconds": result["plan_seconds"],
        "step_seconds_before": old.step_seconds,
        "step_seconds_after": new.step_seconds,
        "fits_before": old.candidate.fits,
        "fits_after": new.candidate.fits,
        "policies": policies,
        "assumptions": {p: assumptions(sim.costs, p) for p in policies},
    }


def _layout(sim: Simulation, config: ParallelConfig, base: PTC | None) -> Layout:
    """``config`` on the cluster's first devices: the planner's microbatches for it (or, when
    no microbatch count fits memory, one per stage, flagged by ``candidate.fits``)."""
    ids = tuple(range(config.num_devices))
    cluster = sim.cluster.subset(ids)
    try:
        candidate = choose(
            cluster, sim.profile, sim.global_batch, even_stages=True, configs=[config], top=1
        ).best
    except PlanError as refused:
        try:
            stages = Stages.even(sim.profile.num_layers, config.pipe)
            candidate = estimate(
                cluster, sim.profile, sim.global_batch, config, config.pipe, stages
            )
        except (PlanError, LayoutError):
            raise refused from None
    mesh_ids = tuple(ids[i] for i in candidate.devices)
    hosts = [sim.cluster.nodes[d] for d in mesh_ids]
    if base is None:
        ptc = PTC.of(sim.state, sim.rules, candidate.config, mesh_ids, hosts=hosts)
    else:
        ptc = base.relayout(candidate.config, mesh_ids, hosts=hosts)
    return Layout(ids, candidate, ptc)
