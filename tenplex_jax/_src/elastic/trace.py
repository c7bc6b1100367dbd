"""Resource traces: the devices a job has over time, replayed on an :class:`ElasticJob`.

A trace is a TOML file (format in ``meshes/README.md``)::

    name = "philly"
    devices = 8              # the machine's devices; the job starts on all of them
    steps = 48               # the run's length in steps
    checkpoint_every = 8     # periodic checkpoints (both policies; the fallback for lost shards)

    [[events]]
    step = 6                 # posted before step 6: applied at that step boundary
    kind = "preempt"         # preempt (a notice), fail (buffers gone), offer (devices come back),
                             # redeploy (move onto exactly `devices`)
    count = 2                # how many devices: the job's last ones (preempt, fail) or the
                             # lowest-numbered free ones (offer) ...
    # devices = [6, 7]       # ... or exactly these ids

``replay`` runs the user's loop over a trace: it posts each event before its step boundary and,
as a scheduler that announces its plans would, tells the job the devices it will have after each
of the next two changes (``job.expect``) so that their steps compile ahead, each for the exact
layout the change will pick. ``checkpoint_restart`` replays the same events under the policy a job
without tenplex_jax follows (orbax save, restart, restore, compile anew) with costs measured in
the same run, for the goodput comparison.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import tomllib
from collections.abc import Callable, Mapping

from tenplex_jax._src.elastic.events import Decision, EventKind, EventRecord
from tenplex_jax._src.elastic.job import ElasticJob
from tenplex_jax._src.errors import LayoutError, one_of


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """A change of the job's devices before step ``step``: ``devices`` by id or ``count`` by
    rule. One ``[[events]]`` table of a trace; :class:`ResourceTrace` checks it against the
    trace.

    Attributes:
      step: the step it comes before: :func:`replay` posts it then and the job applies it at that
        step boundary; in ``1..steps-1``, never less than the event before's.
      kind: an :class:`EventKind` (or its string): ``"preempt"`` (a notice), ``"fail"`` (the
        buffers are gone), ``"offer"`` (devices come, the job grows when that pays) or
        ``"redeploy"`` (move onto exactly ``devices``).
      devices: the device ids, in ``0..devices-1`` of the trace, or None to go by ``count``.
      count: how many devices when ``devices`` is None: the job's last ``count`` (highest ids)
        for a preemption or failure, the ``count`` lowest-numbered free ones for an offer; at
        least 1. Give exactly one of ``devices`` and ``count`` (a redeploy takes ``devices``).
    """

    step: int
    kind: EventKind
    devices: tuple[int, ...] | None = None
    count: int | None = None


@dataclasses.dataclass(frozen=True)
class ResourceTrace:
    """The events of a run of ``steps`` steps on a machine of ``devices`` devices.

    Read from TOML with :meth:`load` (the format is in ``meshes/README.md``), replayed on a job
    with :func:`replay` and by the simulator (``tj.simulator.simulate``)::

        trace = tj.elastic.ResourceTrace.load("meshes/philly.toml")

    Attributes:
      name: what the trace is called (a file's stem when its TOML has no ``name``).
      devices: the machine's device count, ids ``0..devices-1``; the job starts on all of them.
      steps: the run's length in steps.
      events: the events (:class:`TraceEvent`), in step order.
      checkpoint_every: the period of the run's orbax checkpoints in steps, from step 0 (the
        fallback for shards no replica holds, and the checkpoint-restart baseline's period), or
        None for none.
      description: free text about where the trace comes from.
      minutes: the trace's wall-clock length, for the simulator: step ``s`` happens at
        ``s / steps`` of it (None: ``steps`` times the first layout's step time).

    Raises:
      LayoutError: ``devices`` or ``steps`` below 1, ``minutes`` not positive, or an event that
        breaks a rule of :class:`TraceEvent` (its kind, its step, device ids outside the
        machine, a count below 1, both or neither of ``devices`` and ``count``); the message
        names the trace and the event's step.
    """

    name: str
    devices: int
    steps: int
    events: tuple[TraceEvent, ...]
    checkpoint_every: int | None = None
    description: str = ""
    minutes: float | None = None  # wall-clock length, for the simulator: step s at s/steps of it

    def __post_init__(self):
        if self.devices < 1 or self.steps < 1:
            raise LayoutError(f"a trace needs devices >= 1 and steps >= 1, got {self}")
        if self.minutes is not None and not self.minutes > 0:
            raise LayoutError(f"trace {self.name!r}: minutes must be > 0, got {self.minutes}")
        last = 0
        for e in self.events:
            where = f"trace {self.name!r}, event at step {e.step}"
            one_of(EventKind, e.kind, f"{where}: kind", LayoutError)
            if not last <= e.step < self.steps or e.step < 1:
                raise LayoutError(
                    f"{where}: event steps must not decrease and lie in 1..{self.steps - 1}"
                )
            if (e.devices is None) == (e.count is None):
                raise LayoutError(f"{where}: give exactly one of devices (ids) or count")
            if e.kind == EventKind.REDEPLOY and e.devices is None:
                raise LayoutError(f"{where}: a redeploy names its devices (ids), not a count")
            ids = e.devices or ()
            if any(not 0 <= d < self.devices for d in ids) or (e.count is not None and e.count < 1):
                raise LayoutError(
                    f"{where}: device ids lie in 0..{self.devices - 1} and counts are >= 1, got "
                    f"devices={e.devices} count={e.count}"
                )
            last = e.step

    @classmethod
    def load(cls, path: str | pathlib.Path) -> ResourceTrace:
        """Read a trace from the TOML file at ``path`` (the format in ``meshes/README.md``); its
        ``name`` defaults to the file's stem.

        Raises:
          LayoutError: the file cannot be read or is not TOML, or as :meth:`from_dict`.
        """
        path = pathlib.Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise LayoutError(f"cannot read trace {str(path)!r}: {error}") from None
        return cls.from_dict(data, default_name=path.stem)

    @classmethod
    def from_dict(cls, data: Mapping, default_name: str = "trace") -> ResourceTrace:
        """The trace a parsed TOML document describes.

        Args:
          data: a mapping with the keys ``devices`` and ``steps`` and optionally ``name``,
            ``description``, ``checkpoint_every``, ``minutes`` and ``events`` (a list of
            mappings with ``step``, ``kind`` and ``devices`` or ``count``).
          default_name: the trace's name when ``data`` has no ``name``.

        Raises:
          LayoutError: an unknown or missing key, in the trace or in an event, or a value that
            breaks a rule of :class:`ResourceTrace`.
        """
        known = {"name", "description", "devices", "steps", "checkpoint_every", "events", "minutes"}
        unknown = set(data) - known
        if unknown or "devices" not in data or "steps" not in data:
            raise LayoutError(
                f"a trace has keys devices, steps and optionally "
                f"{sorted(known - {'devices', 'steps'})}; got {sorted(data)}"
            )
        events = []
        for raw in data.get("events", []):
            extra = set(raw) - {"step", "kind", "devices", "count"}
            if extra or "step" not in raw or "kind" not in raw:
                raise LayoutError(
                    f"a trace event has step, kind and devices or count; got {sorted(raw)}"
                )
            devices = raw.get("devices")
            events.append(
                TraceEvent(
                    step=int(raw["step"]),
                    kind=raw["kind"],
                    devices=None if devices is None else tuple(int(d) for d in devices),
                    count=raw.get("count"),
                )
            )
        return cls(
            name=data.get("name", default_name),
            devices=int(data["devices"]),
            steps=int(data["steps"]),
            events=tuple(events),
            checkpoint_every=data.get("checkpoint_every"),
            description=data.get("description", ""),
            minutes=None if data.get("minutes") is None else float(data["minutes"]),
        )


def replay(
    job: ElasticJob,
    state,
    step: Callable,
    trace: ResourceTrace,
    *,
    hints: bool = True,
    on_step: Callable | None = None,
):
    """Train ``job`` through ``trace`` with the user's jitted ``step``; returns the final state.

    Each event is posted once, before the boundary of its step; after a checkpoint fallback the
    job reruns lost steps without posting their events again. The loop ends when ``job.step``
    reaches ``trace.steps``; the trace's ``devices`` and ``checkpoint_every`` are the caller's to
    give the job (its ``devices`` and ``checkpoint_every``)::

        state = tj.elastic.replay(job, job.start(init), job.jit(train_step), trace)

    Args:
      job: the :class:`tenplex_jax.ElasticJob`, started, on the trace's devices.
      state: the state ``job.start`` returned.
      step: the step ``job.jit`` returned: ``step(state, batch) -> (state, metrics)``.
      trace: the :class:`ResourceTrace` whose events are posted.
      hints: act as a scheduler that announces its plans: before the first step, and after the
        first step of each change, ``job.expect`` the devices the job will have after each of
        the next two step boundaries with events (see :func:`upcoming`), so that the steps of
        those layouts compile ahead, in order, for as many steps as two changes are apart.
      on_step: called as ``on_step(job, metrics)`` after every step (None: nothing).

    Returns:
      The state after the last step, on the job's devices then.

    Raises:
      LayoutError: an event asks for devices with no layout (from ``job.next``).
      LostShardsError: a failure took shards no replica holds, and there is no checkpoint.
    """
    events = list(trace.events)
    announce = hints
    while job.step < trace.steps:
        if announce:  # from the devices the job has after the changes posted before
            for ids in upcoming(job, events):
                job.expect(ids)
            announce = False
        while events and events[0].step <= job.step:
            e = events.pop(0)
            if e.kind == EventKind.REDEPLOY:
                job.redeploy(e.devices)
            else:
                getattr(job, e.kind)(e.devices, count=e.count)
            announce = hints  # after the first step of the change: no compile beside it
        state, batch = job.next(state)
        state, metrics = step(state, batch)
        if on_step is not None:
            on_step(job, metrics)
    return state


def upcoming(job: ElasticJob, events, changes: int = 2) -> list[tuple[int, ...]]:
    """The device ids ``job`` will have after each of the next ``changes`` step boundaries of
    ``events`` (events at one boundary are applied together: only the last set is run), from the
    devices it has now; fewer when the events end or one would leave the job no device. Events
    posted but not applied yet (waiting for their step, ``JobOptions.notice_seconds``) come first,
    as one boundary."""
    ids, sets = tuple(job.ptc.device_ids), []
    for e in list(job._pending):
        try:
            ids = job.devices_after(e.kind, e.devices, e.count, current=ids)
        except LayoutError:
            return sets
    if job._pending:
        sets.append(ids)
    for i, e in enumerate(events):
        if len(sets) == changes:
            break
        try:
            ids = job.devices_after(e.kind, e.devices, e.count, current=ids)
        except LayoutError:  # the event itself raises it when it is applied
            break
        if i + 1 == len(events) or events[i + 1].step != e.step:
            sets.append(ids)
            if len(sets) == changes:
                break
    return sets


@dataclasses.dataclass(frozen=True)
class RestartCosts:
    """Measured costs of the checkpoint-restart policy: one save, and per config (its string)
    a restore onto it and a fresh compile of its step."""

    save_seconds: float
    restore_seconds: Mapping[str, float]
    compile_seconds: Mapping[str, float]


def checkpoint_restart(
    records: list[EventRecord],
    step_seconds: Mapping[str, float],
    costs: RestartCosts,
    *,
    steps: int,
    checkpoint_every: int | None,
    useful_seconds: float,
    wall_seconds: float,
    elastic_overhead_seconds: float,
) -> dict:
    """The same events under save → restart → restore: seconds, goodput and per-event costs.

    Both are measured from the end of the first step: the start-up (placing the state, the first
    compile, the checkpoint of step 0) is the same under both policies. The job runs the same
    layouts, steps and batches as the elastic run, so its time is the elastic run's
    ``wall_seconds`` less what the elastic policy spent on events and checkpoints
    (``elastic_overhead_seconds``) plus what this policy spends. Each event costs: a preemption
    notice, a save, a restore onto the new layout and a fresh compile; a failure (no notice) the
    restore, the compile and rerunning the steps since the last periodic checkpoint (every
    ``checkpoint_every`` steps from step 0, at the new layout's ``step_seconds``); a growth the
    elastic run took, a save, a restore and a compile; a declined growth nothing. Periodic saves
    after step 0 cost one save each.
    """
    per_event, spent = [], 0.0
    every = checkpoint_every or math.inf
    for r in records:
        cost = {"save": 0.0, "restore": 0.0, "compile": 0.0, "lost_steps": 0, "rerun": 0.0}
        if r.decision != Decision.STAY:
            last = 0 if every == math.inf else r.step // every * every
            lost = r.step - last if r.kind == EventKind.FAIL else 0
            cost = {
                "save": costs.save_seconds if r.kind != EventKind.FAIL else 0.0,
                "restore": costs.restore_seconds[r.config_after],
                "compile": costs.compile_seconds[r.config_after],
                "lost_steps": lost,
                "rerun": lost * step_seconds.get(r.config_after, 0.0),
            }
        cost["seconds"] = cost["save"] + cost["restore"] + cost["compile"] + cost["rerun"]
        spent += cost["seconds"]
        per_event.append(cost)
    saves = 0 if every == math.inf else (steps - 1) // every  # step 0's is start-up
    spent += saves * costs.save_seconds
    total = wall_seconds - elastic_overhead_seconds + spent
    return {
        "seconds": total,
        "goodput": useful_seconds / total,
        "event_seconds": spent,
        "periodic_saves": saves,
        "events": per_event,
    }


def elastic_overhead(job: ElasticJob) -> float:
    """Seconds the elastic run spent on its events and checkpoints after its first step.

    The checkpoint of step 0 belongs to the start-up (it overlaps the first compile), which both
    policies share and the goodput leaves out.
    """
    events = sum(
        r.plan_seconds + r.reshard_seconds + r.compile_wait_seconds + r.restore_seconds
        for r in job.records
    )
    saves = sum(s for step, s in job.checkpoints if step > 0)
    return events + saves + job.lost_seconds
