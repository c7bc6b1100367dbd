"""Elastic training in one process: the user's Flax loop keeps training while its devices change.

The user keeps their own train step and their own loop; tenplex_jax owns the state's layout (its
PTC), the dataset PTC and the step's shardings, and applies reconfigurations between steps::

    job = tj.ElasticJob(rules, tj.DatasetPTC(samples, global_batch=24), workers=8)
    state = job.place(nnx.state({"model": model, "optimizer": optimizer}))
    step = job.jit(train_step)               # train_step(state, batch) -> (state, metrics)
    with job.handle_sigterm():               # SIGTERM: a preemption notice
        while job.step < 1000:
            state, batch = job.next(state)   # the step boundary: pending events, then a batch
            state, metrics = step(state, batch)

    def train_step(state, batch):            # the user's step: any Flax NNX code
        nodes = nnx.merge(graphdef, state)
        loss, grads = batch.value_and_grad(example_losses)(nodes["model"])
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), {"loss": loss}

**Events** are posted at any time (from a signal handler, another thread or the loop) and applied
at the next ``job.next``:

- ``job.preempt(devices)``: a preemption notice; the job shrinks onto the devices that remain and
  commits (an orbax checkpoint when ``checkpoint_dir`` is set). SIGTERM under
  ``job.handle_sigterm()`` posts one without device names; the rule is then that the job's last
  ``preempt_devices`` devices (highest ids) go, as when a scheduler reclaims the last host.
  ``jax.experimental.multihost_utils.reached_preemption_sync_point`` is polled at every boundary;
  in one process without ``jax.distributed`` it is always False, so SIGTERM is the signal there.
- ``job.fail(devices)``: the devices' buffers are gone. The plan rebuilds their shards from
  surviving replicas (``make_plan(..., failed=...)`` never reads a failed device). When some box has
  no replica, ``LostShardsError`` names the leaves; with a checkpoint the job restores the latest
  one onto the remaining devices, rewinds the dataset cursor and reports the lost steps.
- ``job.offer(devices)``: the job grows when the estimated gain over the remaining steps (step
  times from ``tenplex_jax.planner``, or measured ones scaled by the device count) exceeds the
  estimated cost (the plan's bytes over the bandwidth, plus the compile time unless the step is
  already compiled). The decision and its numbers are recorded.

**Compiled steps** are cached per (parallel config, device order, batch layout): returning to an
earlier layout does not recompile. After every reconfiguration background threads compile
(``jit(...).lower(abstract state, abstract batch).compile()``) the likely next layouts: those
announced with ``job.expect(devices)`` (the last two, in order) and, once they are compiled or when
none is announced, one device fewer (on a thread of its own, so that a guess never delays an
announced layout). ``compilation_cache_dir`` turns on JAX's persistent compilation cache for every
compile, however short.

Every event becomes an ``EventRecord`` in ``job.records``: the decision, bytes moved, reshard and
compile seconds, lost steps, and the stall (from the event to the first step done on the new
layout).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import pathlib
import signal
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from tenplex_jax.cluster import Cluster, DeviceType
from tenplex_jax.data import BatchLayout, DatasetPTC
from tenplex_jax.errors import DataError, LayoutError, LostShardsError
from tenplex_jax.plan import allocate, make_plan
from tenplex_jax.planner import choose
from tenplex_jax.profile import ModelProfile
from tenplex_jax.ptc import PTC, ParallelConfig, Rules
from tenplex_jax.steps import Batch, StepCache, enable_compilation_cache
from tenplex_jax.train import BATCH_AXES, device_batch
from tenplex_jax.transform import place, reshard

KINDS = ("preempt", "fail", "offer")


@dataclasses.dataclass(frozen=True)
class Event:
    """A change of the job's devices, applied at the next step boundary."""

    kind: str  # "preempt", "fail" or "offer"
    devices: tuple[int, ...] | None  # None: the rule (the job's last `count` devices / lowest free)
    count: int | None = None
    source: str = "api"
    posted: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class EventRecord:
    """What one event did; ``dataclasses.asdict`` gives the JSON of ``summary.json``."""

    step: int
    kind: str
    source: str
    devices_before: list[int]
    devices_after: list[int]
    config_before: str
    config_after: str
    decision: str  # shrink, rebuild, restore, grow, stay
    bytes_moved: int = 0
    bytes_kept: int = 0
    plan_seconds: float = 0.0
    reshard_seconds: float = 0.0
    compile: str = (
        ""  # cached (compiled before), waited (compile-ahead was running), compiled (now)
    )
    compile_seconds: float = 0.0  # what XLA took for the new layout's step, wherever it ran
    compile_wait_seconds: float = 0.0  # how long the boundary waited for it
    commit_seconds: float = 0.0
    restore_seconds: float = 0.0
    lost_steps: int = 0
    stall_seconds: float | None = None  # event posted -> first step done on the new layout
    estimate: dict | None = None  # growth: the numbers behind the decision
    error: str | None = None


