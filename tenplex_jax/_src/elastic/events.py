"""Events of an elastic job: what changes its devices, what each change did, and the rules.

An :class:`Event` is posted at any time and applied at the next step boundary; its
:class:`EventKind` is one of:

- ``preempt``: a preemption notice; the devices go, the job shrinks onto the rest;
- ``fail``: the devices' buffers are gone; their shards are rebuilt from surviving replicas;
- ``offer``: devices are offered; the job grows onto them when that pays (:func:`growth`);
- ``redeploy``: the job moves onto exactly the given devices (a scheduler's order).

Each one becomes an :class:`EventRecord`. These are pure values and functions: no devices.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Iterable

from tenplex_jax._src.errors import LayoutError
from tenplex_jax._src.planner.growth import Growth


class EventKind(enum.StrEnum):
    """What changes a job's devices (the module docstring says what each one does)."""

    PREEMPT = "preempt"
    FAIL = "fail"
    OFFER = "offer"
    REDEPLOY = "redeploy"


class Decision(enum.StrEnum):
    """What a job did about an event: ``shrink`` (a preemption), ``rebuild`` (a failure whose
    shards survive on replicas), ``restore`` (a failure that fell back to the latest checkpoint),
    ``grow`` (an offer taken), ``move`` (a redeploy) and ``stay`` (an offer declined, or an event
    that leaves the job's devices as they were)."""

    SHRINK = "shrink"
    REBUILD = "rebuild"
    RESTORE = "restore"
    GROW = "grow"
    MOVE = "move"
    STAY = "stay"


class Compilation(enum.StrEnum):
    """How the new layout's step was had at an event (:attr:`EventRecord.compile`)."""

    CACHED = "cached"
    WAITED = "waited"
    COMPILED = "compiled"


@dataclasses.dataclass(frozen=True)
class Event:
    """A change of the job's devices, applied at the next step boundary."""

    kind: EventKind
    devices: tuple[int, ...] | None  # None: by the rule (the job's last `count` / lowest free)
    count: int | None = None
    source: str = "api"
    posted: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass(kw_only=True)
