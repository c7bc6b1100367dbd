"""Compiled train steps, one per layout: the cache, compile-ahead and the persistent cache.

``StepCache`` holds the user's step ``fn(state, batch) -> (state, metrics)`` compiled for each
(parallel config, device order, batch layout) it has met. A compile runs either now, on the caller's
thread, or ahead, on a background thread (one for announced layouts, one for guesses), as
``jax.jit(fn, in_shardings=..., out_shardings=...).lower(abstract state, abstract batch)
.compile()``: the abstract state is the PTC's ``ShapeDtypeStruct`` tree with shardings and the
abstract batch a :class:`Batch` of them, so no array exists on the new devices while their step
compiles. Each entry is a future; asking for one that is compiling waits for it, one still queued
behind other guesses is compiled at once on the caller's thread instead, one that failed is compiled
again.

With an :class:`ExecutableCache`, each entry first tries the executable stored for its lowered
program on disk (a load, counted in ``loads``, not ``compiles``) and stores what it compiles, so
no process compiles a layout that it, or a process in its position, compiled before.
``enable_compilation_cache`` turns JAX's persistent compilation cache on instead: process-wide,
and it still lowers and hands XLA's cache the program.

While a step traces and lowers on a background thread, Python's thread switch interval is lowered
(``switch_interval``, 0.1 ms by default; :class:`_SwitchInterval` says why).

A step asked for ahead with ``warm`` is then run once on zero inputs on its layout's devices,
before its future is done (:meth:`StepCache.warm_up`): an executable's first run does one-time
work that its later runs reuse, so the first step on a new layout took 2-4x a steady step. On
XLA:CPU (jax 0.10.2 and 0.12) that work is building the runtimes of the program's YNNPACK
fusions (``YnnFusionThunk::CreateYnnExecutable``, slinky's pipeline simplification), done at a
fusion's first execution and pooled with the executable; it does not depend on the values. The
warm-up holds a second state's memory on the layout's devices while it runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax._src import bitwise, compat
from tenplex_jax._src.batch import BATCH_AXES, Batch
from tenplex_jax._src.data import BatchLayout
from tenplex_jax._src.elastic import programs
from tenplex_jax._src.elastic.executables import ExecutableCache
from tenplex_jax._src.ptc import PTC

SWITCH_INTERVAL = 1e-4  # seconds, while a step compiles in the background (the interpreter's: 5e-3)


class Status(enum.StrEnum):
    """Where a layout's step is in :class:`StepCache` (``queued``: ahead, not started)."""

    READY = "ready"
    RUNNING = "running"
    QUEUED = "queued"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A step compiled for one layout, how long XLA took (or the load, when ``loaded``), whether
    it ran ahead, whether it was loaded from the :class:`ExecutableCache` (no XLA compile), and
    whether it was traced (a load of a program this process lowered before is not)."""

    executable: Any
    seconds: float
    ahead: bool
    loaded: bool = False
    traced: bool = True  # False: loaded as a program this process lowered before (programs.py)
    # the run on zero inputs, ahead, that did the executable's one-time work (StepCache.warm_up);
    # None: not run (not asked for, or not possible: see StepCache.warm_up)
    warm_up_seconds: float | None = None


class StepCache:
    """``fn`` compiled per (config, device order, batch layout); ``compiles`` counts XLA compiles,
    ``loads`` the executables loaded from ``executables`` instead.

    ``sample`` is one dataset item with a leading dim of 1 (its shapes and dtypes make the abstract
    batch); ``devices`` are the devices meshes are built from; ``batch_axes``, the mesh axes a
    batch's rows are split over (None: every axis of each mesh, a bitwise job's);
    ``executables``, when given, the on-disk cache each entry tries before compiling and stores
    its compile in (closed with this);
    ``donate=False`` compiles steps that leave their input state alive (a virtual worker's, whose
    minibatches read older weights than the current ones); ``switch_interval``, the most Python's
    thread switch interval may be while a step compiles on a background thread (None: leave it);
    ``log``, called with a line when a warm-up could not run; ``program``, the name the user
    gave ``fn`` (:func:`programs.named`): a process then loads the steps another process
    lowered and stored in ``executables`` with nothing traced.

    ``dispatch`` is the lock every call of a compiled step is made under, the job's steps and
    the warm-ups alike: two programs enqueued from two threads then reach every device in the
    same order, so their collectives cannot cross (each device waiting in the other program's).
    """

    def __init__(
        self,
        fn: Callable,
        sample,
        devices: Sequence[jax.Device],
        batch_axes: Sequence[str] | None = BATCH_AXES,
        executables: ExecutableCache | None = None,
        donate: bool = True,
        switch_interval: float | None = SWITCH_INTERVAL,
        log: Callable[[str], None] | None = None,
        program: str | None = None,
    ):
        self.fn = getattr(fn, "__wrapped__", fn)  # a jax.jit-ed step: it is jitted per layout here
        self.program = program
        self.donate = donate
        self.sample, self.devices = sample, list(devices)
        self.batch_axes = None if batch_axes is None else tuple(batch_axes)  # None: every axis
        self.seen: bitwise.Seen | None = None  # what the last trace of ``fn`` took its gradient by
        self.executables = executables
        self.switch_interval = switch_interval
        self.log = log or (lambda text: None)
        self.compiles = self.loads = self.warm_ups = 0
        # (start, end) of each piece of work on the compile threads (perf_counter seconds)
        self.background: list[tuple[float, float]] = []
        self.dispatch = threading.Lock()
        self._futures: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pools = {  # announced layouts, guesses
            # the current layout and the two announced beside it: each starts when announced
            False: concurrent.futures.ThreadPoolExecutor(3, "tenplex-compile"),
            True: concurrent.futures.ThreadPoolExecutor(1, "tenplex-compile-guess"),
        }
        self._queued: set[concurrent.futures.Future] = set()  # submitted by compile-ahead
        self._turns = _Turns()  # background lowerings, one at a time, in the order asked

    @staticmethod
    def key(ptc: PTC, layout: BatchLayout) -> tuple:
        return (ptc.config, ptc.device_ids, layout)

    def __contains__(self, key) -> bool:
        return key in self._futures

    def status(self, key) -> Status | None:
        """The step's :class:`Status`, or None: never asked for."""
        future = self._futures.get(key)
        if future is None:
            return None
        if future.done():
            return Status.FAILED if future.cancelled() or future.exception() else Status.READY
        return Status.QUEUED if future in self._queued and not future.running() else Status.RUNNING

    def ready(self, key) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def get(
        self, ptc: PTC, layout: BatchLayout, *, ahead: bool, guess: bool = False, warm: bool = False
    ) -> concurrent.futures.Future:
        """The future step for ``ptc`` and ``layout``: cached, compiling, or compiled now (or, with
        ``ahead``, queued on a background thread: guesses on their own, so that a long guess
        never delays an announced layout; with ``warm`` too, run once there on zero inputs
        before it is ready: :meth:`warm_up`)."""
        key = self.key(ptc, layout)
        with self._lock:
            future = self._futures.get(key)
            if self.status(key) == Status.FAILED:  # a compile that failed, ahead: compile it again
                self._queued.discard(future)
                future = None
            elif not ahead and self.status(key) == Status.QUEUED and future.cancel():
                future = None  # queued behind other guesses: compile it now instead of waiting
            now = future is None and not ahead
            if future is None and ahead:
                ticket = self._turns.ticket()
                future = self._pools[guess].submit(
                    self._background, self._ahead, ptc, layout, ticket, warm
                )
                future.add_done_callback(lambda _, ticket=ticket: self._turns.drop(ticket))
                self._queued.add(future)
                self._futures[key] = future
            elif future is None:
                future = self._futures[key] = concurrent.futures.Future()
        if now:
            try:
                future.set_result(self.compile(ptc, layout))
            except Exception as error:  # the next request compiles again
                with self._lock:
                    del self._futures[key]
                future.set_exception(error)
                raise
        return future

    def compile(
        self,
        ptc: PTC,
        layout: BatchLayout,
        ahead: bool = False,
        ticket: int | None = None,
        *,
        load: bool = True,
    ) -> Compiled:
        """``fn`` for ``ptc`` and ``layout``, lowered from abstract values afresh (whatever
        steps this cache holds): loaded from ``executables`` when stored there and ``load`` is
        True, else compiled by XLA (and then stored there). A program this process lowered
        before for the layout (:mod:`programs`: a survivor running its script again) is loaded
        without tracing it again. ``ticket``: a background compile's turn to lower (see
        :class:`_Turns`)."""
        mesh, state, batch = self._abstract(ptc, layout)
        known = self._program(ptc, layout, state)
        lowering = programs.recall(known) if known is not None and load else None
        if lowering is None and known is not None and load:  # lowered ahead on its shape
            lowering = programs.recall(_anywhere(known))
        if lowering is None and known is not None and load:  # named: lowered by another process
            lowering = self._recall_named(known, mesh)
        if lowering is not None:  # lowered before: load it untraced
            if lowering.seen is not None:  # what its trace saw, as though traced now
                self.seen = lowering.seen
            tic = time.perf_counter()
            trees = (lowering.digest, jax.tree.structure(((state, batch), {})), lowering.out_tree)
            executable = self.executables.load(None, mesh, known=trees)
            if executable is not None:
                with self._lock:
                    self.loads += 1
                return Compiled(executable, time.perf_counter() - tic, ahead, True, traced=False)
            if lowering.lowered is not None:  # lowered ahead on the abstract mesh: compile it
                step = self._compiled_ahead(lowering, mesh, trees, ahead)
                if step is not None:
                    return step
        with self._turns.turn(ticket):  # Python under the GIL: one at a time, in order
            lowered, seen = self._lower(mesh, ptc, state, batch)
            if self.executables is not None:
                digest = self._remember_lowered(known, lowered, mesh, seen)
        if self.executables is None:
            return self._compile(lowered, mesh, ahead, None)
        if load and lowering is None:  # (a remembered program's miss was this key's miss)
            tic = time.perf_counter()
            trees = (digest, lowered.in_tree, lowered.out_tree)
            executable = self.executables.load(lowered, mesh, known=trees)
            if executable is not None:
                with self._lock:
                    self.loads += 1
                return Compiled(executable, time.perf_counter() - tic, ahead, loaded=True)
        return self._compile(lowered, mesh, ahead, digest)

    def _ahead(self, ptc: PTC, layout: BatchLayout, ticket: int, warm: bool) -> Compiled:
        step = self.compile(ptc, layout, True, ticket)
        return self.warm_up(ptc, layout, step) if warm else step

    def warm_up(self, ptc: PTC, layout: BatchLayout, step: Compiled) -> Compiled:
        """``step`` with its executable run once, on zero inputs on ``ptc``'s devices (a batch of
        zeros weighted 1), its results dropped: the executable's one-time work (see the module
        docstring) is then done before the job's first step on the layout. ``step`` as it is
        when the layout spans devices of other processes (each would have to run it, in the
        same order among their programs) or when the run fails (``log`` says why).

        The zero state is donated, so the run holds one state and the step's temporaries on the
        devices; it is skipped where the devices' memory statistics (a GPU's) say that would
        take more than half the memory free on one of them, beside the state training there. A
        step whose control flow depends on the values (a ``while_loop`` on the data)
        may not end on zeros: ``JobOptions.warm_up`` turns this off."""
        mesh, state, batch = self._abstract(ptc, layout)
        if any(d.process_index != jax.process_index() for d in mesh.devices.flat):
            return step
        skipped = f"the step for {ptc.config} on {list(ptc.device_ids)} not warmed up"
        crowded = _crowded(step, mesh)
        if crowded is not None:
            self.log(f"{skipped}: {crowded}")
            return step
        tic = time.perf_counter()
        try:
            inputs = _zeros((state, batch))
            with self.dispatch:
                outputs = step.executable(*inputs)
            del inputs  # donated
            jax.block_until_ready(outputs)
            del outputs
        except Exception as error:  # the warm-up only saves time: the step runs as it is
            self.log(f"{skipped}: {error!r}")
            return step
        with self._lock:
            self.warm_ups += 1
        return dataclasses.replace(step, warm_up_seconds=time.perf_counter() - tic)

    def _compiled_ahead(self, lowering, mesh: Mesh, trees: tuple, ahead: bool) -> Compiled | None:
        """The step lowered ahead on ``mesh``'s ``AbstractMesh``, compiled for its devices with
        nothing traced; None if it cannot be (it is then traced as any step). Its arguments'
        tree names the abstract mesh (a ``Batch`` carries its mesh), so the executable is loaded
        again from its bytes under the tree of the arguments it will be called with."""
        try:
            step = self._compile(lowering.lowered, mesh, ahead, lowering.digest)
            payload = compat.serialize_executable(step.executable)
            executable = compat.deserialize_executable(
                payload, trees[1], trees[2], mesh.devices.flat
            )
        except Exception as error:  # e.g. host callbacks: not serializable
            if self.executables is not None:
                self.executables.log(f"a step lowered ahead was traced again: {error!r}")
            return None
        return dataclasses.replace(step, executable=executable, traced=False)

    def lower_ahead(
        self, ptc: PTC, layout: BatchLayout, *, abstract: bool = False
    ) -> concurrent.futures.Future:
        """Lower the step for ``ptc`` and ``layout`` on the guesses' thread and remember it
        (:mod:`programs`), compiling nothing: a process that another compiles a layout for, so
        that it loads the executable untraced when the layout comes. With ``abstract``, on the
        layout's ``AbstractMesh``: ``ptc``'s devices need not exist in this process yet (a
        planned growth); the lowering is kept, and compiles for them untraced once they do. The
        future's result is whether it was remembered (False: no executable cache, or ``fn`` has
        no fingerprint)."""
        return self.submit(self._remember, ptc, layout, abstract)

    def submit(self, work: Callable, *args) -> concurrent.futures.Future:
        """``work(*args)`` on the guesses' thread, as a background compile runs."""
        return self._pools[True].submit(self._background, work, *args)

    def compile_for(self, ptc: PTC, layout: BatchLayout, devices) -> Compiled:
        """The step for ``ptc`` over ``devices`` that belong to no backend of this process's
        job (a compile-only topology: a planned growth's, whose processes do not exist yet;
        ``ptc`` names them): lowered on the layout's ``AbstractMesh`` and remembered for the
        layout on any devices (:func:`_anywhere`), compiled for ``devices`` and stored in the
        executable cache under their key, which the grown job's processes compute for their
        own devices: they load it, this process untraced, and a new process untraced too when
        the step is named. Needs ``executables``."""
        mesh, state, batch = self._abstract(ptc, layout, abstract=True)
        known = self._program(ptc, layout, state, anywhere=True)
        lowered, seen = self._lower(mesh, ptc, state, batch)
        target = ptc.mesh(devices)  # a named step's entry too: a new process loads it untraced
        digest = self._remember_lowered(known, lowered, target, seen)
        return self._compile(lowered, target, True, digest)

    def _background(self, work: Callable, *args):
        """``work(*args)`` on a compile thread, the switch interval lowered while it runs."""
        tic = time.perf_counter()
        try:
            with SWITCH.at_most(self.switch_interval):
                return work(*args)
        finally:
            self.background.append((tic, time.perf_counter()))

    def _remember(self, ptc: PTC, layout: BatchLayout, abstract: bool = False) -> bool:
        mesh, state, batch = self._abstract(ptc, layout, abstract=abstract)
        known = self._program(ptc, layout, state, anywhere=abstract)  # devices may differ then
        if known is None:
            return False
        if programs.recall(known) is None and (abstract or not self._recall_named(known, mesh)):
            lowered, seen = self._lower(mesh, ptc, state, batch)
            self._remember_lowered(known, lowered, mesh, seen, keep=abstract)
        return programs.recall(known) is not None

    def _remember_lowered(
        self,
        known: tuple | None,
        lowered: jax.stages.Lowered,
        mesh,
        seen: bitwise.Seen,
        *,
        keep: bool = False,
    ) -> bytes:
        """``lowered``'s digest, remembered under ``known`` with what its trace ``seen``, when
        it has a key and a load may pass its output tree with fresh inputs (and stored for
        other processes with ``mesh`` when the program is named); ``keep``: with ``lowered``
        itself (lowered ahead on an abstract mesh, to compile later)."""
        digest = self.executables.digest(lowered)
        if known is not None and _outputs_fit(lowered):
            lowering = programs.Lowering(digest, lowered.out_tree, seen, lowered if keep else None)
            programs.remember(known, lowering)
            named = programs.stable(_anywhere(known))  # the mesh's devices are in its key
            if named is not None and not isinstance(mesh, AbstractMesh):  # for other processes
                self.executables.note(named, mesh, dataclasses.replace(lowering, lowered=None))
        return digest

    def _recall_named(self, known: tuple, mesh: Mesh) -> programs.Lowering | None:
        """What a named program lowered to for ``known`` on ``mesh`` in another process (its
        entry in the executable cache), remembered here too; None: not stored, or not named."""
        named = programs.stable(_anywhere(known))
        lowering = None if named is None else self.executables.recall(named, mesh)
        if lowering is not None:
            programs.remember(known, lowering)
        return lowering

    def _program(
        self, ptc: PTC, layout: BatchLayout, state, *, anywhere: bool = False
    ) -> tuple | None:
        """The key this step's lowering for ``ptc`` and ``layout`` is remembered under (see
        :mod:`programs`; with ``anywhere``, for the layout on any devices: :func:`_anywhere`),
        or None: no executable cache to load from, or ``fn`` has neither a name nor a
        fingerprint."""
        if self.executables is None:
            return None
        if self.program is not None:
            fn = programs.named(self.program)
        else:
            fn = programs.fingerprint(self.fn)
        if fn is None:
            return None
        sample = programs.signature(self.sample)
        key = (
            fn,
            ptc.config,
            ptc.device_ids,
            layout,
            self.batch_axes,
            self.donate,
            sample,
            programs.signature(state),
        )
        return _anywhere(key) if anywhere else key

    def _compile(
        self, lowered: jax.stages.Lowered, mesh: Mesh, ahead: bool, digest: bytes | None
    ) -> Compiled:
        tic = time.perf_counter()
        if self.executables is None:
            executable = lowered.compile()
        else:  # its entry written in the background
            executable = self.executables.compile(lowered, mesh, digest)
        seconds = time.perf_counter() - tic
        with self._lock:
            self.compiles += 1
        return Compiled(executable, seconds, ahead)

    def _abstract(
        self, ptc: PTC, layout: BatchLayout, *, abstract: bool = False
    ) -> tuple[Mesh, Any, Batch]:
        """The layout's mesh (with ``abstract``, its ``AbstractMesh``: no devices), abstract
        state and abstract batch (with their shardings)."""
        mesh = ptc.config.abstract_mesh() if abstract else ptc.mesh(self.devices)
        axes = self.axes(mesh)
        rows = NamedSharding(mesh, P(axes))
        abstract_batch = Batch(
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((layout.rows, *x.shape[1:]), x.dtype, sharding=rows),
                self.sample,
            ),
            jax.ShapeDtypeStruct((layout.rows,), np.float32, sharding=rows),
            layout,
            mesh,
            axes,
        )
        return mesh, ptc.abstract(mesh), abstract_batch

    def axes(self, mesh) -> tuple[str, ...]:
        """The mesh axes a batch's rows are split over on ``mesh``."""
        return tuple(mesh.axis_names) if self.batch_axes is None else self.batch_axes

    def gradients(self, ptc: PTC, layout: BatchLayout) -> bitwise.Seen:
        """How ``fn`` takes its gradients (:class:`tenplex_jax._src.bitwise.Seen`): as its last
        trace did, else traced for ``ptc`` and ``layout`` now (abstractly: nothing compiles)."""
        if self.seen is None:
            _, state, batch = self._abstract(ptc, layout)
            with bitwise.watch() as seen:
                jax.eval_shape(self.fn, state, batch)
            self.seen = seen
        return self.seen

    def _lower(
        self, mesh: Mesh, ptc: PTC, state, batch: Batch
    ) -> tuple[jax.stages.Lowered, bitwise.Seen]:
        """``fn`` jitted with the layout's shardings and lowered on the abstract values, and how
        its trace took its gradients."""
        shardings = ptc.shardings(mesh)
        rows = NamedSharding(mesh, P(batch.batch_axes))
        batch_shardings = Batch(
            jax.tree.map(lambda _: rows, self.sample), rows, batch.layout, mesh, batch.batch_axes
        )
        jitted = jax.jit(
            self.fn,
            in_shardings=(shardings, batch_shardings),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnums=0 if self.donate else (),
        )
        with bitwise.watch() as seen:
            if isinstance(mesh, AbstractMesh):  # no devices: lowered for their platform
                platform = self.devices[0].platform
                lowered = jitted.trace(state, batch).lower(lowering_platforms=(platform,))
            else:
                lowered = jitted.lower(state, batch)
        self.seen = seen
        return lowered, seen

    def cancel_queued(self) -> None:
        """Drop the compile-ahead requests not started yet (to submit them again in a new order)."""
        with self._lock:
            for key, future in list(self._futures.items()):
                if future in self._queued and future.cancel():
                    del self._futures[key]
                    self._queued.discard(future)

    def done(self) -> list[Compiled]:
        """The steps compiled so far."""
        futures = list(self._futures.values())
        return [f.result() for f in futures if f.done() and f.exception() is None]

    def close(self, *, wait: bool = True) -> None:
        """Stop the compile threads (waiting for a compile under way), then the cache's writes.

        ``wait=False`` drops the queued compiles and returns at once: a compile under way
        finishes on its thread and still stores its executable (a launched process leaving its
        generation, whose next generation may load it)."""
        for pool in self._pools.values():
            pool.shutdown(wait=wait, cancel_futures=not wait)
        if self.executables is not None and wait:
            self.executables.close()


