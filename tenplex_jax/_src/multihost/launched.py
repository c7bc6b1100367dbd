"""``LaunchedJob``: the elastic job in a process of ``tenplex-jax launch``, over the same core
as ``ElasticJob``; the process's side of the protocol (stores, commits, the run directory) is
the :class:`Worker`'s."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import pathlib
import threading
from collections.abc import Callable, Iterable

import jax

from tenplex_jax._src.data import DatasetPTC
from tenplex_jax._src.elastic.core import _JobCore
from tenplex_jax._src.elastic.job import use_job_class
from tenplex_jax._src.errors import DataError, LayoutError
from tenplex_jax._src.multihost import distributed, worker
from tenplex_jax._src.multihost.processes import free_port
from tenplex_jax._src.multihost.rundir import Ahead, FirstStep, Grown, RestoreReport
from tenplex_jax._src.multihost.spec import JobSpec
from tenplex_jax._src.multihost.worker import Worker
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules

__all__ = ["LaunchedJob", "main"]


class LaunchedJob(_JobCore):
    """The elastic job of one process of ``tenplex-jax launch``, over every process's devices.

    Scripts write ``tj.ElasticJob(...)``: the launcher's entry point runs the script inside
    ``tj.elastic.use_job_class(LaunchedJob)``, so there it builds a ``LaunchedJob`` from the
    same arguments, and one script runs alone and launched::

        with tj.ElasticJob(rules, dataset, grad_units=8, checkpoint_dir="ckpt") as job:
            state = job.start(init)          # from the stores, the checkpoint, or init()
            step = job.jit(train_step)
            while job.step < 1000:
                state, batch = job.next(state)   # commits; may end the generation (exit 0)
                state, metrics = step(state, batch)
            job.finish(state)                # the last commit, a checkpoint; the launcher told

    ``start`` restores from where the launcher says; ``next`` commits every ``--commit-every``
    steps and raises ``SystemExit(0)`` once the generation has committed for its end; devices
    change only by generation, so the in-process events refuse. A context manager: leaving it
    stops the compile and commit threads and closes the store connections.

    Args:
      rules: the logical-axis rules of the state, as for :class:`tenplex_jax.ElasticJob`.
      dataset: the :class:`tenplex_jax.DatasetPTC`, committed and restored with the model.
      devices: must be None: the job runs on every device of its processes (``jax.devices()``).
      initial: must be None: the launcher, not the script, decides the devices of a generation.
      checkpoint_dir: the orbax tier, when the launcher sets none (then this one reaches the
        launcher as its fallback).
      checkpoint_every: orbax checkpoints at the commits on multiples of this many steps (a
        stop, a preemption and ``finish`` always save one), when the launcher sets none.
      options: a :class:`tenplex_jax.elastic.JobOptions`, but ``preempt_devices`` and
        ``method`` (the layout changes by generation); ``executable_cache`` defaults to
        ``RUN_DIR/executables``, where the next generations load the steps compiled.

    The other arguments are ``ElasticJob``'s; ``steps`` reaches the launcher, which weighs a
    growth over the steps left.

    Raises:
      LayoutError: ``devices`` or ``initial`` given; or this process has no job description
        from the launcher, or has not joined the job (``python -m tenplex_jax.multihost``).
    """

    launched = True
    _follow_seconds = 600.0  # one process compiles each layout, the others load it
    _donates = False  # the last completed step's state stays alive: a survivor's live copy

    def __init__(self, rules: Rules, dataset: DatasetPTC, *, devices=None, initial=None, **kwargs):
        spec = JobSpec.from_env(os.environ)
        if spec is None:
            raise LayoutError(
                "a LaunchedJob runs in a process of tenplex-jax launch, and this process has no "
                "job description from the launcher: use tj.ElasticJob in one process"
            )
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
        super().__init__(rules, dataset, **kwargs)
        self._worker = Worker(spec, self.checkpoint_dir, self.checkpoint_every)
        self._reported = False  # the first step's compile record is written
        self._growths: dict = {}  # processes -> the future lowering (or compile) of its step
        self._growths_lock = threading.Lock()  # announced on the control thread
        self._announcement: int | None = None  # a growth announced before jit
        if not spec.executables:  # the launcher's --no-executable-cache: a plain restart
            self.executable_cache = None
        elif self.executable_cache is None:  # later generations load the layouts compiled before
            self.executable_cache = self._worker.run_dir / "executables"
        if Worker.control is not None:
            Worker.control.watch_growth(self._announced)

    @property
    def process_index(self) -> int:
        """This process's index in its generation (``jax.process_index()``)."""
        return self._worker.process_index

    @property
    def generation(self) -> int:
        """The generation of processes this one belongs to: 0 first, one more per restart."""
        return self._worker.generation

    @property
    def run_dir(self) -> pathlib.Path:
        """The launcher's run directory (its events, control file and records)."""
        return self._worker.run_dir

    @property
    def restored(self) -> RestoreReport | None:
        """How ``start`` got the state: from where (a ``Source``: init, store or checkpoint),
        its step, config, bytes and seconds (a ``tj.multihost.RestoreReport``); None before it."""
        return self._worker.restored

    def next(self, state):
        """The step boundary (a commit every ``--commit-every`` steps, in the background; at the
        generation's end, planned or JAX's preemption sync point, a synchronous commit, then
        ``SystemExit(0)``: the next generation resumes at this step), then the next global batch.

        Args:
          state: the state the last step returned (or ``start``'s).

        Returns:
          ``(state, batch)`` as :meth:`tenplex_jax.ElasticJob.next`.

        Raises:
          SystemExit: ``SystemExit(0)`` at the end of the generation, after its commit.
          LayoutError: called before ``job.start``.
        """
        if self.ptc is None:
            raise LayoutError("call job.start(init) before job.next(state)")
        self._worker.hold(self.step, state)
        action = self._worker.boundary(
            state, self.ptc, self.step, self.dataset, ready=self._ready_for
        )
        if action is not None:
            self.log(f"step {self.step}: generation {self.generation} ends ({action}), committed")
            raise SystemExit(0)
        return state, self._batch()

    def jit(self, fn: Callable, *, program: str | None = None) -> Callable:
        """Compile the user's step for this generation's layout, as
        :meth:`tenplex_jax.ElasticJob.jit` does, through ``RUN_DIR/executables``, where the next
        generations load it; with ``options.compile_ahead``, the steps of the generation after a
        loss and of an announced growth are ready ahead (docs/multihost.md, "Compiles").

        Args:
          fn: ``fn(state, batch) -> (state, metrics)``, as for ``ElasticJob.jit``.
          program: a name for ``fn``'s code, as for ``ElasticJob.jit``: a replacement process
            then loads the steps untraced.

        Returns:
          ``step(state, batch) -> (state, metrics)``. Unlike one process's, it does not donate
          the state: the states of the last two boundaries stay alive, so that at a failure
          the survivors hold their last completed step (docs/multihost.md, "Commits and
          restores"); this costs the memory of about two more states.

        Raises:
          LayoutError: called before ``job.start``, or a ``program`` that is not a non-empty str.
        """
        step = super().jit(fn, program=program)
        with self._growths_lock:
            announced, self._announcement = self._announcement, None
        if announced is not None:
            self._announced(announced)
        return step

    @property
    def _compiles_ahead(self) -> bool:
        """Whether the next generation's step is compiled ahead (process 0 compiles, the others
        lower it): with ``compile_ahead`` and an executable cache (the next generation's
        processes load it from there)."""
        return (
            self.options.compile_ahead
            and self.executable_cache is not None
            and self.steps_cache is not None
        )

    def _compile_ahead(self, processes: int, *, guess: bool):
        """The future step of a generation of the first ``processes`` processes, compiled ahead
        on the guesses' or the announced layouts' thread; None when no layout fits. A guess
        outside process 0 is only lowered (the future says whether it was remembered)."""
        ids = sorted(self.devices)[: processes * self._worker.spec.devices_per_process]
        try:
            config = self.config_for(len(ids))
            target = PTC.of(self._abstract, self.rules, config, [self.devices[i] for i in ids])
        except (LayoutError, DataError) as error:  # no layout for that many devices
            self.log(f"compile-ahead for {processes} processes skipped: {error}")
            return None
        if guess and self._worker.spec.process_id != 0:  # process 0 compiles it
            return self.steps_cache.lower_ahead(target, self._layout(config))
        return self.steps_cache.get(target, self._layout(config), ahead=True, guess=guess)

    def _record_ahead(self, future) -> None:
        """``RUN_DIR/ahead-g<gen>-p<id>.json`` once the step after a loss is ready here: compiled
        (process 0) or lowered and remembered (the others)."""
        if future.cancelled() or future.exception() is not None or not future.result():
            return
        spec = self._worker.spec
        ahead = Ahead(processes=spec.num_processes - 1, compiled=spec.process_id == 0)
        self._worker.write_record(ahead)

    def _ready_for(self, processes: int) -> bool:
        """Whether a planned resize to ``processes`` may end the generation now: a shrink's step
        is compiled ahead (asked for here), or cannot be; a growth's announced work is waited
        for, so the generation ends at the first boundary after the launcher's request."""
        spec = self._worker.spec
        if not self._compiles_ahead or processes <= 0 or processes == spec.num_processes:
            return True
        if processes > spec.num_processes:
            with self._growths_lock:
                future = self._growths.get(processes)
            if future is not None:
                concurrent.futures.wait([future])
            return True
        future = self._compile_ahead(processes, guess=False)
        return future is None or future.done()

    def _announced(self, processes: int) -> None:
        """A growth to ``processes`` announced (on the control thread, or at :meth:`jit` for one
        announced before it): its step lowered ahead, or ``RUN_DIR/grown-g<gen>-p<id>.json``
        says why not, so the launcher waits for nothing."""
        with self._growths_lock:
            if self.steps_cache is None and self.options.compile_ahead and self.executable_cache:
                self._announcement = processes  # lowered at jit
                return
            if processes in self._growths:
                return
            self._growths[processes] = None
        try:
            future = self._lower_growth(processes)
        except Exception as error:  # the growth then traces its step, as without the notice
            self._record_growth(processes, f"{type(error).__name__}: {error}")
            return
        with self._growths_lock:
            self._growths[processes] = future
        if future is not None:
            future.add_done_callback(lambda f, n=processes: self._record_growth(n, f))

    def _lower_growth(self, processes: int):
        """The future work, on the guesses' thread, for the step of a generation grown to
        ``processes`` processes: on CPU in process 0, compiled (:meth:`_compile_grown`); else
        lowered on its layout's abstract mesh. None (and a record of why) when there is none."""
        if not self._compiles_ahead:
            self._record_growth(processes, "no compile-ahead (options or --no-executable-cache)")
            return None
        per = self._worker.spec.devices_per_process
        ids = list(range(processes * per))  # stand-ins
        try:
            config = self.config_for(len(ids))
            target = PTC.of(self._abstract, self.rules, config, ids, hosts=[i // per for i in ids])
        except (LayoutError, DataError) as error:
            self._record_growth(processes, f"no layout: {error}")
            return None
        platform = next(iter(self.devices.values())).platform
        if self.process_index == 0 and platform == "cpu":
            return self.steps_cache.submit(self._compile_grown, processes, config)
        return self.steps_cache.lower_ahead(target, self._layout(config), abstract=True)

    def _compile_grown(self, processes: int, config: ParallelConfig) -> bool:
        """Process 0 on CPU: the grown generation's step compiled on a compile-only topology of
        its devices and stored in the executable cache, its lowering remembered here."""
        per, port = self._worker.spec.devices_per_process, free_port()
        # a failure meanwhile breaks the generation's connections, not the topology's: a
        # topology client whose connection broke would end this process
        with distributed.cpu_topology(processes, per, port=port) as devices:
            target = PTC.of(self._abstract, self.rules, config, devices)
            self.steps_cache.compile_for(target, self._layout(config), devices)
        return True

    def _record_growth(self, processes: int, outcome) -> None:
        """``RUN_DIR/grown-g<gen>-p<id>.json``: whether the growth's step was lowered ahead and
        remembered (``outcome``: its future), or why not (a string); the launcher waits for
        every process's record before it asks for the growth."""
        if isinstance(outcome, str):
            remembered, why = False, outcome
        else:
            error = None if outcome.cancelled() else outcome.exception()
            remembered = error is None and not outcome.cancelled() and bool(outcome.result())
            why = None if error is None else f"{type(error).__name__}: {error}"
        if why is not None:
            self.log(f"the growth to {processes} processes is not lowered ahead: {why}")
        self._worker.write_record(Grown(processes=processes, remembered=remembered, why=why))

    def finish(self, state) -> None:
        """The end of training: the last step committed, a final orbax checkpoint (with a
        checkpoint dir), and the launcher told that the job is done.

        Args:
          state: the state the last step returned.
        """
        self._worker.finish(state, self.ptc, self.step, self.dataset)

    def wait(self) -> None:
        """Finish the commit in flight, if any (raises what it raised)."""
        self._worker.wait()

    def close(self) -> None:
        """Stop the compile and commit threads and close the store connections. A compile ahead
        under way is not waited for (it would hold every process of the next generation): it
        finishes on its thread and stores its executable."""
        self._prefetched = None  # a batch on this generation's devices
        if Worker.control is not None:
            Worker.control.watch_growth(None)
        if self.steps_cache is not None:
            self.steps_cache.close(wait=False)
        self._worker.close()

    # -- what changes devices within a process: refused, or left to the launcher -------------------

    def preempt(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Refused (``LayoutError``) whatever ``devices`` or ``count``: SIGTERM the launcher."""
        self._refuse("preempt")

    def fail(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Refused (``LayoutError``) whatever ``devices`` or ``count``: a lost process ends the
        generation."""
        self._refuse("fail")

    def offer(self, devices: Iterable[int] | None = None, *, count: int | None = None) -> None:
        """Refused (``LayoutError``) whatever ``devices`` or ``count``: RUN_DIR/resize grows."""
        self._refuse("offer")

    def redeploy(self, devices: Iterable[int]) -> None:
        """Refused (``LayoutError``) whatever ``devices``: RUN_DIR/resize asks the launcher."""
        self._refuse("redeploy")

    def expect(self, devices: Iterable[int]) -> None:
        """A hint that the job will run on ``devices`` next, accepted and unused: a launched job
        compiles the one layout of its generation."""

    @contextlib.contextmanager
    def handle_sigterm(self):
        """Leaves SIGTERM to the launcher's protocol (JAX's preemption notice ends the generation
        at a step boundary, after a commit); yields the job."""
        yield self

    def _refuse(self, kind: str):
        raise LayoutError(
            f"job.{kind}(): a launched job's devices change by generation (a lost process, "
            f"RUN_DIR/resize, SIGTERM to the launcher), not within one"
        )

    # -- the core's hooks -------------------------------------------------------------------------

    def _restore_or_build(self, build):
        """From where the launcher says: the stores, the orbax checkpoint, or ``build()``."""
        return self._worker.restore(self.ptc, build, self.dataset)

    def _after_step(self) -> None:
        self._worker.reached(self.step, self.steps)
        if not self._reported:  # how this process got its generation's step: compiled or loaded
            self._reported = True
            step = self._compiled(self.ptc, ahead=False).result()
            self._worker.write_record(
                FirstStep(
                    loaded=step.loaded,
                    traced=step.traced,
                    seconds=step.seconds,
                    compiles=self.compiles,
                    loads=self.loads,
                )
            )
            spec = self._worker.spec
            if self._compiles_ahead and spec.num_processes > 1:
                future = self._compile_ahead(spec.num_processes - 1, guess=True)
                if future is not None:
                    future.add_done_callback(self._record_ahead)


def main(argv: list[str] | None = None) -> int:
    """``python -m tenplex_jax.multihost SCRIPT ARGS``, the entry point of every launched process
    (:func:`worker.main`), with the script's ``tj.ElasticJob(...)`` building a
    :class:`LaunchedJob` (``tj.elastic.use_job_class``)."""
    with use_job_class(LaunchedJob):
        return worker.main(argv)
