"""``ElasticJob``: the user's Flax loop keeps training while its devices change.

The job (the shared core in ``core.py``) applies the events posted since the last step (the rules
in ``events.py``) at the next ``job.next``: a plan and a reshard onto the new devices, or the
latest checkpoint when some shard is lost; the new layout's step comes from the step cache. What
``ElasticJob(...)`` builds in a runtime's processes is set with :func:`use_job_class` alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import pathlib
import signal
import time
from collections.abc import Callable, Iterable

import numpy as np

from tenplex_jax._src.elastic import events
from tenplex_jax._src.elastic.core import _JobCore
from tenplex_jax._src.elastic.events import (
    DECISIONS,
    Compilation,
    Decision,
    Event,
    EventKind,
    EventRecord,
)
from tenplex_jax._src.elastic.steps import Status
from tenplex_jax._src.errors import DataError, LayoutError, LostShardsError
from tenplex_jax._src.executor import reshard
from tenplex_jax._src.plan import allocate, make_plan
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.planner.growth import Growth, growth
from tenplex_jax._src.planner.search import choose
from tenplex_jax._src.ptc import PTC, ParallelConfig

__all__ = ["ElasticJob", "EventRecord", "use_job_class"]

# what ElasticJob(...) builds in this process, when a runtime said (use_job_class); None: itself
_job_class: type | None = None
TARGETS_KEPT = 64  # the layouts a job remembers allocating (a change: ahead, asked, applied)


class ElasticJob(_JobCore):
    """One training job whose devices change between steps: its layout, data, compiled steps.

    The user keeps their own step and loop; the job lays the state out, hands out each global
    batch laid out for the current devices, and applies the events posted since the last step
    at the next step boundary::

        with tj.ElasticJob(rules, tj.DatasetPTC(samples, global_batch=24), grad_units=8) as job:
            state = job.start(init)              # init() -> nnx.state({"model": .., ...})
            step = job.jit(train_step)           # train_step(state, batch) -> (state, metrics)
            with job.handle_sigterm():           # SIGTERM: a preemption notice
                while job.step < 1000:
                    state, batch = job.next(state)   # pending events, then the next batch
                    state, metrics = step(state, batch)
            job.finish(state)

    A context manager: leaving it stops the compile threads. Steps are dispatched
    asynchronously; the first on each layout is waited for (it ends an event's stall and gives
    the step time growth weighs). Compiled steps are cached per (config, device order, batch
    layout), so returning to an earlier layout does not recompile.

    **Launched.** Inside :func:`use_job_class` (a runtime's entry point: ``tenplex-jax
    launch`` runs the script inside ``use_job_class(tj.multihost.LaunchedJob)``),
    ``ElasticJob(...)`` returns that class's job, fully built from the same arguments, as
    ``pathlib.Path()`` returns a ``PosixPath``; it is not an instance of ``ElasticJob``. Test
    ``job.launched``.

    Args:
      rules: the logical-axis rules of the state (``tj.typing.Rules``).
      dataset: the :class:`tenplex_jax.DatasetPTC` serving the global batches; its ``step`` is
        the job's step.
      devices: every device the job may ever use (default ``jax.devices()``).
      initial: the ids of the devices it starts on (default all of ``devices``).
      grad_units: gradient units: the global batch is cut into that many equal units whose
        gradients are computed alone and summed in a fixed order, which makes the params
        bitwise equal across data-parallel and FSDP sizes (default None: plain data
        parallelism, one sample per unit).
      config: ``config(n) -> ParallelConfig`` for ``n`` devices, raising
        ``tj.errors.LayoutError`` when it has none (default ``tj.planner.choose_config``).
      steps: the run's length in steps: growth weighs its gain over the remaining steps.
      checkpoint_dir: orbax checkpoints go here; ``start`` resumes from the latest one; a failure
        no replica survives restores it; a preemption saves one (after the first step on the
        new layout).
      checkpoint_every: save every that many steps (with ``checkpoint_dir``).
      options: a :class:`tenplex_jax.elastic.JobOptions` (compile-ahead, preemption size,
        reshard method, batch axes, step timing, planner profile, log).

    Raises:
      LayoutError: ``options`` is not a ``JobOptions``.
    """

    launched = False
    # a launched job's, for scripts that run in both settings: one process is process 0 of
    # generation 0, with no run directory and nothing restored by a launcher
    process_index = 0
    generation = 0
    run_dir: pathlib.Path | None = None
    restored: dict | None = None

    def __new__(cls, *args, **kwargs):
        if cls is ElasticJob and _job_class is not None:  # a runtime's process (use_job_class)
            return _job_class(*args, **kwargs)  # not an ElasticJob: Python skips __init__
        return super().__new__(cls)

    @functools.wraps(_JobCore.__init__)  # the one signature, which inspect shows
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: set[int] = set()
        self.records: list[EventRecord] = []
        self.cache_hits = 0  # reconfigurations whose step was already compiled
        self.lost_seconds = 0.0  # step time thrown away by checkpoint fallbacks
        self.checkpoints: list[tuple[int, float]] = []  # (step, seconds) of every save
        self._saving = None  # the checkpoint being written in the background, if any
        # a preemption's record whose checkpoint is saved at the next boundary without a change
        self._preempted: EventRecord | None = None
        self._save_due = False  # a periodic checkpoint is due (deferred past a change)
        self.resumed: int | None = None  # the checkpoint step start() restored, if any
        self._pending: collections.deque[Event] = collections.deque()
        # the event waiting for its layout's step (notice_seconds): (event, step, target)
        self._notice: tuple[Event, int, PTC] | None = None
        self._hints: list[tuple[int, ...]] = []  # announced device sets, in the order of use
        self._outstanding: tuple[tuple[int, ...], ...] = ()  # those compiled ahead, not reached
        self._guessed: tuple[int, ...] | None = None  # the devices the last guess was made on
        # the layouts _target allocated, by (layout before, config, devices after): the same
        # change is allocated when compiled ahead, asked about and applied (milliseconds each)
        self._targets: collections.OrderedDict[tuple, PTC] = collections.OrderedDict()
        device_type = self.options.device_type
        self._bandwidth = device_type.link_bandwidth if device_type is not None else 1e9

    # -- the user's side --------------------------------------------------------------------------

    def jit(self, fn: Callable, *, program: str | None = None) -> Callable:
        """Compile the user's step per layout, and ahead for the likely next layouts.

        Args:
          fn: ``fn(state, batch) -> (state, metrics)``, any JAX code.
          program: a name for ``fn``'s code, the same in every process that runs it: with
            ``executable_cache``, a new process loads the steps stored there untraced, where an
            unnamed step is traced once per layout in each process. The name is your promise
            that the code is the same: give new code a new name (docs/elastic.md, "Compiled
            steps and stalls").

        Returns:
          ``step(state, batch) -> (state, metrics)`` for ``job.next``'s state and batch; the
          state is donated and the metrics come back replicated.

        Raises:
          LayoutError: called before ``job.start``, or a ``program`` that is not a non-empty str.

        With ``options.compile_ahead``, a background thread compiles the steps of the layouts
        announced by ``job.expect`` (the last two, in order), each for the exact layout the change
        will pick. When nothing announced is outstanding, a step boundary starts the guess: the
        step of ``options.preempt_devices`` devices fewer, on its own thread. JAX's persistent
        compilation cache is the user's to turn on (``tj.elastic.enable_compilation_cache``).
        """
        run = super().jit(fn, program=program)
        self._ahead()
        return run

    def next(self, state):
        """The step boundary, then the next global batch.

        At the boundary the events posted since the last one are applied in order (each a plan
        and a reshard onto the new devices, or a checkpoint restore) and, every
        ``checkpoint_every`` steps, a checkpoint is saved (at a boundary with a change, at the
        next one without, as a preemption's).

        Args:
          state: the state the last step returned (or ``start``'s).

        Returns:
          ``(state, batch)``: the state on the job's current devices and a
          :class:`tenplex_jax.Batch` laid out for them; ``job.samples`` holds the sample index
          of each of its rows (-1 for padding)::

              state, batch = job.next(state)
              state, metrics = step(state, batch)

        Raises:
          LayoutError: called before ``job.start``, or an event asks for devices with no layout.
          LostShardsError: a failure took shards no replica holds, and there is no checkpoint.
        """
        if self.ptc is None:
            raise LayoutError("call job.start(init) before job.next(state)")
        changed = False
        while self._pending and not self._waits(self._pending[0]):
            event, notice_steps = self._pending.popleft(), 0
            if self._notice is not None and self._notice[0] is event:  # it waited: the job
                notice_steps = self.step - self._notice[1]  # trained on; it stalls from now
                event, self._notice = dataclasses.replace(event, posted=time.perf_counter()), None
            state = self._apply(state, event, notice_steps)
            changed = True
        every = self.checkpoint_every
        if self.checkpoint_dir is not None:
            if every and self.step % every == 0:  # due, unless saved before a rewind
                self._save_due |= all(step != self.step for step, _ in self.checkpoints)
            # at a boundary without a change: written beside a change's first step, a checkpoint
            # would take that step's CPU and lengthen the stall (a preemption's is saved after
            # the first step on the new layout)
            if not changed and (self._save_due or self._preempted is not None):
                seconds, self._save_due = self._save(state), False
                if self._preempted is not None:
                    self._preempted.commit_seconds, self._preempted = seconds, None
        if not changed and not self._pending:  # not beside a change's first step or its compile
            self._guess()
        return state, self._batch()

    def finish(self, state) -> None:
        """The end of training: a final checkpoint, with ``checkpoint_dir``.

        Args:
          state: the state the last step returned.
        """
        if self.checkpoint_dir is not None:
            self._save(state, wait=True)
        self.wait()

    def wait(self) -> None:
        """Finish the checkpoint being written in the background, if any (raises what it
        raised): the periodic and preemption checkpoints are copied off the devices at the step
        boundary and written while training goes on."""
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.wait()

    def close(self) -> None:
        """Finish the checkpoint in flight, then stop the compile threads."""
        try:
            self.wait()
        finally:
            super().close()

    def preempt(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Post a preemption notice: at the next step boundary the job shrinks onto the devices
        that remain and, with ``checkpoint_dir``, saves a checkpoint.

        Args:
          devices: the ids that go (default: the job's last ``count`` devices, highest ids first).
          count: how many go when ``devices`` is None (default ``options.preempt_devices``).

        Safe to call from a signal handler or another thread. For example::

            job.preempt([6, 7])       # devices 6 and 7 go
            job.preempt(count=2)      # the job's two highest-numbered devices go
        """
        self._post(EventKind.PREEMPT, devices, count)

    def fail(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Post a failure: the devices' buffers are gone. At the next boundary the plan rebuilds
        their shards from surviving replicas (it never reads a failed device); when some shard
        has none, the job restores the latest checkpoint onto the remaining devices, rewinds the
        dataset and records the lost steps, or raises ``tj.errors.LostShardsError`` naming the
        leaves when there is no checkpoint.

        Args:
          devices: the failed ids (default: the job's last ``count`` devices).
          count: how many failed when ``devices`` is None (default ``options.preempt_devices``).
        """
        self._post(EventKind.FAIL, devices, count)

    def offer(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Offer devices: at the next boundary the job grows onto them when the estimated gain
        over the remaining ``steps`` exceeds the estimated cost (the plan's bytes over the
        bandwidth, plus the compile unless the step is compiled). ``record.estimate`` holds the
        numbers (step times from the planner with ``options.profile`` and
        ``options.device_type``, else measured ones scaled by the device count).

        Args:
          devices: the offered ids (default: the ``count`` lowest-numbered unused devices).
          count: how many are offered when ``devices`` is None.
        """
        self._post(EventKind.OFFER, devices, count)

    def redeploy(self, devices: Iterable[int]) -> None:
        """Move onto exactly ``devices`` (ids) at the next step boundary: a scheduler's order."""
        self._post(EventKind.REDEPLOY, devices, None)

    def expect(self, devices: Iterable[int]) -> None:
        """An announcement: the job will run on ``devices`` (ids) next, so the step of the layout
        it will then use (the config of that many devices, the device order ``allocate`` picks,
        the batch layout) is compiled ahead, with ``options.compile_ahead``. The last two
        announcements are kept, in the order the job will move through them: the second's device
        order is allocated from the first's layout. One is dropped once the job runs on its
        devices; while one is outstanding no guess is compiled::

            job.expect(range(6))      # a scheduler announces the next allocation
            job.expect(range(4))      # ... and the one after it
        """
        ids = tuple(sorted(devices))
        self._hints = [h for h in self._hints if h != ids][-1:] + [ids]  # the last two, in order
        self._ahead()

    @contextlib.contextmanager
    def handle_sigterm(self):
        """While inside, SIGTERM posts a preemption notice without device names (the job's last
        ``options.preempt_devices`` devices go). Main thread only; the previous handler is
        restored on exit. Yields the job."""
        previous = signal.signal(
            signal.SIGTERM, lambda *_: self._post(EventKind.PREEMPT, None, None, "SIGTERM")
        )
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def devices_after(
        self, kind: EventKind | str, devices=None, count: int | None = None, *, current=None
    ) -> tuple[int, ...]:
        """The device ids the job would ask for after an event of ``kind`` (before a growth
        decision), from its current devices or from ``current``::

            job.devices_after("preempt", count=2)    # (0, 1, 2, 3, 4, 5) on devices 0..7
        """
        return events.devices_after(
            kind,
            self.ptc.device_ids if current is None else current,
            devices,
            count,
            usable=self.devices,
            failed=self.failed,
            default_count=self.options.preempt_devices,
        )

    def is_compiled(self, devices: Iterable[int]) -> bool:
        """Whether the step for the layout the job would use on ``devices`` is compiled."""
        return self.steps_cache.ready(self._key(self._target(tuple(sorted(devices)))))

    def compile_seconds(self, devices: Iterable[int]) -> float:
        """Compile the step afresh for the layout the job would use on ``devices`` (bypassing the
        job's cache; JAX's own caches still apply) and return XLA's seconds: a cost-model input."""
        target = self._target(tuple(sorted(devices)))
        return self.steps_cache.compile(target, self._layout(target.config), load=False).seconds

    # -- the core's hooks -------------------------------------------------------------------------

    def _restore_or_build(self, build):
        """The latest checkpoint under ``checkpoint_dir``, with its dataset cursor; else
        ``build()``."""
        if self.checkpoint_dir is None:
            return build()
        from tenplex_jax._src.checkpoint import latest_checkpoint, restore_checkpoint

        latest = latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            return build()
        restored = restore_checkpoint(self.checkpoint_dir, self.ptc, step=latest, verify=False)
        if restored.data_state is None:
            raise DataError(f"checkpoint {latest} in {self.checkpoint_dir} has no data state")
        self.dataset.restore(restored.data_state)
        self.resumed = latest
        self.checkpoints.append((latest, 0.0))  # already saved: not saved again
        self.log(f"resumed from checkpoint {latest} in {self.checkpoint_dir}")
        return restored.state

    def _after_step(self) -> None:
        """Nothing: the step is recorded by its timing alone."""

    # -- events -----------------------------------------------------------------------------------

    def _post(self, kind: EventKind, devices, count, source="api"):
        ids = None if devices is None else tuple(int(d) for d in devices)
        event = Event(kind=kind, devices=ids, count=count, source=source)
        self._pending.append(event)  # deque.append: signal-safe

    def _waits(self, event: Event) -> bool:
        """Whether ``event`` waits at this boundary for its layout's step (``notice_seconds``):
        a notice or a redeploy, the only event posted, within its time, whose step is not ready.
        The first time it waits, its step is queued ahead unless something compiles it."""
        if (
            event.kind not in (EventKind.PREEMPT, EventKind.REDEPLOY)
            or len(self._pending) > 1
            or self.steps_cache is None
            or time.perf_counter() - event.posted >= self.options.notice_seconds
        ):
            return False
        if self._notice is None or self._notice[0] is not event:
            ids = self.devices_after(event.kind, event.devices, event.count)
            if set(ids) == set(self.ptc.device_ids):
                return False
            try:
                target = self._target(ids)
            except (LayoutError, DataError):
                return False  # applied now, where the error is raised
            self._notice = (event, self.step, target)
        target = self._notice[2]
        key = self._key(target)
        if self.steps_cache.ready(key):
            return False
        if self.steps_cache.status(key) in (None, Status.FAILED):  # never submitted, or cancelled
            self.steps_cache.get(
                target, self._layout(target.config), ahead=True, warm=self.options.warm_up
            )
        return True

    def _apply(self, state, event: Event, notice_steps: int = 0):
        """One event at this boundary: the job moves onto the devices it leaves (a reshard, or a
        checkpoint restore) or stays; its record is appended to ``job.records``."""
        before = self.ptc
        ids = self.devices_after(event.kind, event.devices, event.count)
        record = EventRecord(
            step=self.step,
            kind=event.kind,
            source=event.source,
            devices_before=list(before.device_ids),
            devices_after=list(ids),
            config_before=str(before.config),
            config_after=str(before.config),
            decision=Decision.STAY,
            notice_steps=notice_steps,
        )
        failed = ()
        if event.kind == EventKind.FAIL:
            failed = tuple(sorted(set(before.device_ids) - set(ids)))
            self.failed |= set(event.devices or failed)
        moved = set(ids) != set(before.device_ids)  # else nothing the job runs on changes
        if moved:
            tic = time.perf_counter()
            target = self._target(ids)
            state, moved = self._move(state, event, target, failed, record, tic)
        if moved:
            self._arrive(state, event, target, record)
        else:
            self.records.append(record)
        return state

    def _move(self, state, event: Event, target: PTC, failed, record: EventRecord, tic: float):
        """The state onto ``target``: a plan and a reshard, or the latest checkpoint when some
        shard is lost; ``(state, False)`` for an offer whose growth does not pay."""
        try:
            plan = make_plan(self.ptc, target, failed=failed)
        except LostShardsError as error:
            record.error = str(error)
            return self._fall_back(state, target, error, record), True
        record.plan_seconds = time.perf_counter() - tic
        if event.kind == EventKind.OFFER:
            record.estimate = self._estimate(target, plan)
            if not record.estimate.grow:
                record.devices_after = list(self.ptc.device_ids)
                return state, False
        # after a failure the old arrays are not donated: deleting them would touch the failed
        # devices' buffers; they are freed when the caller rebinds the state
        state, report = reshard(state, plan, method=self.options.method, donate=not failed)
        record.bytes_moved, record.bytes_kept = report.bytes_moved, report.bytes_kept
        record.reshard_seconds = report.seconds
        if report.seconds > 0 and report.bytes_moved:
            self._bandwidth = report.bytes_moved / report.seconds
        record.decision = DECISIONS[event.kind]
        return state, True

    def _arrive(self, state, event: Event, target: PTC, record: EventRecord) -> None:
        """The job on ``target``: its step (cached, waited for or compiled now), a preemption's
        checkpoint, the record, and compile-ahead from the new layout."""
        before, self.ptc = self.ptc.config, target
        reached = tuple(sorted(target.device_ids))
        if reached in self._hints:  # announced: it and those announced before it are done
            self._hints = self._hints[self._hints.index(reached) + 1 :]
        record.devices_after, record.config_after = list(target.device_ids), str(target.config)
        status = self.steps_cache.status(self._key(target))
        record.compile = {Status.READY: Compilation.CACHED, Status.RUNNING: Compilation.WAITED}.get(
            status, Compilation.COMPILED
        )
        self.cache_hits += record.compile != Compilation.COMPILED
        tic = time.perf_counter()
        compiled = self._compiled(target, ahead=False).result()
        record.compile_wait_seconds = time.perf_counter() - tic
        record.compile_seconds = compiled.seconds
        record.warm_up_seconds = compiled.warm_up_seconds
        record.bitwise = self.is_bitwise(before, target.config)
        if event.kind == EventKind.PREEMPT and self.checkpoint_dir is not None:
            self._preempted = record
        self.log(
            f"step {record.step}: {event.kind} ({event.source}) {record.config_before} on "
            f"{len(record.devices_before)} -> {record.config_after} on {len(reached)}: "
            f"{record.decision}, moved {record.bytes_moved / 2**20:.3f} MiB, step {record.compile}"
        )
        self.records.append(record)
        self._stalled = (record, event.posted)
        self._ahead()

    def _target(self, ids: tuple[int, ...], before: PTC | None = None) -> PTC:
        """The layout the job moves to on ``ids`` from ``before`` (default its current one): the
        config of ``len(ids)`` devices, in the device order that keeps the most bytes in place.
        Allocated once per (layout before, config, devices): compile-ahead, ``is_compiled`` and
        the change itself ask for the same one."""
        before = self.ptc if before is None else before
        config = self.config_for(len(ids))
        key = (before.config, before.device_ids, before.hosts, config, tuple(ids))
        target = self._targets.get(key)
        if target is None:
            target = allocate(before, before.relayout(config, [self.devices[i] for i in ids]))
            self._targets[key] = target
            if len(self._targets) > TARGETS_KEPT:
                self._targets.popitem(last=False)
        return target

    def _fall_back(self, state, target: PTC, error: LostShardsError, record: EventRecord):
        """Restore the latest checkpoint onto ``target``; re-raise ``error`` when there is none."""
        from tenplex_jax._src.checkpoint import latest_checkpoint, restore_checkpoint

        self.wait()  # a checkpoint still being written is the newest one
        latest = None if self.checkpoint_dir is None else latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            raise error
        self.log(f"step {self.step}: {error}; restoring checkpoint {latest}")
        tic = time.perf_counter()
        restored = restore_checkpoint(self.checkpoint_dir, target, step=latest, verify=False)
        if restored.data_state is None:
            raise DataError(f"checkpoint {latest} in {self.checkpoint_dir} has no data state")
        lost = self.step - restored.step
        self.dataset.restore(restored.data_state)
        record.restore_seconds = time.perf_counter() - tic
        record.lost_steps, record.decision = lost, Decision.RESTORE
        self.lost_seconds += sum(s for i, s, _ in self.step_log if i >= self.step)
        self.checkpoints = [c for c in self.checkpoints if c[0] <= self.step]
        self.step_log = [entry for entry in self.step_log if entry[0] < self.step]
        return restored.state

    def _estimate(self, target: PTC, plan) -> Growth:
        """Grow now? The estimated gain over the remaining steps against the reconfiguration."""
        old, new = self.ptc.config, target.config
        profile, device_type = self.options.profile, self.options.device_type
        if profile is not None and device_type is not None:
            source = "planner"
            t_old, t_new = (self._step_estimate(c) for c in (old, new))
        else:
            source = "measured, scaled by the device count"
            recent = [s for _, s, c in self.step_log[-5:] if c == str(old)]
            t_old = float(np.median(recent)) if recent else 0.0
            t_new = t_old * old.num_devices / new.num_devices
        ready = self.steps_cache.ready(self._key(target))
        return growth(
            step_seconds_now=t_old,
            step_seconds_new=t_new,
            remaining_steps=None if self.steps is None else max(self.steps - self.step, 0),
            bytes_moved=plan.bytes_moved,
            bandwidth=self._bandwidth,
            compile_seconds=max((c.seconds for c in self.steps_cache.done()), default=0.0),
            compiled_ahead=ready,
            source=source,
        )

    def _step_estimate(self, config: ParallelConfig) -> float:
        n = config.num_devices
        cluster = Cluster.uniform(n, self.options.device_type, per_node=n)
        choice = choose(cluster, self.options.profile, self.dataset.global_batch, configs=[config])
        return choice.best.step_time

    def _save(self, state, *, wait: bool = False) -> float:
        """Save the state at this step (once: a step already saved, e.g. before a rewind,
        stays): copied off the devices now and, unless ``wait``, written in the background
        while training goes on (one save in flight at a time). Returns the seconds the
        boundary waited."""
        from tenplex_jax._src.checkpoint import save_checkpoint

        if any(step == self.step for step, _ in self.checkpoints):
            return 0.0
        tic = time.perf_counter()
        self.wait()
        self._saving = save_checkpoint(
            self.checkpoint_dir,
            state,
            self.ptc,
            step=self.step,
            data_state=self.dataset.state(),
            wait=wait,
        )
        if wait:
            self._saving = None
        seconds = time.perf_counter() - tic
        self.checkpoints.append((self.step, seconds))
        return seconds

    # -- compile-ahead ----------------------------------------------------------------------------

    def _ahead(self) -> None:
        """Compile, on the announced layouts' thread, the steps of the announced layouts, in order.

        Each target is the layout the change will pick: its device order is allocated from the
        layout before it (the current one, or the announced one before), as ``_apply`` will, so
        the key compiled ahead is the key the change uses.
        """
        if not self.options.compile_ahead or self.steps_cache is None:
            return
        self.steps_cache.cancel_queued()  # resubmitted below, in this order
        self._guessed = None  # a queued guess was cancelled too: the next boundary decides again
        targets = self._announced()
        self._outstanding = tuple(tuple(sorted(t.device_ids)) for t in targets)
        for target in targets:
            self.steps_cache.get(
                target, self._layout(target.config), ahead=True, warm=self.options.warm_up
            )

    def _announced(self) -> list[PTC]:
        """The layouts of the outstanding announcements, each allocated from the one before."""
        before, targets = self.ptc, []
        for ids in self._hints:
            if ids == tuple(sorted(before.device_ids)) or not self._usable(ids):
                continue
            try:
                target = self._target(ids, before)
            except (LayoutError, DataError) as error:  # no layout for these devices
                self.log(f"compile-ahead for devices {list(ids)} skipped: {error}")
                continue
            targets.append(target)
            before = target
        return targets

    def _usable(self, ids) -> bool:
        return not set(ids) & self.failed and set(ids) <= set(self.devices)

    def _guess(self) -> None:
        """At a step boundary, with nothing announced outstanding: compile the step of
        ``options.preempt_devices`` devices fewer (what a notice without names leaves), once per
        layout, on the guesses' thread. A guess never starts while an announced layout is
        outstanding: on two cores it would take the announced compile's CPU."""
        current = tuple(sorted(self.ptc.device_ids))
        if (
            not self.options.compile_ahead
            or self.steps_cache is None
            or self._guessed == current
            or len(current) <= self.options.preempt_devices
            or self._outstanding
        ):
            return
        self._guessed = current
        ids = self.devices_after(EventKind.PREEMPT)
        try:
            target = self._target(ids)
        except (LayoutError, DataError) as error:  # no layout for these devices
            self.log(f"compile-ahead for devices {list(ids)} skipped: {error}")
            return
        layout = self._layout(target.config)
        self.steps_cache.get(target, layout, ahead=True, guess=True, warm=self.options.warm_up)


@contextlib.contextmanager
def use_job_class(job_class: type):
    """Within the block, ``tj.ElasticJob(...)`` builds ``job_class(...)`` from the same arguments.

    How a runtime runs a script written for one process, unchanged, in processes of its own:
    ``tenplex-jax launch`` (locally or on Ray) runs each process's script inside
    ``use_job_class(tj.multihost.LaunchedJob)``. Outside such a block ``ElasticJob(...)`` is the
    one-process job; nothing else (no environment variable) switches it::

        with tj.elastic.use_job_class(MyRuntimeJob):
            runpy.run_path("train.py", run_name="__main__")   # its ElasticJob(...) is MyRuntimeJob

    Args:
      job_class: a class taking ``ElasticJob``'s arguments (``rules, dataset, **kwargs``).

    The setting is the process's (the script's threads see it too); blocks nest, the innermost
    winning, and leaving one puts back what was there before.
    """
    global _job_class
    before, _job_class = _job_class, job_class
    try:
        yield job_class
    finally:
        _job_class = before
