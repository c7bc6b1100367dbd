"""Re-planning a running job of virtual workers (VWs) when its cluster changes (Hydrozoa's
coordinator adjusts the workers when their number changes).

``coordinator.replan(devices)`` asks the coordinator's planner for the VWs of the new device set
(``planner(devices) -> WSPChoice``: :func:`plan_workers` on the cluster's description of them),
and applies the plan at a wave boundary: a running VW whose devices, layout, stages and ``Nm``
the plan keeps trains on; every other one is told to leave, finishes and pushes the wave it
holds, hands its leases back to the ledger and ends; then the plan's new VWs are built (the
runner's ``make`` reads each one's :class:`WorkerPlan` with ``coordinator.plan_of(devices)``)
and join from the parameter server's weights. The ledger's leases make it exact: a minibatch a
leaving VW had claimed and not pushed is claimed again, first, by the VWs that come; none is
trained twice.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from tenplex_jax._src.errors import WSPError


@dataclasses.dataclass(frozen=True)
class Replanned:
    """What a re-plan did.

    Attributes:
      devices: the device ids planned for.
      plan: the planner's choice (a :class:`WSPChoice`).
      kept: the VWs the plan kept as they were.
      stopped: the VWs that left at their wave boundary.
      started: the VWs started from the plan.
      clocks: each stopped VW's waves committed when it left (its last wave boundary).
      seconds: from the plan to the new VWs launched (their build included).
    """

    devices: tuple[int, ...]
    plan: object
    kept: tuple[str, ...]
    stopped: tuple[str, ...]
    started: tuple[str, ...]
    clocks: dict[str, int]
    seconds: float


def signature(plan) -> tuple:
    """What a VW is, by its :class:`WorkerPlan`: its devices (as a set), mesh shape, stages and
    ``Nm``; a VW whose signature the new plan has again trains on."""
    c = plan.candidate
    return (tuple(sorted(plan.devices)), str(c.config), c.stages.layers, plan.minibatches)


def replan(coordinator, devices: Sequence[int], timeout: float = 600.0) -> Replanned:
    """Plan the VWs of ``devices`` and apply the plan to ``coordinator``'s running job at a wave
    boundary (the module docstring).

    Raises:
      WSPError: the coordinator has no planner, the plan uses devices outside ``devices``
        (``"invalid"``), or a VW told to leave did not end within ``timeout`` (``"busy"``).
      PlanError: the planner found no plan (nothing is stopped then).
    """
    if coordinator.planner is None:
        raise WSPError(
            "a re-plan needs the coordinator's planner (Coordinator(planner=...))", "invalid"
        )
    devices, tic = tuple(devices), time.monotonic()
    plan = coordinator.planner(devices)  # before anything stops: a PlanError changes nothing
    used = sorted(d for w in plan.workers for d in w.devices)
    if not set(used) <= set(devices) or len(set(used)) != len(used):
        raise WSPError(
            f"a plan's VWs use each of the devices planned for at most once: planned for "
            f"{sorted(devices)}, its VWs use {used}",
            "invalid",
        )
    wanted = {signature(w): w for w in plan.workers}
    kept, stopped = [], []
    for name, member in list(coordinator.members.items()):
        old = coordinator.plans.get(tuple(sorted(member.devices)))
        if old is not None and signature(old) in wanted:
            kept.append(name)
            del wanted[signature(old)]
        else:
            stopped.append(name)
    gone = [coordinator.members[name] for name in stopped]
    for name in stopped:  # each finishes and pushes its wave, hands back its leases, leaves
        coordinator.remove(name)
    deadline = time.monotonic() + timeout
    for member in gone:
        coordinator.runner.wait(member.handle, max(deadline - time.monotonic(), 0.1))
        if coordinator.runner.alive(member.handle):
            raise WSPError(f"VW {member.name!r} did not leave within {timeout:.0f} s", "busy")
    committed = coordinator.ps.ledger().committed
    coordinator.plans = {tuple(sorted(w.devices)): w for w in plan.workers}
    started = coordinator.add(*(w.devices for w in wanted.values())) if wanted else []
    return Replanned(
        devices=devices,
        plan=plan,
        kept=tuple(kept),
        stopped=tuple(stopped),
        started=tuple(started),
        clocks={name: committed.get(name, 0) for name in stopped},
        seconds=time.monotonic() - tic,
    )


def planner_for(cluster, profile, minibatch: int, **options):
    """A coordinator's planner: ``plan_workers`` on the part of ``cluster`` a re-plan names,
    its VWs' devices given back as ``cluster``'s ids (what the coordinator and the runner use).

    Args:
      cluster: the whole :class:`tenplex_jax.planner.Cluster` (device ``d``: the runner's ``d``).
      profile: the model's :class:`tenplex_jax.planner.ModelProfile`.
      minibatch: samples per minibatch.
      options: more of ``plan_workers``'s (``objective``, ``groupings``).
    """
    from tenplex_jax._src.wsp.planner import plan_workers

    def plan(devices: Sequence[int]):
        ids = tuple(devices)
        choice = plan_workers(cluster.subset(ids), profile, minibatch, **options)
        back = lambda local: tuple(ids[i] for i in local)
        workers = tuple(
            dataclasses.replace(
                w,
                devices=back(w.devices),
                candidate=dataclasses.replace(w.candidate, devices=back(w.candidate.devices)),
            )
            for w in choice.workers
        )
        return dataclasses.replace(choice, workers=workers)

    return plan