class ElasticJob:
    """The layout, data and compiled steps of one training job whose devices change.

    ``rules`` are the logical-axis rules of the state; ``dataset`` serves the global batches
    (its ``step`` is the job's step). ``devices`` are all the devices the job may ever use
    (default ``jax.devices()``); it starts on ``initial`` (default all). ``config(n)`` picks the
    parallel config for ``n`` devices (default: ``default_config``, data and FSDP meshes, chosen by
    the planner when ``profile`` and ``device_type`` are given). ``workers`` sets virtual workers,
    which make the params bitwise equal across data-parallel and FSDP sizes. ``steps`` (the run's
    length) lets growth weigh its gain over the remaining steps.
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
        compilation_cache_dir: str | pathlib.Path | None = None,
        preempt_devices: int = 1,
        method: str = "plan",
        batch_axes: Sequence[str] = BATCH_AXES,
        log: Callable[[str], None] | None = None,
    ):
        self.rules, self.dataset, self.workers = rules, dataset, workers
        self.devices = {d.id: d for d in (jax.devices() if devices is None else devices)}
        self.initial = tuple(sorted(self.devices) if initial is None else initial)
        self._choose, self.profile, self.device_type = config, profile, device_type
        self.steps, self.method, self.batch_axes = steps, method, tuple(batch_axes)
        self.checkpoint_dir = None if checkpoint_dir is None else pathlib.Path(checkpoint_dir)
        self.checkpoint_every, self.compile_ahead = checkpoint_every, compile_ahead
        self.preempt_devices = preempt_devices
        self.log = log or (lambda text: None)
        if compilation_cache_dir is not None:
            enable_compilation_cache(compilation_cache_dir)
        self.failed: set[int] = set()
        self.records: list[EventRecord] = []
        self.cache_hits = 0  # reconfigurations whose step was already compiled
        self.step_log: list[tuple[int, float, str]] = []  # (step, seconds, config) of counted steps
        self.lost_seconds = 0.0  # step time thrown away by checkpoint fallbacks
        self.checkpoints: list[tuple[int, float]] = []  # (step, seconds) of every save
        self.ptc: PTC | None = None
        self._pending: collections.deque[Event] = collections.deque()
        self.steps_cache: StepCache | None = None  # made by jit()
        self._configs: dict[int, ParallelConfig] = {}
        self._hints: list[tuple[int, ...]] = []
        self._abstract = self._sample = self._stalled = None
        self.samples: np.ndarray | None = None  # the sample index of every row of the last batch
        self._bandwidth = device_type.link_bandwidth if device_type is not None else 1e9

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

    def place(self, state):
        """Lay ``state`` (built without a mesh) out on the initial devices; returns it placed."""
        self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        self._sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
        ids = self.initial
        self.ptc = PTC.of(self._abstract, self.rules, self.config_for(len(ids)), ids)
        return place(state, self.ptc)

    def jit(self, fn: Callable) -> Callable:
        """The user's ``fn(state, batch) -> (state, metrics)``, compiled per layout; call it with
        ``job.next``'s state and batch. The state is donated; metrics come back replicated."""
        if self.ptc is None:
            raise LayoutError("call job.place(state) before job.jit(step): the step needs a layout")
        self.steps_cache = StepCache(fn, self._sample, list(self.devices.values()), self.batch_axes)
        self._compiled(self.ptc, ahead=True)
        self._ahead()
        return self._run

    def next(self, state):
        """The step boundary: apply pending events, save a due checkpoint; (state, next batch)."""
        with contextlib.suppress(Exception):  # False in one process (no preemption sync manager)
            if jax.process_count() > 1 and _reached_sync_point(self.step):
                self._pending.append(Event("preempt", None, source="preemption sync point"))
        while self._pending:
            state = self._apply(state, self._pending.popleft())
        every = self.checkpoint_every
        if self.checkpoint_dir is not None and every and self.step % every == 0:
            self._save(state)
        mesh = self.ptc.mesh(list(self.devices.values()))
        layout = self.layout
        data, weights, self.samples = device_batch(
            self.dataset, self.step, layout, mesh, self.batch_axes
        )
        self.dataset.step += 1
        return state, Batch(data, weights, layout, mesh, self.batch_axes)

    def preempt(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """A preemption notice for ``devices`` (default: the job's last ``count`` devices)."""
        self._post("preempt", devices, count)

    def fail(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """``devices`` failed: their buffers are gone (default: the job's last ``count``)."""
        self._post("fail", devices, count)

    def offer(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """``devices`` are offered (default: the ``count`` lowest-numbered unused devices)."""
        self._post("offer", devices, count)

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
        current = set(self.ptc.device_ids if current is None else current)
        if kind not in KINDS:
            raise LayoutError(f"an event kind is one of {KINDS}, got {kind!r}")
        if kind == "offer":
            free = sorted(set(self.devices) - current - self.failed)
            offered = set(free[: count or 0] if devices is None else devices) - self.failed
            return tuple(sorted(current | offered))
        gone = set(
            sorted(current)[-(count or self.preempt_devices) :] if devices is None else devices
        )
        left = tuple(sorted(current - gone))
        if not left:
            raise LayoutError(f"a {kind} of devices {sorted(gone)} leaves the job no device")
        return left

    def config_for(self, n: int) -> ParallelConfig:
        """The parallel config the job uses on ``n`` devices."""
        if n not in self._configs:
            self._configs[n] = (
                self._choose(n)
                if self._choose is not None
                else default_config(
                    n,
                    self._abstract,
                    self.rules,
                    self.dataset.global_batch,
                    self.workers,
                    profile=self.profile,
                    device_type=self.device_type,
                )
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
        """Stop the compile-ahead thread (waits for a compile under way)."""
        if self.steps_cache is not None:
            self.steps_cache.close()

    # -- events -----------------------------------------------------------------------------------

    def _post(self, kind, devices, count, source="api"):
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
            record.decision = {"preempt": "shrink", "fail": "rebuild", "offer": "grow"}[event.kind]
        self.ptc = target
        record.devices_after, record.config_after = list(target.device_ids), str(target.config)
        key = self._key(target)
        status = self.steps_cache.status(key)
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
        new = PTC.of(self._abstract, self.rules, self.config_for(len(ids)), ids)
        return allocate(self.ptc, new)

    def _fall_back(self, state, target: PTC, error: LostShardsError, record: EventRecord):
        """Restore the latest checkpoint onto ``target``; re-raise ``error`` when there is none."""
        from tenplex_jax.checkpoint import latest_checkpoint, restore_checkpoint

        latest = None if self.checkpoint_dir is None else latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            raise error
        self.log(f"step {self.step}: {error}; restoring checkpoint {latest}")
        tic = time.perf_counter()
        restored = restore_checkpoint(self.checkpoint_dir, target, step=latest)
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
        remaining = None if self.steps is None else max(self.steps - self.step, 0)
        gain = math.inf if remaining is None else (t_old - t_new) * remaining
        key = self._key(target)
        ready = self.steps_cache.ready(key)
        done = self.steps_cache.done()
        compile_s = 0.0 if ready else max((c.seconds for c in done), default=0.0)
        transfer = plan.bytes_moved / self._bandwidth
        return {
            "source": source,
            "step_seconds_now": t_old,
            "step_seconds_new": t_new,
            "remaining_steps": remaining,
            "gain_seconds": gain,
            "bytes_moved": plan.bytes_moved,
            "bandwidth": self._bandwidth,
            "transfer_seconds": transfer,
            "compile_seconds": compile_s,
            "compiled_ahead": ready,
            "cost_seconds": transfer + compile_s,
            "grow": bool(gain > transfer + compile_s),
        }

    def _step_estimate(self, config: ParallelConfig) -> float:
        n = config.num_devices
        cluster = Cluster.uniform(n, self.device_type, per_node=n)
        choice = choose(cluster, self.profile, self.dataset.global_batch, configs=[config])
        return choice.best.step_time

    def _save(self, state) -> float:
        """Save the state at this step (once: a step already saved, e.g. before a rewind, stays)."""
        from tenplex_jax.checkpoint import save_checkpoint

        if any(step == self.step for step, _ in self.checkpoints):
            return 0.0
        tic = time.perf_counter()
        save_checkpoint(
            self.checkpoint_dir, state, self.ptc, step=self.step, data_state=self.dataset.state()
        )
        seconds = time.perf_counter() - tic
        self.checkpoints.append((self.step, seconds))
        return seconds

    # -- compiled steps ---------------------------------------------------------------------------

    def _layout(self, config: ParallelConfig) -> BatchLayout:
        return BatchLayout(
            self.dataset.global_batch, ranks=config.data * config.fsdp, workers=self.workers
        )

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
        if guess and not any(self._pending_target(ids) for ids in targets):  # all compiled
            targets.append(self.devices_after("preempt"))  # then the guess: one device fewer
        self.steps_cache.cancel_queued()  # resubmitted below, in this order
        for i, ids in enumerate(targets):
            try:
                target = self._target(ids)
                guessed = guess and i == len(targets) - 1 and ids not in self._hints
                self.steps_cache.get(target, self._layout(target.config), ahead=True, guess=guessed)
            except Exception as error:  # noqa: BLE001 - a guess that fails must not stop training
                self.log(f"compile-ahead for devices {list(ids)} skipped: {error!r}")

    def _pending_target(self, ids) -> bool:
        """True while the step for ``ids`` is not compiled; False once it is, or if ``ids`` have
        no layout (nothing to wait for)."""
        try:
            return not self.steps_cache.ready(self._key(self._target(ids)))
        except Exception:  # noqa: BLE001 - no layout: nothing to wait for
            return False

    def _run(self, state, batch: Batch):
        """Run one step on the current layout; blocks until it is done (for the step times)."""
        future = self._compiled(self.ptc, ahead=False)
        if batch.layout != self.layout or batch.mesh != self.ptc.mesh(list(self.devices.values())):
            raise LayoutError(
                f"the batch is laid out for {batch.layout} on mesh {dict(batch.mesh.shape)}, the "
                f"job runs {self.ptc.config} on {list(self.ptc.device_ids)}: pass the state and "
                f"batch that job.next returned"
            )
        executable = future.result().executable
        tic = time.perf_counter()
        state, metrics = executable(state, batch)
        jax.block_until_ready((state, metrics))
        done = time.perf_counter()
        self.step_log.append((self.step - 1, done - tic, str(self.ptc.config)))
        if self._stalled is not None:
            record, posted = self._stalled
            record.stall_seconds, self._stalled = done - posted, None
        return state, metrics


def default_config(
    n: int,
    abstract_state,
    rules: Rules,
    global_batch: int,
    workers: int | None,
    *,
    profile: ModelProfile | None = None,
    device_type: DeviceType | None = None,
) -> ParallelConfig:
    """The ``(data, fsdp)`` config of ``n`` devices for a state and global batch.

    Candidates lay the state out without replicating an indivisible dim and give every
    data-parallel rank a unit of the batch. With a ``profile`` and ``device_type`` the planner
    (``tenplex_jax.planner.choose``) picks the fastest; otherwise the one with the least FSDP
    (pure data parallelism when the batch allows it). Tensor and pipeline degrees stay 1: virtual
    workers keep the params bitwise equal across data and FSDP sizes only.
    """
    valid, refused = [], []
    for f in (d for d in range(1, n + 1) if n % d == 0):
        config = ParallelConfig(data=n // f, fsdp=f)
        try:
            PTC.of(abstract_state, rules, config, range(n))
            BatchLayout(global_batch, ranks=n, workers=workers)
        except (LayoutError, DataError) as error:
            refused.append(f"{config}: {str(error).split(';')[0]}")
            continue
        valid.append(config)
    if not valid:
        raise LayoutError(
            f"no (data, fsdp) config lays the state out on {n} devices with global batch "
            f"{global_batch}: " + "; ".join(refused)
        )
    if profile is None or device_type is None:
        return valid[0]
    cluster = Cluster.uniform(n, device_type, per_node=n)
    return choose(cluster, profile, global_batch, configs=valid).best.config


def _reached_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))