class EventRecord:
    """What one event did at a step boundary; ``dataclasses.asdict`` gives its JSON.

    :class:`tenplex_jax.ElasticJob` appends one to ``job.records`` per event it applies, in order.
    A ``stay`` record leaves the reshard, compile, commit and stall fields at their defaults.

    Attributes:
      step: ``job.step`` at the boundary the event was applied at (the index of the step that
        boundary precedes; a ``restore`` then rewinds the job by ``lost_steps``).
      kind: the event's :class:`EventKind`.
      source: who posted it: ``"api"`` (``job.preempt`` and the other methods) or ``"SIGTERM"``
        (under ``job.handle_sigterm()``).
      devices_before: the job's device ids before the event, in mesh order.
      devices_after: the job's device ids after it, in the new mesh's order (the ones before on a
        ``stay``).
      config_before: the parallel config before the event (``str(ParallelConfig)``, e.g.
        ``data=4,fsdp=2``).
      config_after: the parallel config after it (the one before on a ``stay``).
      decision: what the job did, a :class:`Decision`.
      bytes_moved: bytes the reshard copied from one device to another (0 on a ``restore``).
      bytes_kept: bytes of the new shards that stayed on their device.
      plan_seconds: the time to allocate the new layout and make the plan (0 on a ``restore``,
        whose plan failed).
      reshard_seconds: the wall time of the reshard's copies.
      compile: how the new layout's step was had, a :class:`Compilation`: ``"cached"``
        (compiled before or ahead), ``"waited"`` (compile-ahead was compiling it), ``"compiled"``
        (compiled at the boundary); None on a ``stay``.
      compile_seconds: what XLA took to compile the new layout's step, wherever and whenever it
        ran.
      compile_wait_seconds: how long the boundary waited for that step (the whole compile when
        ``compile`` is ``"compiled"``, nearly 0 when ``"cached"``).
      warm_up_seconds: the run of the new layout's step on zero inputs, ahead on the compile
        thread, that did its executable's one-time work before the first step
        (``JobOptions.warm_up``); None when it did not run (compiled at the boundary, the option
        off, a layout over several processes).
      commit_seconds: the time the boundary took to save the checkpoint a preemption saves
        (with ``checkpoint_dir``; 0 when that step was already saved). It is saved at the next
        boundary without a change, after the first step on the new layout, so it is not part
        of the stall.
      restore_seconds: the time a ``restore`` took to read the checkpoint onto the new layout.
      lost_steps: the steps a ``restore`` rewound, to rerun from the checkpoint's step.
      notice_steps: the steps the job trained on its devices after the event was posted, while
        the new layout's step compiled (``JobOptions.notice_seconds``); its stall counts from the
        boundary it was applied at.
      batch_seconds: the time to read the first global batch on the new layout and place it on
        its mesh (part of the stall).
      dispatch_seconds: the time the first step on the new layout took to dispatch (the
        executable's call until it returned, before its results were ready).
      first_step_seconds: from that call to the first step's results ready (dispatch included).
        The stall is ``plan + reshard + compile_wait + commit + batch + first_step`` and what the
        loop and the user's code did between them.
      stall_seconds: from the event's posting to the end of the first step on the new layout
        (that step is waited for); None on a ``stay``, until that step has run, and for an event
        another one follows at the same boundary (the stall is the last one's).
      estimate: an offer's growth decision and the numbers behind it
        (:class:`tenplex_jax.planner.Growth`); None for the other kinds and for an offer that
        adds no device.
      error: the ``LostShardsError`` message that made a failure fall back to the checkpoint;
        None otherwise.
      bitwise: whether training after the change has the bits it would have had without it
        (``JobOptions.bitwise``; ``job.not_bitwise`` says why not); None on a ``stay``.
    """

    step: int
    kind: EventKind
    source: str
    devices_before: list[int]
    devices_after: list[int]
    config_before: str
    config_after: str
    decision: Decision
    bytes_moved: int = 0
    bytes_kept: int = 0
    plan_seconds: float = 0.0
    reshard_seconds: float = 0.0
    compile: Compilation | None = None
    compile_seconds: float = 0.0  # what XLA took for the new layout's step, wherever it ran
    compile_wait_seconds: float = 0.0  # how long the boundary waited for it
    warm_up_seconds: float | None = None  # its run on zeros ahead (JobOptions.warm_up)
    commit_seconds: float = 0.0
    restore_seconds: float = 0.0
    lost_steps: int = 0
    notice_steps: int = 0  # steps trained on the old devices while the new layout compiled
    batch_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    first_step_seconds: float = 0.0
    stall_seconds: float | None = None  # event posted -> first step done on the new layout
    estimate: Growth | None = None
    error: str | None = None
    bitwise: bool | None = None


DECISIONS = {
    EventKind.PREEMPT: Decision.SHRINK,
    EventKind.FAIL: Decision.REBUILD,
    EventKind.OFFER: Decision.GROW,
    EventKind.REDEPLOY: Decision.MOVE,
}


def devices_after(
    kind: str,
    current: Iterable[int],
    devices: Iterable[int] | None,
    count: int | None,
    *,
    usable: Iterable[int],
    failed: Iterable[int] = (),
    default_count: int = 1,
) -> tuple[int, ...]:
    """The device ids a job on ``current`` asks for after an event (before a growth decision).

    A preemption or failure without ids takes the job's last ``count`` (default
    ``default_count``) devices, highest ids first, as when a scheduler reclaims the last host; an
    offer without ids gives the ``count`` lowest-numbered ``usable`` devices the job does not use.
    """
    current, failed, usable = set(current), set(failed), set(usable)
    if kind not in tuple(EventKind):
        kinds = tuple(k.value for k in EventKind)
        raise LayoutError(f"an event kind must be one of {kinds}, got {kind!r}")
    kind = EventKind(kind)
    if kind == EventKind.REDEPLOY:
        wanted = set(devices or ())
        bad = sorted(wanted - usable | wanted & failed)
        if not wanted or bad:
            raise LayoutError(
                f"a redeploy names the devices to move to, among the job's usable devices "
                f"{sorted(usable - failed)}; got {sorted(wanted)} (unusable: {bad})"
            )
        return tuple(sorted(wanted))
    if kind == EventKind.OFFER:
        free = sorted(usable - current - failed)
        offered = set(free[: count or 0] if devices is None else devices) - failed
        return tuple(sorted(current | offered))
    gone = set(sorted(current)[-(count or default_count) :] if devices is None else devices)
    left = tuple(sorted(current - gone))
    if not left:
        raise LayoutError(f"a {kind} of devices {sorted(gone)} leaves the job no device")
    return left
