"""``ElasticJob``: the user's Flax loop keeps training while its devices change.

The user keeps their own train step and their own loop; tenplex_jax owns the state's layout (its
PTC), the dataset PTC and the step's shardings, and applies reconfigurations between steps. The
same script runs in one process and as a process of ``tenplex-jax launch``::

    with tj.ElasticJob(rules, tj.DatasetPTC(samples, global_batch=24), workers=8) as job:
        state = job.start(init)              # init() -> nnx.state({"model": .., "optimizer": ..})
        step = job.jit(train_step)           # train_step(state, batch) -> (state, metrics)
        while job.step < 1000:
            state, batch = job.next(state)   # the step boundary: pending events, then a batch
            state, metrics = step(state, batch)
        job.finish(state)

    def train_step(state, batch):            # the user's step: any Flax NNX code
        nodes = nnx.merge(graphdef, state)
        loss, grads = batch.value_and_grad(example_losses)(nodes["model"])
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), {"loss": loss}

**Start.** ``job.start(init)`` lays the state out on the initial devices: restored from the latest
orbax checkpoint under ``checkpoint_dir`` when there is one (the dataset cursor with it), else
built by ``init()`` straight into the layout (``init`` may also be a state, which is placed).

**Events** are posted at any time (from a signal handler, another thread or the loop) and applied
at the next ``job.next`` (see ``tenplex_jax._src.elastic.events``):

- ``job.preempt(devices)``: a preemption notice; the job shrinks onto the devices that remain and
  saves a checkpoint when ``checkpoint_dir`` is set. SIGTERM under ``job.handle_sigterm()`` posts
  one without device names: the job's last ``preempt_devices`` devices (highest ids) go.
- ``job.fail(devices)``: the devices' buffers are gone. The plan rebuilds their shards from
  surviving replicas (``make_plan(..., failed=...)`` never reads a failed device). When some box has
  no replica, ``LostShardsError`` names the leaves; with a checkpoint the job restores the latest
  one onto the remaining devices, rewinds the dataset cursor and records the lost steps.
- ``job.offer(devices)``: the job grows when the estimated gain over the remaining steps (step
  times from the planner with ``profile`` and ``device_type``, else measured ones scaled by the
  device count) exceeds the estimated cost (the plan's bytes over the bandwidth, plus the compile
  unless the step is compiled). The decision and its numbers are recorded.
- ``job.redeploy(devices)``: move onto exactly these devices.

**Compiled steps** are cached per (parallel config, device order, batch layout): returning to an
earlier layout does not recompile. After every reconfiguration background threads compile
(``jit(...).lower(abstract state, abstract batch).compile()``) the likely next layouts: those
announced with ``job.expect(devices)`` (the last two, in order) and, once they are compiled or when
none is announced, one device fewer (on a thread of its own, so that a guess never delays an
announced layout). JAX's persistent compilation cache is the user's to turn on
(``tj.elastic.enable_compilation_cache``): the job changes no process-wide setting.

**Step times.** Steps are dispatched asynchronously. The first step on each layout is waited for
(it ends the event's stall and gives the measured step time growth decisions use);
``exact_step_times=True`` waits for every step and logs its time.

**Launched.** In a process of ``tenplex-jax launch`` the job runs on all the processes' devices;
``start`` restores from where the launcher says (the tensor stores, the orbax tier, or ``init``);
``next`` commits to the stores every ``--commit-every`` steps and, when the launcher ends the
generation (a planned resize or stop), commits synchronously and raises ``SystemExit(0)``: the next
generation resumes at that step. Devices change only by generation there, so ``preempt``,
``fail``, ``offer`` and ``redeploy`` refuse.

Every event becomes an ``EventRecord`` in ``job.records``: the decision, bytes moved, reshard and
compile seconds, lost steps, and the stall (from the event to the first step done on the new
layout).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import math
import os
import pathlib
import signal
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from tenplex_jax._src.batch import BATCH_AXES, Batch, device_batch
from tenplex_jax._src.data import BatchLayout, DatasetPTC
from tenplex_jax._src.elastic import events
from tenplex_jax._src.elastic.events import DECISIONS, KINDS, Event, EventRecord
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import DataError, LayoutError, LostShardsError
from tenplex_jax._src.executor import place, reshard
from tenplex_jax._src.plan import allocate, make_plan
from tenplex_jax._src.planner.cluster import Cluster, DeviceType
from tenplex_jax._src.planner.growth import growth
from tenplex_jax._src.planner.policy import choose_config
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import choose
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules

__all__ = ["KINDS", "ElasticJob", "EventRecord"]


class ElasticJob:
    """The layout, data and compiled steps of one training job whose devices change.

    ``rules`` are the logical-axis rules of the state; ``dataset`` serves the global batches
    (its ``step`` is the job's step). ``devices`` are all the devices the job may ever use
    (default ``jax.devices()``); it starts on ``initial`` (default all). ``config(n)`` picks the
    parallel config for ``n`` devices, raising ``tj.errors.LayoutError`` when it has none (default:
    ``tj.planner.choose_config``, which asks the planner when ``profile`` and ``device_type`` are
    given). ``workers`` sets virtual workers,
    which make the params bitwise equal across data-parallel and FSDP sizes. ``steps`` (the run's
    length) lets growth weigh its gain over the remaining steps. A context manager: leaving it
    stops the compile threads and, when launched, the commits' threads and connections.
    """

    def __init__(
        self,
        rules: Rules,
        dataset: DatasetPTC,
        *,
        devices: Sequence[jax.Device] | None = None,
        initial: Iterable[int] | None = None,
        workers: int | None = None,
        config: Callable[[int], ParallelConfig] | None = None,
        profile: ModelProfile | None = None,
        device_type: DeviceType | None = None,
        steps: int | None = None,
        checkpoint_dir: str | pathlib.Path | None = None,
        checkpoint_every: int | None = None,
        compile_ahead: bool = True,
        preempt_devices: int = 1,
        method: str = "plan",
        batch_axes: Sequence[str] = BATCH_AXES,
        exact_step_times: bool = False,
        log: Callable[[str], None] | None = None,
    ):
        from tenplex_jax._src.multihost.launch import JobSpec

        spec = JobSpec.from_env(os.environ)
        self._worker = None
        if spec is not None:  # a process of `tenplex-jax launch`
            if not jax.distributed.is_initialized():
                raise LayoutError(
                    "this process has a launched job's description but has not joined it: "
                    "tenplex-jax launch starts scripts as `python -m tenplex_jax.multihost SCRIPT`"
                )
            if devices is not None or initial is not None:
                raise LayoutError(
                    "a launched job runs on every device of its processes; devices= and "
                    "initial= are for one process (the launcher sets the process count)"
                )
            from tenplex_jax._src.multihost.worker import Worker

            self._worker = Worker(spec, checkpoint_dir, checkpoint_every)
            compile_ahead = False  # another layout is another generation of processes
        self.rules, self.dataset, self.workers = rules, dataset, workers
        self.devices = {d.id: d for d in (jax.devices() if devices is None else devices)}
        self.initial = tuple(sorted(self.devices) if initial is None else initial)
        self._choose, self.profile, self.device_type = config, profile, device_type
        self.steps, self.method, self.batch_axes = steps, method, tuple(batch_axes)
        self.checkpoint_dir = None if checkpoint_dir is None else pathlib.Path(checkpoint_dir)
        self.checkpoint_every, self.compile_ahead = checkpoint_every, compile_ahead
        self.preempt_devices, self.exact_step_times = preempt_devices, exact_step_times
        self.log = log or (lambda text: None)
        self.failed: set[int] = set()
        self.records: list[EventRecord] = []
        self.cache_hits = 0  # reconfigurations whose step was already compiled
        self.step_log: list[tuple[int, float, str]] = []  # (step, seconds, config) of timed steps
        self.lost_seconds = 0.0  # step time thrown away by checkpoint fallbacks
        self.checkpoints: list[tuple[int, float]] = []  # (step, seconds) of every save
        self.resumed: int | None = None  # the checkpoint step start() restored, if any
        self.ptc: PTC | None = None
        self.steps_cache: StepCache | None = None  # made by jit()
        self.samples: np.ndarray | None = None  # the sample index of every row of the last batch
        self._pending: collections.deque[Event] = collections.deque()
        self._configs: dict[int, ParallelConfig] = {}
        self._hints: list[tuple[int, ...]] = []
        self._abstract = self._sample = None
        self._stalled: tuple[EventRecord | None, float] | None = None  # (record, posted)
        self._bandwidth = device_type.link_bandwidth if device_type is not None else 1e9

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the user's side --------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Global batches handed out so far: the index of the next step."""
        return self.dataset.step

    @property
    def compiles(self) -> int:
        """XLA compiles of the step so far, ahead or not."""
        return 0 if self.steps_cache is None else self.steps_cache.compiles

    @property
    def layout(self) -> BatchLayout:
        return self._layout(self.ptc.config)

    @property
    def launched(self) -> bool:
        """Whether this process is a worker of ``tenplex-jax launch``."""
        return self._worker is not None

    @property
    def process_index(self) -> int:
        return 0 if self._worker is None else self._worker.process_index

    @property
    def generation(self) -> int:
        """The launched job's generation of processes (0 in one process)."""
        return 0 if self._worker is None else self._worker.generation

    @property
    def run_dir(self) -> pathlib.Path | None:
        """The launcher's run directory (None in one process)."""
        return None if self._worker is None else self._worker.run_dir

    @property
    def restored(self) -> dict | None:
        """In a launched job: where ``start`` took the state from, its step and costs."""
        return None if self._worker is None else self._worker.restored

    def start(self, init):
        """The job's state laid out on its initial devices: restored when there is a state to
        resume (a launched generation's, or the latest checkpoint under ``checkpoint_dir``), else
        ``init()`` jitted straight into the layout. ``init`` is a function returning the state
        (an ``nnx.State`` or any pytree of arrays), or the state itself (placed as it is)."""
        if self.ptc is not None:
            raise LayoutError("job.start() lays the state out once; the job already has a layout")
        if callable(init):
            self._abstract = jax.eval_shape(init)
        else:
            self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
        self._sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
        ids = self.initial
        devices = [self.devices[i] for i in ids]
        self.ptc = PTC.of(self._abstract, self.rules, self.config_for(len(ids)), devices)

        def build():
            if callable(init):
                return jax.jit(init, out_shardings=self.ptc.shardings(self._mesh()))()
            return place(init, self.ptc)

        if self._worker is not None:
            return self._worker.restore(self.ptc, build, self.dataset)
        latest = None
        if self.checkpoint_dir is not None:
            from tenplex_jax._src.checkpoint import latest_checkpoint

            latest = latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            return build()
        from tenplex_jax._src.checkpoint import restore_checkpoint

        restored = restore_checkpoint(self.checkpoint_dir, self.ptc, step=latest, verify=False)
        if restored.data_state is None:
            raise DataError(f"checkpoint {latest} in {self.checkpoint_dir} has no data state")
        self.dataset.restore(restored.data_state)
        self.resumed = latest
        self.checkpoints.append((latest, 0.0))  # already saved: not saved again
        self.log(f"resumed from checkpoint {latest} in {self.checkpoint_dir}")
        return restored.state

    def jit(self, fn: Callable) -> Callable:
        """The user's ``fn(state, batch) -> (state, metrics)``, compiled per layout; call it with
        ``job.next``'s state and batch. The state is donated; metrics come back replicated."""
        if self.ptc is None:
            raise LayoutError("call job.start(init) before job.jit(step): the step needs a layout")
        self.steps_cache = StepCache(fn, self._sample, list(self.devices.values()), self.batch_axes)
        self._compiled(self.ptc, ahead=True)
        self._stalled = (None, time.perf_counter())  # time the first step too
        self._ahead()
        return self._run

    def next(self, state):
        """The step boundary: apply pending events, save a due checkpoint (one process) or commit
        (launched); (state, the next batch)."""
        if self.ptc is None:
            raise LayoutError("call job.start(init) before job.next(state)")
        if self._worker is not None:
            self._launched_boundary(state)
        while self._pending:
            state = self._apply(state, self._pending.popleft())
        every = self.checkpoint_every
        if self._worker is None and self.checkpoint_dir is not None and every:  # noqa: SIM102
            if self.step % every == 0:
                self._save(state)
        mesh, layout = self._mesh(), self.layout
        data, weights, self.samples = device_batch(
            self.dataset, self.step, layout, mesh, self.batch_axes
        )
        self.dataset.step += 1
        return state, Batch(data, weights, layout, mesh, self.batch_axes)

    def finish(self, state) -> None:
        """The end of training: a final checkpoint (with ``checkpoint_dir``) and, when launched,
        the commits finished and the launcher told that the job is done."""
        if self._worker is not None:
            self._worker.finish(state, self.ptc, self.step, self.dataset)
        elif self.checkpoint_dir is not None:
            self._save(state)

    def wait(self) -> None:
        """Finish the commit in flight, if any (launched jobs commit in the background)."""
        if self._worker is not None:
            self._worker.wait()

    def preempt(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """A preemption notice for ``devices`` (default: the job's last ``count`` devices)."""
        self._post("preempt", devices, count)

    def fail(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """``devices`` failed: their buffers are gone (default: the job's last ``count``)."""
        self._post("fail", devices, count)

    def offer(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """``devices`` are offered (default: the ``count`` lowest-numbered unused devices)."""
        self._post("offer", devices, count)

    def redeploy(self, devices: Iterable[int]) -> None:
        """Move onto exactly ``devices`` at the next step boundary."""
        self._post("redeploy", devices, None)

    def expect(self, devices: Iterable[int]) -> None:
        """A hint: the job will likely run on ``devices`` next; its step is compiled ahead."""
        ids = tuple(sorted(devices))
        self._hints = [h for h in self._hints if h != ids][-1:] + [ids]  # the last two, in order
        self._ahead()

    @contextlib.contextmanager
    def handle_sigterm(self):
        """While inside, SIGTERM posts a preemption notice (main thread only); the previous
        handler is restored on exit."""
        previous = signal.signal(
            signal.SIGTERM, lambda *_: self._post("preempt", None, None, "SIGTERM")
        )
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def devices_after(
        self, kind: str, devices=None, count: int | None = None, *, current=None
    ) -> tuple[int, ...]:
        """The device ids the job would ask for after an event (before a growth decision), from
        its current devices or from ``current``."""
        return events.devices_after(
            kind,
            self.ptc.device_ids if current is None else current,
            devices,
            count,
            usable=self.devices,
            failed=self.failed,
            default_count=self.preempt_devices,
        )

    def config_for(self, n: int) -> ParallelConfig:
        """The parallel config the job uses on ``n`` devices."""
        if n not in self._configs:
            if self._choose is not None:
                self._configs[n] = self._choose(n)
            else:
                self._configs[n] = choose_config(
                    n,
                    self._abstract,
                    self.rules,
                    self.dataset.global_batch,
                    self.workers,
                    profile=self.profile,
                    device_type=self.device_type,
                )
        return self._configs[n]

    def is_compiled(self, devices: Iterable[int]) -> bool:
        """Whether the step for the layout the job would use on ``devices`` is compiled."""
        return self.steps_cache.ready(self._key(self._target(tuple(sorted(devices)))))

    def compile_seconds(self, devices: Iterable[int]) -> float:
        """Compile the step afresh for the layout the job would use on ``devices`` (bypassing the
        job's cache; JAX's own caches still apply) and return XLA's seconds: a cost-model input."""
        target = self._target(tuple(sorted(devices)))
        return self.steps_cache.compile(target, self._layout(target.config)).seconds

    def close(self) -> None:
        """Stop the compile-ahead threads (waits for a compile under way) and, when launched,
        the commit threads and store connections."""
        if self.steps_cache is not None:
            self.steps_cache.close()
        if self._worker is not None:
            self._worker.close()

    # -- events -----------------------------------------------------------------------------------

    def _post(self, kind, devices, count, source="api"):
        if self._worker is not None:
            raise LayoutError(
                f"job.{kind}(): a launched job's devices change by generation (a lost process, "
                f"RUN_DIR/resize, SIGTERM to the launcher), not within one"
            )
        ids = None if devices is None else tuple(int(d) for d in devices)
        self._pending.append(Event(kind, ids, count, source))  # deque.append: signal-safe

    def _apply(self, state, event: Event):
        before = self.ptc
        ids = self.devices_after(event.kind, event.devices, event.count)
        record = EventRecord(
            self.step,
            event.kind,
            event.source,
            list(before.device_ids),
            list(ids),
            str(before.config),
            "",
            "",
        )
        failed = ()
        if event.kind == "fail":
            failed = tuple(sorted(set(before.device_ids) - set(ids)))
            self.failed |= set(event.devices or failed)
        if set(ids) == set(before.device_ids):  # nothing the job runs on changes
            record.decision, record.config_after = "stay", str(before.config)
            self.records.append(record)
            return state
        tic = time.perf_counter()
        target = self._target(ids)
        try:
            plan = make_plan(before, target, failed=failed)
        except LostShardsError as error:
            record.error = str(error)
            state = self._fall_back(state, target, error, record)
        else:
            record.plan_seconds = time.perf_counter() - tic
            if event.kind == "offer":
                record.estimate = self._estimate(target, plan)
                if not record.estimate["grow"]:
                    record.decision, record.devices_after = "stay", list(before.device_ids)
                    record.config_after = str(before.config)
                    self.records.append(record)
                    return state
            # after a failure the old arrays are not donated: deleting them would touch the failed
            # devices' buffers; they are freed when the caller rebinds the state
            state, report = reshard(state, plan, method=self.method, donate=not failed)
            record.bytes_moved, record.bytes_kept = report.bytes_moved, report.bytes_kept
            record.reshard_seconds = report.seconds
            if report.seconds > 0 and report.bytes_moved:
                self._bandwidth = report.bytes_moved / report.seconds
            record.decision = DECISIONS[event.kind]
        self.ptc = target
        record.devices_after, record.config_after = list(target.device_ids), str(target.config)
        status = self.steps_cache.status(self._key(target))
        record.compile = {"ready": "cached", "running": "waited"}.get(status, "compiled")
        self.cache_hits += record.compile != "compiled"
        tic = time.perf_counter()
        compiled = self._compiled(target, ahead=False).result()
        record.compile_wait_seconds = time.perf_counter() - tic
        record.compile_seconds = compiled.seconds
        if event.kind == "preempt" and self.checkpoint_dir is not None:
            record.commit_seconds = self._save(state)
        self.log(
            f"step {record.step}: {event.kind} ({event.source}) {record.config_before} on "
            f"{len(record.devices_before)} -> {record.config_after} on {len(ids)}: "
            f"{record.decision}, moved {record.bytes_moved / 2**20:.3f} MiB, step {record.compile}"
        )
        self.records.append(record)
        self._stalled = (record, event.posted)
        self._ahead()
        return state

    def _target(self, ids: tuple[int, ...]) -> PTC:
        new = self.ptc.relayout(self.config_for(len(ids)), [self.devices[i] for i in ids])
        return allocate(self.ptc, new)

    def _fall_back(self, state, target: PTC, error: LostShardsError, record: EventRecord):
        """Restore the latest checkpoint onto ``target``; re-raise ``error`` when there is none."""
        from tenplex_jax._src.checkpoint import latest_checkpoint, restore_checkpoint

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
        record.lost_steps, record.decision = lost, "restore"
        self.lost_seconds += sum(s for i, s, _ in self.step_log if i >= self.step)
        self.checkpoints = [c for c in self.checkpoints if c[0] <= self.step]
        self.step_log = [entry for entry in self.step_log if entry[0] < self.step]
        return restored.state

    def _estimate(self, target: PTC, plan) -> dict:
        """Grow now? The estimated gain over the remaining steps against the reconfiguration."""
        old, new = self.ptc.config, target.config
        if self.profile is not None and self.device_type is not None:
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
        cluster = Cluster.uniform(n, self.device_type, per_node=n)
        choice = choose(cluster, self.profile, self.dataset.global_batch, configs=[config])
        return choice.best.step_time

    def _save(self, state) -> float:
        """Save the state at this step (once: a step already saved, e.g. before a rewind, stays)."""
        from tenplex_jax._src.checkpoint import save_checkpoint

        if any(step == self.step for step, _ in self.checkpoints):
            return 0.0
        tic = time.perf_counter()
        save_checkpoint(
            self.checkpoint_dir, state, self.ptc, step=self.step, data_state=self.dataset.state()
        )
        seconds = time.perf_counter() - tic
        self.checkpoints.append((self.step, seconds))
        return seconds

    def _launched_boundary(self, state) -> None:
        """Commits, and the end of a generation the launcher asked for (or JAX's preemption
        sync point reached): the generation commits, then this process exits."""
        from jax.experimental import multihost_utils

        action = self._worker.boundary(state, self.ptc, self.step, self.dataset)
        if action is None and multihost_utils.reached_preemption_sync_point(self.step):
            self._worker.commit(
                state, self.ptc, self.step, self.dataset, wait=True, checkpoint=True
            )
            action = "preempted"
        if action is not None:
            self.log(f"step {self.step}: generation {self.generation} ends ({action}), committed")
            raise SystemExit(0)

    # -- compiled steps ---------------------------------------------------------------------------

    def _mesh(self):
        return self.ptc.mesh(list(self.devices.values()))

    def _layout(self, config: ParallelConfig) -> BatchLayout:
        ranks = math.prod(config.size(axis) for axis in self.batch_axes)
        return BatchLayout(self.dataset.global_batch, ranks=ranks, workers=self.workers)

    def _key(self, ptc: PTC) -> tuple:
        return StepCache.key(ptc, self._layout(ptc.config))

    def _compiled(self, ptc: PTC, *, ahead: bool) -> concurrent.futures.Future:
        return self.steps_cache.get(ptc, self._layout(ptc.config), ahead=ahead)

    def _ahead(self) -> None:
        """Compile, in the background, the steps of the likely next layouts."""
        if not self.compile_ahead or self.steps_cache is None:
            return
        current = tuple(sorted(self.ptc.device_ids))
        usable = lambda ids: not set(ids) & self.failed and set(ids) <= set(self.devices)
        targets = [h for h in self._hints if h != current and usable(h)]  # announced, in order
        guess = len(current) > self.preempt_devices
        if guess and all(self._compiled_for(ids) for ids in targets):
            targets.append(self.devices_after("preempt"))  # then the guess: one device fewer
        self.steps_cache.cancel_queued()  # resubmitted below, in this order
        for i, ids in enumerate(targets):
            try:
                target = self._target(ids)
            except (LayoutError, DataError) as error:  # no layout for these devices
                self.log(f"compile-ahead for devices {list(ids)} skipped: {error}")
                continue
            guessed = guess and i == len(targets) - 1 and ids not in self._hints
            self.steps_cache.get(target, self._layout(target.config), ahead=True, guess=guessed)

    def _compiled_for(self, ids) -> bool:
        """Whether the step for ``ids`` is compiled; True when ``ids`` have no layout (nothing to
        wait for)."""
        try:
            return self.steps_cache.ready(self._key(self._target(ids)))
        except (LayoutError, DataError):
            return True

    def _run(self, state, batch: Batch):
        """Run one step on the current layout (asynchronously, but for the timed steps)."""
        future = self._compiled(self.ptc, ahead=False)
        if batch.layout != self.layout or batch.mesh != self._mesh():
            raise LayoutError(
                f"the batch is laid out for {batch.layout} on mesh {dict(batch.mesh.shape)}, the "
                f"job runs {self.ptc.config} on {list(self.ptc.device_ids)}: pass the state and "
                f"batch that job.next returned"
            )
        executable = future.result().executable
        tic = time.perf_counter()
        state, metrics = executable(state, batch)
        if self._worker is not None:
            self._worker.reached(self.step, self.steps)
        if self.exact_step_times or self._stalled is not None:
            jax.block_until_ready((state, metrics))
            done = time.perf_counter()
            self.step_log.append((self.step - 1, done - tic, str(self.ptc.config)))
            if self._stalled is not None:
                record, posted = self._stalled
                if record is not None:
                    record.stall_seconds = done - posted
                self._stalled = None
        return state, metrics
