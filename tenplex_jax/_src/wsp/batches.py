"""Hydrozoa's batch-size search: for every minibatch size, the best partition of each virtual
worker (VW) by the planner's search, then the best combination of batch size and partitions.

``search_minibatch(cluster, profile, minibatches)`` runs :func:`plan_workers` at each size (every
VW's layout and stages, ``Nm``, the job's samples/s, each device type's ``memory`` as its limit)
and keeps the size with the most samples per second (or per dollar). A size at which some VW
fits no layout is refused with the VW, its worst stage, the batch per device, the bytes needed
and the limit, estimated for the layout the VW had at the largest size that fitted (or plain
data parallelism over its devices when none did). Larger minibatches amortize each wave's push
and pull, so the search usually ends at the largest size the devices' memory holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import Candidate, estimate
from tenplex_jax._src.ptc import ParallelConfig
from tenplex_jax._src.wsp.planner import GROUPINGS, WSPChoice, groups, plan_workers

MINIBATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class BatchTry:
    """One minibatch size tried.

    Attributes:
      minibatch: samples per minibatch.
      per_device: each VW's samples per data-parallel replica (empty when refused).
      throughput: the job's estimated samples/s (0 when refused).
      samples_per_usd: its samples per dollar (0 when refused).
      refused: why it does not fit, naming the VW, stage, batch, bytes needed and limit ("" if
        it fits).
    """

    minibatch: int
    per_device: tuple[int, ...]
    throughput: float
    samples_per_usd: float
    refused: str = ""


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    """The minibatch size chosen, its plan, and every size tried.

    Attributes:
      choice: the :class:`WSPChoice` at the chosen size.
      tries: every size tried, in order.
    """

    choice: WSPChoice
    tries: tuple[BatchTry, ...]

    @property
    def minibatch(self) -> int:
        """The chosen samples per minibatch."""
        return self.choice.minibatch

    def table(self) -> str:
        """Each size's per-device batches and estimate, or why it was refused; then the plan."""
        lines = [f"{'minibatch':>9}  {'per device':<16} {'samples/s':>10}  note"]
        for t in self.tries:
            note = "chosen" if t.minibatch == self.minibatch else t.refused
            per = ",".join(map(str, t.per_device)) or "-"
            lines.append(f"{t.minibatch:9d}  {per[:16]:<16} {t.throughput:10.1f}  {note}")
        return "\n".join(lines + [str(self.choice)])

    def __str__(self) -> str:
        return self.table()


def search_minibatch(
    cluster: Cluster,
    profile: ModelProfile,
    minibatches: Sequence[int] = MINIBATCHES,
    *,
    objective: str = "time",
    groupings=GROUPINGS,
) -> BatchChoice:
    """The minibatch size (among ``minibatches``) and VWs with the most samples per second (or
    per dollar, ``objective="cost"``) within every device's memory. Example::

        found = search_minibatch(tj.planner.Cluster.load("meshes/hetpipe.toml"), profile)
        print(found)          # each size's estimate or refusal, then the chosen plan
        found.minibatch, found.choice.workers

    Args:
      cluster: the devices (a :class:`tenplex_jax.planner.Cluster`); each type's ``memory``
        is its limit.
      profile: the model's :class:`tenplex_jax.planner.ModelProfile`.
      minibatches: the minibatch sizes (samples per VW minibatch) tried.
      objective: ``"time"`` (samples per second) or ``"cost"`` (samples per dollar).
      groupings: the VW groupings :func:`plan_workers` tries at each size.

    Returns:
      A :class:`BatchChoice`: the chosen size and plan, and every size's estimate or refusal.

    Raises:
      PlanError: a size is not a positive int, or none fits; the message gives each size's
        refusal.
    """
    sizes = sorted(set(minibatches))
    bad = [b for b in sizes if not isinstance(b, int) or isinstance(b, bool) or b < 1]
    if not sizes or bad:
        raise PlanError(
            f"the minibatch sizes searched are ints >= 1, got {list(minibatches)!r} ({bad})"
        )
    tries, fitted = [], []
    for b in sizes:
        try:
            choice = plan_workers(cluster, profile, b, objective=objective, groupings=groupings)
        except PlanError:
            last = fitted[-1] if fitted else None
            tries.append(BatchTry(b, (), 0.0, 0.0, _refusal(cluster, profile, b, last, groupings)))
            continue
        fitted.append(choice)
        per_device = tuple(
            -(-b // (w.candidate.config.data * w.candidate.config.fsdp)) for w in choice.workers
        )
        per_usd = choice.samples_per_usd if choice.usd_per_hour else 0.0
        tries.append(BatchTry(b, per_device, choice.throughput, per_usd))
    if not fitted:
        raise PlanError(
            "no minibatch size fits the devices' memory: "
            + "; ".join(f"{t.minibatch}: {t.refused}" for t in tries)
        )
    per_usd = objective == "cost" and fitted[0].usd_per_hour
    best = max(fitted, key=lambda c: c.samples_per_usd if per_usd else c.throughput)
    return BatchChoice(choice=best, tries=tuple(tries))


def _refusal(cluster, profile, batch: int, last: WSPChoice | None, groupings) -> str:
    """Why ``batch`` does not fit: the VW and stage with the most bytes over their limit, for
    the layout each VW had at the last size that fitted (else data parallel)."""
    if last is not None:
        layouts = [(w.devices, w.candidate) for w in last.workers]
    else:
        layouts = []
        for grouping in groupings:
            try:
                layouts = [(ids, None) for ids in groups(cluster, grouping)]
                break
            except PlanError:
                continue
    worst = None
    for i, (ids, candidate) in enumerate(layouts, 1):
        got = _estimate(cluster, profile, batch, ids, candidate)
        for stage, (used, limit) in enumerate(zip(got.memory, got.memory_limit)):
            if worst is None or used - limit > worst[0]:
                per = -(-batch // (got.config.data * got.config.fsdp))
                worst = (used - limit, i, ids, stage, per, used, limit, got)
    if worst is None:
        return f"minibatch {batch}: no grouping of the cluster applies"
    _, i, ids, stage, per, used, limit, got = worst
    return (
        f"a VW's stages must fit their devices' memory: at minibatch {batch} VW {i} (devices "
        f"{list(ids)}, {got.label()}) stage {stage} needs {used:,} bytes ({used / MIB:,.0f} "
        f"MiB) per device for {per} samples per device, over the limit of {limit:,} bytes "
        f"({limit / MIB:,.0f} MiB)"
    )


def _estimate(cluster, profile, batch: int, ids, candidate: Candidate | None) -> Candidate:
    """The cost model's memory for VW ``ids`` at ``batch``: ``candidate``'s layout, or plain data
    parallelism over the VW's devices."""
    if candidate is None:
        config, micro, stages = ParallelConfig(data=len(ids)), 1, Stages((profile.num_layers,))
    else:
        config, stages = candidate.config, candidate.stages
        per = -(-batch // (config.data * config.fsdp))
        micro = math.gcd(candidate.microbatches, per) if config.pipe > 1 else 1
    return estimate(cluster, profile, batch, config, micro, stages, devices=ids)
