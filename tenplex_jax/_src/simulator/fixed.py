"""One fixed change, with no planner choosing the configs: :meth:`Simulation.event` between
the two layouts, charged exactly as a trace's event of the same kind is."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tenplex_jax._src.elastic.events import EventKind
from tenplex_jax._src.errors import LayoutError, PlanError, one_of
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.planner.search import choose, estimate
from tenplex_jax._src.ptc import ParallelConfig
from tenplex_jax._src.simulator.costs import Policy, assumptions
from tenplex_jax._src.simulator.replay import Layout, Simulation
from tenplex_jax._src.simulator.results import ChangeResult


def fixed_change(
    sim: Simulation,
    source: ParallelConfig,
    target: ParallelConfig,
    kind: str | None = None,
    *,
    failed_nodes: Iterable[int] = (),
    policies: Sequence[str] = tuple(Policy),
) -> ChangeResult:
    """The change from ``source`` to ``target``, each on the cluster's first devices, priced
    under every policy. The Tenplex paper's scale-out::

        sim = tj.simulator.Simulation(cluster, profile, abstract_state, rules, global_batch=128)
        change = fixed_change(sim, C(tensor=4, pipe=2), C(tensor=4, pipe=2, data=2))
        change.policies["tenplex"].seconds

    Args:
      sim: the :class:`Simulation` (model, cluster, costs).
      source: the config before, on devices ``0 .. source.num_devices - 1``.
      target: the config after, on devices ``0 .. target.num_devices - 1`` (re-allocated by
        ``tj.allocate`` to keep the most bytes in place).
      kind: ``"offer"``, ``"preempt"``, ``"redeploy"`` (with notice) or ``"fail"`` (default:
        ``"offer"`` for more devices, ``"preempt"`` for fewer, else ``"redeploy"``).
      failed_nodes: nodes whose stores are gone (with ``"fail"``).
      policies: the :class:`Policy` values to price (default: all).

    Returns:
      The :class:`ChangeResult`.

    Raises:
      PlanError: an unknown kind or policy, a config needing more devices than the cluster
        has, or one the model's shapes do not divide.
    """
    policies = Policy.parse(policies)
    kind = _kind(sim, source, target, kind)
    old, new = _layout(sim, source), _layout(sim, target)
    change = sim.event(kind, old, new, frozenset(failed_nodes))
    return ChangeResult(
        cluster=str(sim.cluster),
        model=sim.profile.name,
        global_batch=sim.global_batch,
        kind=kind,
        source=str(source),
        target=str(target),
        config_before=old.candidate.label(),
        config_after=new.candidate.label(),
        devices_before=source.num_devices,
        devices_after=target.num_devices,
        state_bytes=old.ptc.nbytes,
        bytes_moved=change.plan.bytes_moved,
        bytes_kept=change.plan.bytes_kept,
        plan_seconds=change.plan_seconds,
        step_seconds_before=old.step_seconds,
        step_seconds_after=new.step_seconds,
        fits_before=old.candidate.fits,
        fits_after=new.candidate.fits,
        policies={p: change.policies[p] for p in policies},
        assumptions={p: assumptions(sim.costs, p) for p in policies},
    )


def _kind(sim: Simulation, source: ParallelConfig, target: ParallelConfig, kind) -> EventKind:
    """The change's kind, given or by the device counts; both configs fit the cluster."""
    for config in (source, target):
        if config.num_devices > sim.cluster.num_devices:
            raise PlanError(
                f"config {config} needs {config.num_devices} devices; cluster {sim.cluster.name!r} "
                f"has {sim.cluster.num_devices}"
            )
    if kind is None:
        before, after = source.num_devices, target.num_devices
        kind = "offer" if after > before else "preempt" if after < before else "redeploy"
    return one_of(EventKind, kind, "a change's kind", PlanError)


def _layout(sim: Simulation, config: ParallelConfig) -> Layout:
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
    return Layout(devices=ids, candidate=candidate, ptc=sim._ptc(candidate, ids))