def _anywhere(known: tuple) -> tuple:
    """A program's key (:meth:`StepCache._program`) for its layout on whatever devices: a
    lowering on the layout's ``AbstractMesh`` is the same text on any of them (checked on jax
    0.10 and 0.12), so one lowered ahead, before the devices existed, serves the devices a
    later generation numbers its own way (on CPU, process ``p``'s from ``p * 2048``)."""
    return (*known[:2], None, *known[3:])


class _SwitchInterval:
    """Python's thread switch interval (``sys.setswitchinterval``), at most a given value while
    any background compile runs: process-wide, as the setting is.

    A thread that gives up the GIL (every JAX call, every wait for a device) asks for it back; the
    thread running Python code hands it over only at the switch interval. A compile ahead traces
    and lowers the step in Python for a second or more, so at the interpreter's 5 ms the training
    loop waited up to 5 ms at each of its JAX calls (``benchmarks/RESULTS.md`` has the slowdown
    measured). The lowering gets the GIL less often meanwhile and runs about twice as long: the
    job's steps come first. At 0.5 ms each of the loop's JAX calls still waited up to that long:
    on 2 cores the Philly replay's loop lost 0.2 s more beside its warm-ups than at 0.1 ms, and
    lowering at 0.1 ms was no slower. (Beside XLA's own compile, which runs without the GIL, the
    setting changes nothing.)

    The first background compile to start saves the setting; the last to end puts it back, unless
    someone else changed it meanwhile (theirs is kept).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._saved = self._ours = None

    @contextlib.contextmanager
    def at_most(self, seconds: float | None):
        if seconds is None:
            yield
            return
        with self._lock:
            if self._running == 0:
                self._saved = sys.getswitchinterval()
            self._running += 1
            if sys.getswitchinterval() > seconds:
                sys.setswitchinterval(seconds)
            self._ours = sys.getswitchinterval()
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and sys.getswitchinterval() == self._ours:
                    sys.setswitchinterval(self._saved)


SWITCH = _SwitchInterval()


WARM_UP_SHARE = 0.5  # the most of a device's free memory a warm-up may take


def _crowded(step: Compiled, mesh: Mesh) -> str | None:
    """Why a warm-up of ``step`` on ``mesh`` would not fit beside what its devices hold now (its
    arguments, outputs and temporaries against ``WARM_UP_SHARE`` of the free memory of the
    fullest device); None when it fits, or when the backend keeps no statistics (CPU)."""
    stats = [d.memory_stats() for d in mesh.devices.flat]
    if not all(s and "bytes_limit" in s for s in stats):
        return None
    free = min(int(s["bytes_limit"]) - int(s.get("bytes_in_use", 0)) for s in stats)
    try:
        m = step.executable.memory_analysis()
        need = (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )
    except Exception as error:  # no analysis: no way to know it fits
        return f"its memory is unknown ({error!r})"
    if need > WARM_UP_SHARE * free:
        return (
            f"it needs {need:,} bytes a device, over {WARM_UP_SHARE:.0%} of the {free:,} bytes "
            f"free on the fullest one"
        )
    return None


def _zeros(abstract):
    """Arrays laid out as ``abstract``'s ``(state, Batch)`` of ``ShapeDtypeStruct`` leaves: zeros,
    but the batch's weights, which are 1 (no row is padding, so a loss normalized by the weights
    stays finite). Each shard is put from a host array of zeros (untouched pages, which hold no
    memory until read), not made by a program: that would be one more compile per layout before
    the step is ready."""
    state, batch = abstract
    weights = _filled(batch.weights, 1)
    return jax.tree.map(_filled, state), dataclasses.replace(
        batch, data=jax.tree.map(_filled, batch.data), weights=weights
    )


def _filled(x: jax.ShapeDtypeStruct, value: int = 0) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # PRNG keys: no NumPy dtype
        return jnp.full(x.shape, value, x.dtype, device=x.sharding)
    shard = x.sharding.shard_shape(x.shape)
    # a host array per shard: on CPU a shard may alias its host array, and each is donated
    fill = (
        (lambda: np.zeros(shard, x.dtype)) if value == 0 else lambda: np.full(shard, value, x.dtype)
    )
    return jax.make_array_from_callback(x.shape, x.sharding, lambda index: fill())


def _outputs_fit(lowered: jax.stages.Lowered) -> bool:
    """Whether a later load may pass ``lowered``'s output tree with a fresh input tree: the state
    it returns has the tree of the state it takes (no mesh or device in either)."""
    try:
        return lowered.out_tree.children()[0] == lowered.in_tree.children()[0].children()[0]
    except (AttributeError, IndexError):
        return False


class _Turns:
    """Background lowerings one at a time, in the order their compiles were asked for (the
    order the job needs their layouts: its own first, then the announced ones in order).

    Tracing and lowering are Python, under the GIL: three lowered at once (a job's first layout
    and the two announced beside it) each took three times as long, so the layout needed first
    was ready last. XLA's compiles, after the lowering, still run side by side. A ticket whose
    compile was cancelled or ended is dropped; one asked for earlier that has not started within
    ``grace`` seconds (queued behind a busy thread of another pool) holds no one up; a compile
    on the caller's thread (no ticket) never waits.
    """

    def __init__(self, grace: float = 0.05):
        self.grace = grace  # seconds: a thread about to take an earlier ticket, not one queued
        self._changed = threading.Condition()
        self._issued = 0
        self._open: set[int] = set()  # issued, not yet lowered or dropped
        self._started: set[int] = set()  # of those, the ones whose thread waits for its turn
        self._busy = False

    def ticket(self) -> int:
        with self._changed:
            self._issued += 1
            self._open.add(self._issued)
            return self._issued

    def drop(self, ticket: int) -> None:
        with self._changed:
            self._open.discard(ticket)
            self._started.discard(ticket)
            self._changed.notify_all()

    @contextlib.contextmanager
    def turn(self, ticket: int | None):
        if ticket is None:
            yield
            return
        with self._changed:
            self._started.add(ticket)
            self._changed.notify_all()
            patient_until = time.monotonic() + self.grace

            def mine() -> bool:
                waiting = self._started if time.monotonic() > patient_until else self._open
                return not self._busy and not any(t < ticket for t in waiting)

            while not mine():
                self._changed.wait(self.grace)
            self._busy = True
        try:
            yield
        finally:
            with self._changed:
                self._busy = False
                self._open.discard(ticket)
                self._started.discard(ticket)
                self._changed.notify_all()


def enable_compilation_cache(directory: str | pathlib.Path) -> None:
    """JAX's persistent compilation cache in ``directory``, for every compile however small.

    JAX caches only compiles longer than ``jax_persistent_cache_min_compile_time_secs`` (1 s by
    default) and entries of at least ``jax_persistent_cache_min_entry_size_bytes``; both are set
    to cache everything, since a resize's step is small on CPU yet still worth not recompiling.
    Process-wide, and effective from the next compile even when JAX has compiled before the call
    (JAX is made to read its cache settings again)::

        tj.elastic.enable_compilation_cache("/tmp/jax-cache")

    Args:
      directory: where JAX keeps the compiled executables (``jax_compilation_cache_dir``); a
        process that calls this with the same directory later, e.g. a restarted one, reads the
        steps compiled before from it.
    """
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compat.reset_compilation_cache()  # JAX decides once per process; decide again with this dir
