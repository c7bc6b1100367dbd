"""What the two roles of an elastic job share: the layout, the data, the compiled steps.

``_JobCore`` owns the state's layout (its PTC), the dataset PTC, the parallel config of each
device count and the user's step compiled per layout (a :class:`StepCache`). ``start`` lays the
state out, ``jit`` compiles the step, ``_batch`` hands out the next global batch for the current
mesh, and the step ``jit`` returns runs on the current layout and times the steps that end a
stall. Two roles fill its hooks:

- :class:`tenplex_jax.ElasticJob` (``job.py``), one process: events change its devices between
  steps; checkpoints under ``checkpoint_dir``;
- a runtime's job, such as :class:`tenplex_jax.multihost.LaunchedJob` (the multihost wing), a
  process of ``tenplex-jax launch``: restores where the launcher says, commits to the tensor
  stores, ends its generation on request.

The hooks: ``_restore_or_build(build)`` is the state ``start`` begins from, ``next(state)`` the
step boundary (each role's own, then the shared ``_batch()``), ``_after_step()`` what follows
each dispatched step, ``finish(state)`` the end of training and ``wait()`` the end of a commit in
flight.

:class:`JobOptions` holds the settings a job rarely needs, in one frozen record.

The arrays a step is done with (its donated input state, its batch) are freed once the next step
is dispatched, while it runs, not where the loop drops them. Freeing a jax.Array lets go of the
GIL: where a loop rebinds its ``state`` and ``batch``, each of the arrays freed one after another
was a hand-off, 0.3 ms a step of the small GPT; while a step lowered on a background thread
(Python, holding the GIL between its switches), each hand-off waited for the lowering to let go
again: 2.35 ms of the 2.6 ms between two steps on 2 cores (``benchmarks/RESULTS.md``).
The job holds them one step longer instead. A donated state holds no buffers by then; the batch
holds its memory until the next step is dispatched.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import math
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from tenplex_jax._src import bitwise
from tenplex_jax._src.batch import BATCH_AXES, Batch, device_batch
from tenplex_jax._src.data import BatchLayout, DatasetPTC
from tenplex_jax._src.elastic.executables import ExecutableCache
from tenplex_jax._src.elastic.steps import SWITCH_INTERVAL, StepCache
from tenplex_jax._src.errors import LayoutError, one_of
from tenplex_jax._src.executor import ReshardMethod, place
from tenplex_jax._src.mesh import MESH_AXES, show_mesh
from tenplex_jax._src.planner.cluster import DeviceType
from tenplex_jax._src.planner.policy import choose_config
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules

__all__ = ["JobOptions"]


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """How an elastic job runs, beyond its devices, data and checkpoints: one frozen record.

    Every field has a default; pass only what differs, and derive variants with
    ``dataclasses.replace``::

        options = tj.elastic.JobOptions(compile_ahead=False, exact_step_times=True)
        job = tj.ElasticJob(rules, dataset, grad_units=8, options=options)
        verbose = dataclasses.replace(options, log=print)

    Attributes:
      compile_ahead: compile the steps of the announced and likely next layouts on background
        threads (in a launched job, process 0 compiles the next generation's: after the loss of
        any one process, and a planned shrink's before the switch).
      preempt_devices: how many devices a preemption notice without names takes (SIGTERM under
        ``job.handle_sigterm()``, ``job.preempt()``); compile-ahead guesses that many fewer.
      method: how a reconfiguration moves the state, a ``tj.typing.ReshardMethod``: ``"plan"``
        or ``"device_put"`` (see :func:`tenplex_jax.reshard`).
      batch_axes: the mesh axes the rows of each global batch are split over.
      bitwise: train so that no layout change alters a bit: each global batch is split over
        every mesh axis (``batch_axes`` is then unused) and the step's gradient, taken with
        ``batch.value_and_grad``, in the job's ``grad_units``, so the layout only says where the
        state is stored (docs/bitwise.md). Needs ``grad_units`` and, before JAX starts,
        :func:`tenplex_jax.elastic.use_bitwise_flags`; ``job.bitwise`` says whether the job's
        changes are bitwise, and ``job.not_bitwise`` why not.
      exact_step_times: wait for every step and record its time in ``job.step_log``; by default
        only the first step on each layout is waited for and the rest run asynchronously.
        Either way, the next global batch is read and placed while each step runs.
      profile: the model's :class:`tenplex_jax.planner.ModelProfile`. With ``device_type``, the
        planner picks each device count's config and growth weighs its step-time estimates.
      device_type: the devices' :class:`tenplex_jax.planner.DeviceType`; its ``link_bandwidth``
        is the bandwidth assumed until a reshard measures one.
      log: called with one line of text per event, restore and generation end (default: silent).
      executable_cache: a directory of compiled steps (serialized executables, one file per
        program, process and layout): each layout's step is loaded from it when this process, or
        one in its position, compiled it before, and stored in it after a compile. Default None:
        none for :class:`tenplex_jax.ElasticJob`, ``RUN_DIR/executables`` for a launched job.
      notice_seconds: how long a preemption notice or a redeploy leaves the job its devices. The
        change waits at most this long for its layout's step, compiling it in the background
        (ahead, if nothing compiles it yet), while the job trains on its current devices; it is
        applied at the first boundary where the step is ready, the time is up, or another event
        is posted after it. Default 0: at the next boundary, as a failure always is. (One
        process's :class:`tenplex_jax.ElasticJob`; a launched job's planned shrink always trains
        on until its layout is compiled.)
      switch_interval: seconds; while a step traces and compiles on a background thread, Python's
        thread switch interval (``sys.setswitchinterval``, process-wide) is at most this, so that
        the tracing does not hold up the training loop's thread for up to the interpreter's 5 ms
        at each JAX call; the setting is put back when no compile runs. None leaves it alone.
      warm_up: run each step compiled ahead once on its layout's devices, on zero inputs, on the
        compile thread, before it counts as ready, so that the first step after the change does
        not pay the executable's one-time work (on XLA:CPU, a new executable's first step took
        2-4x a steady step). It holds a second copy of the state on those devices while it runs,
        and a step whose control flow depends on the values (a ``while_loop`` on the data) may
        not end on zeros: turn it off then. Layouts that span other processes are never warmed.

    Raises:
      LayoutError: a field has the wrong type or lies outside its range; the message names the
        field, the rule and the value.
    """

    compile_ahead: bool = True
    preempt_devices: int = 1
    method: ReshardMethod = ReshardMethod.PLAN
    batch_axes: Sequence[str] = BATCH_AXES
    bitwise: bool = False
    exact_step_times: bool = False
    profile: ModelProfile | None = None
    device_type: DeviceType | None = None
    log: Callable[[str], None] | None = None
    executable_cache: str | os.PathLike | None = None
    notice_seconds: float = 0.0
    switch_interval: float | None = SWITCH_INTERVAL
    warm_up: bool = True

    def __post_init__(self):
        for name in ("compile_ahead", "bitwise", "exact_step_times", "warm_up"):
            if not isinstance(getattr(self, name), bool):
                raise LayoutError(f"JobOptions.{name} is a bool, got {getattr(self, name)!r}")
        count = self.preempt_devices
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise LayoutError(f"JobOptions.preempt_devices is an int >= 1, got {count!r}")
        object.__setattr__(
            self, "method", one_of(ReshardMethod, self.method, "JobOptions.method", LayoutError)
        )
        axes = self.batch_axes
        if isinstance(axes, str):  # "data" would otherwise be read as the axes d, a, t, a
            raise LayoutError(f"JobOptions.batch_axes is a sequence of axis names, got {axes!r}")
        axes = tuple(axes)
        if not axes or len(set(axes)) != len(axes) or not set(axes) <= set(MESH_AXES):
            raise LayoutError(
                f"JobOptions.batch_axes are distinct mesh axes among {MESH_AXES}, got {axes}"
            )
        object.__setattr__(self, "batch_axes", axes)  # hashable and immutable, as the record
        for name, kind in (("profile", ModelProfile), ("device_type", DeviceType)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise LayoutError(f"JobOptions.{name} is a {kind.__name__} or None, got {value!r}")
        notice = self.notice_seconds
        if isinstance(notice, bool) or not isinstance(notice, (int, float)) or not notice >= 0:
            raise LayoutError(f"JobOptions.notice_seconds is seconds >= 0, got {notice!r}")
        interval = self.switch_interval
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not 0 < interval <= 1
        ):
            raise LayoutError(
                f"JobOptions.switch_interval is seconds in (0, 1] or None, got {interval!r}"
            )
        if self.log is not None and not callable(self.log):
            raise LayoutError(f"JobOptions.log is a callable taking a str, got {self.log!r}")
        directory = self.executable_cache
        if directory is not None:
            if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
                raise LayoutError(
                    f"JobOptions.executable_cache is a directory path or None, got {directory!r}"
                )
            object.__setattr__(self, "executable_cache", pathlib.Path(directory))


class _JobCore(abc.ABC):
    """The shared core of the job's roles (see the module docstring): the constructor, whose
    arguments :class:`tenplex_jax.ElasticJob` documents, is written here once."""

    launched: bool  # whether this process is a worker of `tenplex-jax launch`: False or True
    # how long a process waits for another process's compile of a layout before compiling it
    # itself: 0 in one process, where no other process compiles
    _follow_seconds = 0.0
    # whether the step donates its input state: a launched job's keeps it, the survivors' live
    # copy at a failure (``Worker.hold``)
    _donates = True

    def __init__(
        self,
        rules: Rules,
        dataset: DatasetPTC,
        *,
        devices: Sequence[jax.Device] | None = None,
        initial: Iterable[int] | None = None,
        grad_units: int | None = None,
        config: Callable[[int], ParallelConfig] | None = None,
        steps: int | None = None,
        checkpoint_dir: str | pathlib.Path | None = None,
        checkpoint_every: int | None = None,
        options: JobOptions = JobOptions(),
    ):
        if not isinstance(options, JobOptions):
            raise LayoutError(
                f"options= is a tj.elastic.JobOptions (compile_ahead, preempt_devices, method, "
                f"batch_axes, bitwise, exact_step_times, profile, device_type, log, "
                f"executable_cache), "
                f"got {options!r}"
            )
        if options.bitwise and grad_units is None:
            raise LayoutError(
                "JobOptions(bitwise=True) needs grad_units=: the gradient is bitwise on every "
                "layout when it is the sum of fixed units in a fixed order"
            )
        self.rules, self.dataset, self.grad_units, self.steps = rules, dataset, grad_units, steps
        self.devices = {d.id: d for d in (jax.devices() if devices is None else devices)}
        self.initial = tuple(sorted(self.devices) if initial is None else initial)
        self.checkpoint_dir = None if checkpoint_dir is None else pathlib.Path(checkpoint_dir)
        self.checkpoint_every, self.options = checkpoint_every, options
        self.log = options.log or (lambda text: None)
        self.ptc: PTC | None = None
        self.steps_cache: StepCache | None = None  # made by jit()
        self._not_bitwise: tuple[str | None] | None = None  # (why not bitwise,), once known
        # where jit()'s steps are loaded from and stored (a launched job defaults it to its run dir)
        self.executable_cache: pathlib.Path | None = options.executable_cache
        self.samples: np.ndarray | None = None  # the sample index of every row of the last batch
        self.step_log: list[tuple[int, float, str]] = []  # (step, seconds, config) of timed steps
        self._choose = config
        self._configs: dict[int, ParallelConfig] = {}
        self._abstract = self._sample = None
        # (the event's record or None, when the stall began): the next step is timed
        self._stalled: tuple[object, float] | None = None
        # ((step, layout, mesh), batch, samples): the next global batch, read while a timed
        # step ran; used when the boundary leaves the job on that layout
        self._prefetched: tuple | None = None
        self._meshed: tuple | None = None  # (ptc, devices, mesh): the current layout's mesh
        # (ptc, global batch, layout, its executable or None): the current layout's, so that a
        # step looks up neither (they are asked for at every step)
        self._current: tuple | None = None
        self._spent = None  # the last step's state and batch: freed once the next is dispatched

    def __enter__(self):
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
    def loads(self) -> int:
        """Steps loaded from ``options.executable_cache`` instead of compiled, ahead or not."""
        return 0 if self.steps_cache is None else self.steps_cache.loads

    @property
    def layout(self) -> BatchLayout:
        """How the current layout splits a global batch: rows per rank, gradient units."""
        current, ptc, rows = self._current, self.ptc, self.dataset.global_batch
        if current is None or current[0] is not ptc or current[1] != rows:
            current = self._current = (ptc, rows, self._layout(ptc.config), None)
        return current[2]

    def start(self, init):
        """Lay the job's state out on its initial devices.

        Args:
          init: a function returning the state (an ``nnx.State`` or any pytree of arrays), jitted
            straight into the layout, or the state itself, placed as it is.

        Returns:
          The state, sharded as ``job.ptc``: restored when there is a state to resume (see the
          role's ``_restore_or_build``), else built by ``init``.

        Raises:
          LayoutError: the job already has a layout, or ``config`` has none for the devices.
        """
        if self.ptc is not None:
            raise LayoutError("job.start() lays the state out once; the job already has a layout")
        if callable(init):
            self._abstract = jax.eval_shape(init)
        else:
            self._abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init)
        self._sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
        devices = [self.devices[i] for i in self.initial]
        self.ptc = PTC.of(self._abstract, self.rules, self.config_for(len(devices)), devices)

        def build():
            if callable(init):
                return jax.jit(init, out_shardings=self.ptc.shardings(self._mesh()))()
            return place(init, self.ptc)

        return self._restore_or_build(build)

    def jit(self, fn: Callable, *, program: str | None = None) -> Callable:
        """Compile the user's step per layout.

        Args:
          fn: ``fn(state, batch) -> (state, metrics)``, any JAX code (a ``jax.jit``-ed function
            is unwrapped: the job jits it per layout with the layout's shardings).
          program: a name for ``fn``'s code, the same in every process that runs it (say, the
            model's name and the code's version). With an executable cache, a process then
            loads a step another process stored there with nothing traced or lowered, where
            an unnamed step is traced and lowered once per layout in each process (within one
            process, a step is known by its code object). The name is your promise that the
            code is the same: give new code a new name (docs/elastic.md, "Compiled steps and
            stalls").

        Returns:
          ``step(state, batch) -> (state, metrics)`` for ``job.next``'s state and batch; the state
          is donated and the metrics come back replicated.

        Raises:
          LayoutError: called before ``job.start``, or a ``program`` that is not a non-empty str.
        """
        if program is not None and not (isinstance(program, str) and program):
            raise LayoutError(
                "job.jit's program is a non-empty str naming the step's code (say "
                f"'gpt-small/v3'), got {program!r}"
            )
        if self.ptc is None:
            raise LayoutError("call job.start(init) before job.jit(step): the step needs a layout")
        executables = None
        if self.executable_cache is not None:
            executables = ExecutableCache(
                self.executable_cache, log=self.log, follow=self._follow_seconds
            )
        self.steps_cache = StepCache(
            fn,
            self._sample,
            list(self.devices.values()),
            None if self.options.bitwise else self.options.batch_axes,
            executables,
            switch_interval=self.options.switch_interval,
            donate=self._donates,
            log=self.log,
            program=program,
        )
        self._compiled(self.ptc, ahead=True)
        self._stalled = (None, time.perf_counter())  # time the first step too
        self._not_bitwise = None
        return self._run

    @property
    def bitwise(self) -> bool:
        """Whether the job's layout changes leave every bit of training as it was: see
        ``JobOptions.bitwise``; :attr:`not_bitwise` says why not."""
        return self.not_bitwise is None

    @property
    def not_bitwise(self) -> str | None:
        """Why the job's layout changes may change the numbers (one line), or None: they do not.
        Known once ``job.jit`` has the step (it is traced, abstractly, if it was only loaded)."""
        if self.steps_cache is None:
            raise LayoutError("call job.jit(step) first: whether changes are bitwise is the step's")
        if self._not_bitwise is None:
            self._not_bitwise = (_why_not_bitwise(self),)
            if self._not_bitwise[0] is not None:
                self.log(f"layout changes are not bitwise: {self._not_bitwise[0]}")
        return self._not_bitwise[0]

    def is_bitwise(self, before: ParallelConfig, after: ParallelConfig) -> bool:
        """Whether a change from ``before`` to ``after`` leaves every bit of training as it was:
        any change of a bitwise job; else one that changes only the batch axes' sizes, of a
        step that takes its gradient in units."""
        if self.bitwise:
            return True
        axes = (set(before.shape) | set(after.shape)) - set(self.options.batch_axes)
        if any(before.size(a) != after.size(a) for a in axes) or self.grad_units is None:
            return False
        return _why_not_bitwise(self, by_units=True) is None

    @abc.abstractmethod
    def next(self, state):
        """The step boundary (what the role does between steps), then ``(state, self._batch())``."""

    @abc.abstractmethod
    def finish(self, state) -> None:
        """The end of training (a final checkpoint, the commits finished)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Finish the commit in flight, if any."""

    def close(self) -> None:
        """Stop the compile threads (waits for a compile under way); ``with job:`` calls it."""
        self._prefetched = self._spent = None
        if self.steps_cache is not None:
            self.steps_cache.close()

    def config_for(self, n: int) -> ParallelConfig:
        """The parallel config the job uses on ``n`` devices: ``config(n)``, else
        :func:`tenplex_jax.planner.choose_config` (the planner's, with ``options.profile`` and
        ``options.device_type``). Raises ``LayoutError`` when there is none."""
        if n not in self._configs:
            if self._choose is not None:
                self._configs[n] = self._choose(n)
            else:
                self._configs[n] = choose_config(
                    n,
                    self._abstract,
                    self.rules,
                    self.dataset.global_batch,
                    self.grad_units,
                    profile=self.options.profile,
                    device_type=self.options.device_type,
                )
        return self._configs[n]

    # -- the roles' hooks -------------------------------------------------------------------------

    @abc.abstractmethod
    def _restore_or_build(self, build: Callable[[], object]):
        """The state ``start`` returns, laid out as ``self.ptc``: resumed, or ``build()``."""

    @abc.abstractmethod
    def _after_step(self) -> None:
        """What follows each dispatched step (the step is then ``self.step - 1``)."""

    def _batch(self) -> Batch:
        """The next global batch, laid out for the current mesh (``self.samples``: the sample
        index of each row, -1 for padding); the dataset moves on by one step."""
        ready, self._prefetched = self._prefetched, None
        if ready is not None and ready[0] == (self.step, self.layout, self._mesh()):
            batch, self.samples = ready[1:]
        else:
            tic = time.perf_counter()
            batch, self.samples = self._read(self.step)
            if self._stalled is not None and self._stalled[0] is not None:
                self._stalled[0].batch_seconds = time.perf_counter() - tic
        self.dataset.step += 1
        return batch

    def _read(self, step: int) -> tuple[Batch, np.ndarray]:
        mesh, layout = self._mesh(), self.layout
        axes = self._batch_axes(self.ptc.config)
        data, weights, samples = device_batch(self.dataset, step, layout, mesh, axes)
        return Batch(data, weights, layout, mesh, axes), samples

    def _prefetch(self) -> None:
        """While a step runs: read and place the next global batch for the current layout, which
        the boundary hands out unless it changes the layout (or rewinds the dataset). Read here,
        right after the step's dispatch, it is off the step path of a loop that waits for each
        step's metrics (``float(metrics["loss"])``, as most loops log), where ``job.next`` would
        read it only after the step ended; a loop that waits for nothing reads it no later."""
        step = self.step
        if self.steps is None or step < self.steps:
            self._prefetched = ((step, self.layout, self._mesh()), *self._read(step))

    # -- compiled steps ---------------------------------------------------------------------------

    def _mesh(self):
        devices = tuple(self.devices.values())
        if self._meshed is None or self._meshed[0] is not self.ptc or self._meshed[1] != devices:
            self._meshed = (self.ptc, devices, self.ptc.mesh(devices))
        return self._meshed[2]

    def _batch_axes(self, config: ParallelConfig) -> tuple[str, ...]:
        """The axes of ``config`` a global batch's rows are split over: all of a bitwise job's."""
        return tuple(config.shape) if self.options.bitwise else self.options.batch_axes

    def _layout(self, config: ParallelConfig) -> BatchLayout:
        ranks = math.prod(config.size(axis) for axis in self._batch_axes(config))
        return BatchLayout(self.dataset.global_batch, ranks=ranks, grad_units=self.grad_units)

    def _key(self, ptc: PTC) -> tuple:
        return StepCache.key(ptc, self._layout(ptc.config))

    def _compiled(self, ptc: PTC, *, ahead: bool) -> concurrent.futures.Future:
        return self.steps_cache.get(ptc, self._layout(ptc.config), ahead=ahead)

    def _run(self, state, batch: Batch):
        """Run one step on the current layout (asynchronously, but for the timed steps)."""
        layout = self.layout
        if batch.layout != layout or batch.mesh != self._mesh():
            raise LayoutError(
                f"the batch is laid out for {batch.layout} on "
                f"{show_mesh(batch.mesh, devices=False)}, the job runs {self.ptc.config} on "
                f"{list(self.ptc.device_ids)}: pass the state and batch that job.next returned"
            )
        # the step before's arrays, which the loop has dropped by now: freed once this step is
        # dispatched (see the module docstring); a state kept alive by a step that does not
        # donate it stays the caller's to drop
        spent, self._spent = self._spent, (state, batch) if self._donates else batch
        executable = self._current[3]
        if executable is None:  # the first step on this layout: its compiled step, once
            executable = self._compiled(self.ptc, ahead=False).result().executable
            self._current = (*self._current[:3], executable)
        if self._not_bitwise is None:  # said once, when the first step has been traced
            self.not_bitwise  # noqa: B018
        tic = time.perf_counter()
        with self.steps_cache.dispatch:  # in one order with a warm-up's call (StepCache)
            state, metrics = executable(state, batch)
        dispatched = time.perf_counter()
        # the next batch is read beside the step, not after it; a stall's own first step reads
        # nothing more unless every step is timed: its time is the stall's
        if self.options.exact_step_times or self._stalled is None:
            self._prefetch()
        del spent
        if self.options.exact_step_times or self._stalled is not None:
            jax.block_until_ready((state, metrics))
            done = time.perf_counter()
            self.step_log.append((self.step - 1, done - tic, str(self.ptc.config)))
            if self._stalled is not None:
                record, posted = self._stalled
                if record is not None:
                    record.stall_seconds = done - posted
                    record.dispatch_seconds = dispatched - tic
                    record.first_step_seconds = done - tic
                self._stalled = None
        # after a timed step has run: what follows it (a launched job's background work) never
        # competes with the first step on a layout
        self._after_step()
        return state, metrics


def _why_not_bitwise(job: _JobCore, *, by_units: bool = False) -> str | None:
    """Why the job's changes are not all bitwise (None: they are); with ``by_units``, why not
    even those that change only the batch axes' sizes."""
    if not job.options.bitwise and not by_units:
        return "JobOptions.bitwise is off: tensor, pipe and expert changes reorder reductions"
    for platform in sorted({d.platform for d in job.devices.values()}):
        why = bitwise.unmet(platform)
        if why is not None:
            return why
    seen = job.steps_cache.gradients(job.ptc, job.layout)
    if not (seen.by_units if by_units else seen.bitwise):
        return (
            "the step does not take its gradient with batch.value_and_grad alone, so its "
            "reductions follow the layout"
        )
    return None
