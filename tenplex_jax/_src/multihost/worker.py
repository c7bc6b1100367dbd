"""A launched process's side of the job: what ``LaunchedJob`` does underneath.

``tenplex-jax launch`` starts every worker as ``python -m tenplex_jax.multihost SCRIPT ARGS``
(``launched.main``, which runs :func:`main` inside ``tj.elastic.use_job_class(LaunchedJob)``): a
standby process first imports what the job needs (:func:`_warm`) and waits for its rank on
stdin; then :func:`join` configures JAX from the launcher's :class:`JobSpec` and joins
``jax.distributed``, and the script runs as ``__main__``. Its ``LaunchedJob`` drives a
:class:`Worker`: ``restore`` (from the stores, the orbax checkpoint or ``init``), ``boundary``
(the generation's end at a step boundary, or a commit in the background), ``reached`` (progress
after every step) and ``finish``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import numpy as np

from tenplex_jax._src.data import DatasetPTC, DataState
from tenplex_jax._src.errors import DataError, StoreError
from tenplex_jax._src.multihost import distributed, membership
from tenplex_jax._src.multihost.rundir import (
    LiveReport,
    Progress,
    RestoreReport,
    Source,
    record_path,
    write,
)
from tenplex_jax._src.multihost.spec import CHECKPOINT, CONTROL, ENV, STANDBY, Action, JobSpec
from tenplex_jax._src.ptc import PTC


def join(spec: JobSpec, *, timeout: float = 120.0) -> None:
    """Configure JAX for the launched job and join it; before anything starts JAX's backend.
    The endpoints its collectives listen on go to ``RUN_DIR/endpoints-g<gen>-p<id>.json``: the
    launcher hands them to the survivors of a failure (``membership.break_collectives``)."""
    args = spec.coordinator, spec.num_processes, spec.process_id, spec.devices_per_process
    endpoints = membership.join(*args, hosted=spec.hosted, timeout=timeout)
    name = f"endpoints-g{spec.generation}-p{spec.process_id}.json"
    write(pathlib.Path(spec.run_dir) / name, {"endpoints": endpoints})


# seconds a process whose script failed waits for the launcher to say that the generation ended
# (a peer died, and the collectives failed with it): then it stays for the next generation
ENDING_SECONDS = 1.0
# seconds a commit's copy waits for a store to answer its connection before that copy fails
STORE_CONNECT_SECONDS = 10.0
# seconds a survivor waits for its newest held state's step to complete (or fail) at a failure
LIVE_WAIT_SECONDS = 5.0


def main(argv: list[str] | None = None) -> int:
    """``python -m tenplex_jax.multihost SCRIPT ARGS``: join the launched job, run SCRIPT; a
    process the launcher ranks on stdin stays for its next generations while it survives."""
    argv = sys.argv[1:] if argv is None else argv
    if argv:  # as `python SCRIPT` would, before a standby imports what the script imports
        sys.path.insert(0, str(pathlib.Path(argv[0]).resolve().parent))
    control = None
    standby = os.environ.pop(STANDBY, None)
    if standby and argv:
        control = membership.Control()
        _warm(argv[0])
        if os.path.isdir(standby):  # the launcher's run dir: it waits for this for a growth
            pathlib.Path(standby, f"warm-{os.getpid()}").touch()
        if not _ranked(control):
            return 0  # the launcher went away before it needed this process
    spec = JobSpec.from_env(os.environ)
    if spec is None or not argv:
        print(
            "usage: python -m tenplex_jax.multihost SCRIPT [ARGS]: the entry point of a process "
            "started by tenplex-jax launch (its job description is missing)",
            file=sys.stderr,
        )
        return 2
    while True:
        code = _run(spec, argv, control if spec.hosted else None)
        if control is None or not spec.hosted or Worker.finished:
            break
        if code != 0 and not control.wait_ending(ENDING_SECONDS):
            break  # the script's own failure, not its generation's end
        # the generation ended: planned (the script exited 0 after its commit), or broken by a
        # failure elsewhere (the launcher broke the collectives): leave, wait for the next rank
        _leave(spec, broken=control.ending.is_set())
        control.ending.clear()
        if not _ranked(control):
            return 0  # not in the next generation
        spec = JobSpec.from_env(os.environ)
    if code != 0:
        # a failed worker ends now with its status: at a normal exit JAX would wait in
        # jax.distributed's shutdown barrier for peers that are still training, and the
        # launcher would not see the failure until they time out
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0


def _run(spec: JobSpec, argv: list[str], control: membership.Control | None) -> int:
    """Join the generation and run the script as ``__main__``; its exit status. ``control``:
    the launcher may end the generation while the script runs (it unwinds)."""
    sys.argv = list(argv)
    try:
        try:
            if control is not None:
                control.arm()
            with contextlib.nullcontext() if control is None else control.joining():
                join(spec)
            Worker.joined = time.time()
            Worker.control = control
            runpy.run_path(argv[0], run_name="__main__")
        finally:
            if control is not None:
                control.disarm()
    except membership.GenerationEnded:
        return 1
    except SystemExit as done:
        if done.code is not None and not isinstance(done.code, int):
            print(done.code, file=sys.stderr)
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _leave(spec: JobSpec, *, broken: bool) -> None:
    """End this process's part in ``spec``'s generation: close its jobs' threads and store
    connections, leave ``jax.distributed``, tell the launcher (``RUN_DIR/left-g<gen>-p<id>``)."""
    tic = time.perf_counter()
    survivors = None if Worker.control is None else Worker.control.survivors
    if broken and survivors is not None:  # before the backends go: the state is on the devices
        for worker in Worker.opened:
            worker.keep_live(survivors)
    membership.leave(broken=broken)
    for worker in Worker.opened:
        with contextlib.suppress(Exception):  # a broken generation's commit may fail: it is lost
            worker.close()
    Worker.opened.clear()
    Worker.kept = True
    record = {"pid": os.getpid(), "broken": broken, "seconds": time.perf_counter() - tic}
    write(pathlib.Path(spec.run_dir) / f"left-g{spec.generation}-p{spec.process_id}.json", record)


_OUTPUT: tuple[int, int] | None = None  # the launcher's stdout and stderr, as this process got them


def _ranked(control: membership.Control) -> bool:
    """Wait for a rank from the launcher and take it: its environment (the ``JobSpec``) and its
    output file (null: the launcher's own output). False at EOF: the launcher has no use for
    this process."""
    global _OUTPUT
    message = control.rank()
    if message is None:
        return False
    if message.get("warm", True):
        Worker.activated = time.time()
    os.environ.update(message["env"])
    if _OUTPUT is None:
        _OUTPUT = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    if message.get("log"):
        fd = os.open(message["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    else:
        os.dup2(_OUTPUT[0], 1)
        os.dup2(_OUTPUT[1], 2)
    return ENV in os.environ


# what every launched job imports, warmed by a standby process before it has a rank
WARM_MODULES = ("jax.numpy", "flax.nnx", "optax", "orbax.checkpoint", "tenplex_jax._src.checkpoint")
WARM_MODULES += tuple(
    f"tenplex_jax._src.multihost.{m}" for m in ("launched", "commit", "store.client")
)


def _warm(script: str) -> None:
    """A standby process: import what the job will need before it has a rank (never starting
    JAX's backend, which needs the job's device count and ``jax.distributed``)."""
    import importlib

    for name in (*WARM_MODULES, *_script_imports(script)):
        try:
            importlib.import_module(name)
        except Exception:  # the run proper raises it where the script imports it
            continue


def _script_imports(script: str) -> list[str]:
    """The modules ``script`` imports at its top level (what its run would import first)."""
    import ast

    try:
        tree = ast.parse(pathlib.Path(script).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


class Worker:
    """One process's handle on a launched job (see the module docstring)."""

    joined: float | None = None  # when this process had joined jax.distributed (wall clock)
    activated: float | None = None  # when a standby process got its rank
    kept = False  # this process ran an earlier generation and stayed for this one
    finished = False  # the job finished (every process knows it at ``finish``)
    control: membership.Control | None = None  # the launcher's messages, when survivors stay
    # this generation's workers: closed when the process leaves it
    opened: ClassVar[list[Worker]] = []

    def __init__(self, spec: JobSpec, checkpoint_dir=None, checkpoint_every: int | None = None):
        self.spec, self.process_index, self.generation = spec, spec.process_id, spec.generation
        self.run_dir = pathlib.Path(spec.run_dir)
        Worker.opened.append(self)
        # the launcher's flags win; else the script's own, which the launcher then learns
        self.checkpoint_dir = spec.checkpoint_dir or checkpoint_dir
        self.checkpoint_every = spec.checkpoint_every or checkpoint_every
        self.committer = None
        self.clients: dict[int, Any] = {}
        self.last_commit: int | None = None
        self.restored: RestoreReport | None = None
        self._checkpointed: int | None = None  # the newest orbax step, as this process knows
        self._first_progress: tuple[float, int] | None = None  # this generation's first step
        # the states of the last two step boundaries, newest last: at a failure, the newest one
        # whose step completed is this survivor's live copy (the steps do not donate them)
        self._held: collections.deque = collections.deque(maxlen=2)
        self._layout: tuple[PTC, DatasetPTC] | None = None  # set at restore
        if spec.checkpoint_dir is None and checkpoint_dir is not None:
            directory = str(pathlib.Path(checkpoint_dir).absolute())
            self._write(CHECKPOINT, {"directory": directory, "every": checkpoint_every})

    # -- restore ---------------------------------------------------------------------------------

    def restore(self, ptc: PTC, init: Callable[[], Any], dataset: DatasetPTC) -> Any:
        """The job's state laid out as ``ptc``, from where the launcher says; the dataset resumes
        at the restored step. How is ``self.restored``, also in ``RUN_DIR/restore-g<gen>-p<id>``."""
        tic, restoring = time.perf_counter(), time.time()
        source, pulled = self.spec.restore.source, None
        if source == Source.INIT:
            state, step, data_state = init(), 0, None
        elif source in (Source.STORE, Source.LIVE):
            live = source == Source.LIVE
            state, step, data_state, pulled = self._pull(ptc, self.spec.restore.step, live)
        else:
            from tenplex_jax._src.checkpoint import restore_checkpoint

            restored = restore_checkpoint(self.checkpoint_dir, ptc, step=self.spec.restore.step)
            state, step, data_state = restored.state, restored.step, restored.data_state
        if data_state is not None:
            dataset.restore(data_state)
        else:
            dataset.step = step
        jax.block_until_ready(state)
        self.restored = RestoreReport(
            source=source,
            step=step,
            config=str(ptc.config),
            process=self.process_index,
            warm=Worker.activated is not None,
            kept=Worker.kept,
            state_bytes=ptc.nbytes,
            seconds=time.perf_counter() - tic,
            started=_process_start() if Worker.activated is None else Worker.activated,
            joined=Worker.joined,
            restoring=restoring,
            restored=time.time(),
            pull=pulled,
        )
        self.last_commit = step
        self._layout = (ptc, dataset)
        self._held.append((step, state))
        self.write_record(self.restored)
        self._start_committer()
        if self.checkpoint_dir is not None:  # read before any process of this generation saves
            from tenplex_jax._src.checkpoint import saved_steps

            self._checkpointed = max(saved_steps(self.checkpoint_dir), default=None)
        return state

    def _pull(self, ptc: PTC, step: int, live: bool):
        from tenplex_jax._src.multihost.commit import pull, read_manifest

        self._connect()
        manifest = read_manifest(self.clients, step, live=live)
        if manifest is None:
            kind = "live version" if live else "version"
            raise StoreError(f"no live store has the manifest of {kind} {step}")
        arrays, report = pull(self.clients, manifest, ptc, self.spec.slot)
        state = jax.tree_util.tree_unflatten(ptc.treedef, arrays)
        return state, manifest.step, manifest.data_state, report

    def _connect(self) -> None:
        from tenplex_jax._src.multihost.store.client import StoreClient

        for slot, address in self.spec.stores.items():
            if slot not in self.clients:
                try:
                    self.clients[slot] = StoreClient(address, token=self.spec.token(), timeout=60.0)
                except StoreError:
                    continue  # a store that is down: its slot's objects come from replicas

    def _start_committer(self) -> None:
        from tenplex_jax._src.multihost.commit import Committer
        from tenplex_jax._src.multihost.store.replicated import ReplicatedStore

        self._connect()
        spec = self.spec
        missing = [s for s in spec.slots if s not in self.clients]
        if missing:
            raise StoreError(f"the stores of slots {missing} of this generation are not reachable")
        replicas = min(spec.replicas, len(spec.slots) - 1)
        # a loaded host's store may take seconds to answer (a dead one refuses at once, and the
        # launcher ends the generation of a lost host)
        addresses, timeout = [spec.stores[s] for s in spec.slots], STORE_CONNECT_SECONDS
        replicated = ReplicatedStore(
            addresses, replicas=replicas, token=spec.token(), connect_timeout=timeout
        )
        stores = [self.clients[s] for s in spec.slots]
        self.committer = Committer(
            spec.process_id, spec.slots, stores, replicated, replicas, central=spec.central
        )

    # -- the step boundary --------------------------------------------------------------------

    def boundary(
        self,
        state,
        ptc: PTC,
        step: int,
        dataset: DatasetPTC,
        ready: Callable[[int], bool] | None = None,
    ) -> Action | None:
        """At the boundary before step ``step`` (``step`` steps done): ``RESIZE`` or ``STOP``
        once the generation has committed for the launcher's request, ``PREEMPTED`` once it
        has committed at JAX's preemption sync point, else None (after a due background commit).

        Every process calls it at the same step: the request is process 0's, broadcast.
        ``ready(processes)`` tells process 0 whether a planned resize to that many processes
        may end the generation yet (its step compiled ahead); until then the job trains on.
        """
        if step != self.last_commit:  # else just restored: nothing to commit
            action = self.stop_requested(ready)
            if action is not None:
                # a stop always saves; a resize saves when the step is due, as any commit would
                checkpoint = True if action == Action.STOP else None
                self.commit(state, ptc, step, dataset, wait=True, checkpoint=checkpoint)
                return action
            if step % self.spec.commit_every == 0:
                self.commit(state, ptc, step, dataset)
        if distributed.reached_preemption_sync_point(step):
            self.commit(state, ptc, step, dataset, wait=True, checkpoint=True)
            return Action.PREEMPTED
        return None

    def hold(self, step: int, state) -> None:
        """Keep a reference to ``state``, the state at step boundary ``step``, for a failure
        (:meth:`keep_live`); the older of the two held before is let go."""
        if not self._held or self._held[-1][0] != step:
            self._held.append((step, state))

    def keep_live(self, survivors: list[int]) -> LiveReport:
        """After a failure that the processes ``survivors`` of this generation outlived, before
        this one leaves it: its part of the live version of its newest held state whose step
        completed (``commit.commit_live``), unless some box has no holder among the survivors:
        written to its own store and the next ``--replicas`` survivors', as a commit is, so
        that a store dying with the failure loses no part of it. What it kept, or why
        nothing, is ``RUN_DIR/live-g<gen>-p<id>.json``."""
        from tenplex_jax._src.multihost.commit import commit_live, live_objects

        tic = time.perf_counter()
        step = newest = None
        objects = nbytes = 0
        why, orphans = None, ()
        with contextlib.suppress(Exception):  # the commit in flight uses the same connections
            self.wait()
        self._connect()  # again, if the script's job closed them as it unwound
        spec, central = self.spec, self.spec.central
        if self._layout is None:
            why = "the generation failed before this process had its state"
        elif not self._held:
            why = "no state held: this generation's live version was kept before"
        else:
            ptc, dataset = self._layout
            live = live_objects(ptc, spec.slots, survivors, spec.replicas, central=central)
            orphans = live[1]
            deadline = time.monotonic() + LIVE_WAIT_SECONDS
            for held, state in reversed(self._held):
                if not _completed(state, deadline):
                    why = f"the step to {held} did not complete"
                    continue
                newest = held if newest is None else newest
                if orphans:
                    why = f"no survivor holds every box of the leaves {list(orphans)}"
                    break
                state_at = dataclasses.replace(
                    dataset.state(), consumed=dataset.consumed_after(held)
                )
                try:
                    objects, nbytes = commit_live(
                        self.clients,
                        state,
                        ptc,
                        held,
                        state_at,
                        spec.slots,
                        survivors,
                        self.process_index,
                        replicas=spec.replicas,
                        central=central,
                        objects=live[0],
                    )
                except Exception as error:  # its step failed after all, or the store did
                    why = f"the state at step {held}: {type(error).__name__}: {error}"
                    continue
                step, why = held, None
                break
        report = LiveReport(
            step=step,
            newest=newest,
            objects=objects,
            nbytes=nbytes,
            seconds=time.perf_counter() - tic,
            orphans=orphans,
            why=why,
        )
        self.write_record(report)
        self._held.clear()
        return report

    def reached(self, step: int, steps: int | None = None) -> None:
        """Record for the launcher that ``step`` steps are done, of the job's ``steps``
        (:class:`~tenplex_jax._src.multihost.rundir.Progress`)."""
        now = time.time()
        if self._first_progress is None:
            self._first_progress = (now, step)
        first_time, first_step = self._first_progress
        progress = Progress(
            generation=self.generation,
            step=step,
            steps=steps,
            time=now,
            first_time=first_time,
            first_step=first_step,
        )
        self._write("progress.json", progress)

    def write_record(self, record) -> None:
        """Write this process's record of the run directory (``rundir``) for its generation."""
        write(record_path(self.run_dir, type(record), self.generation, self.process_index), record)

    def stop_requested(self, ready: Callable[[int], bool] | None = None) -> Action | None:
        """``RESIZE`` or ``STOP`` when the launcher asked this generation to end (a collective:
        every process gets process 0's answer, so all stop at the same step); a resize waits
        for ``ready(processes)``."""
        actions = (Action.RESIZE, Action.STOP)
        code = 0
        if self.process_index == 0:
            try:
                request = json.loads((self.run_dir / CONTROL).read_text())
                action = request.get("action")
                code = actions.index(action) + 1 if action in actions else 0
                waits = action == Action.RESIZE and ready is not None
                if waits and not ready(request["processes"]):
                    code = 0  # its layout is still compiling: train on meanwhile
            except FileNotFoundError:
                code = 0  # no request
        code = int(distributed.broadcast_one_to_all(np.int32(code)))
        return actions[code - 1] if code else None

    def commit(
        self,
        state,
        ptc: PTC,
        step: int,
        dataset: DatasetPTC,
        *,
        wait: bool = False,
        checkpoint: bool | None = None,
    ) -> None:
        """Commit ``state`` as version ``step`` to the stores; in the background unless ``wait``.
        The shards are copied to host memory before this returns (the next step may donate
        ``state``). ``checkpoint`` also saves an orbax checkpoint (default: every
        ``checkpoint_every`` steps, when there is a checkpoint dir)."""
        if dataset.step != step:
            raise DataError(
                f"the dataset has delivered {dataset.step} global batches but the state is "
                f"committed at step {step}"
            )
        data_state = dataset.state()
        self.committer.commit(state, ptc, step, data_state, wait=wait)
        self.last_commit = step
        if checkpoint is None:
            every = self.checkpoint_every
            checkpoint = every is not None and step % every == 0
        if checkpoint:
            self._checkpoint(state, ptc, step, data_state)

    def _checkpoint(self, state, ptc: PTC, step: int, data_state: DataState) -> None:
        """An orbax checkpoint of ``step`` unless there is one: every process decides alike, from
        what it saw at restore and what it saved since (a directory listing could lag behind the
        other processes' saves and split the collective save)."""
        if self.checkpoint_dir is None or self._checkpointed == step:
            return
        from tenplex_jax._src.checkpoint import save_checkpoint

        save_checkpoint(self.checkpoint_dir, state, ptc, step=step, data_state=data_state)
        self._checkpointed = step

    def wait(self) -> None:
        """Finish the commit in flight, if any (raises what it raised)."""
        if self.committer is not None:
            self.committer.wait()

    def finish(self, state, ptc: PTC, step: int, dataset: DatasetPTC) -> None:
        """End of training: commit the last step (the boundary after it never comes), save a
        final orbax checkpoint (with a checkpoint dir), and tell the launcher the job is done."""
        if step != self.last_commit:
            self.commit(state, ptc, step, dataset, wait=True, checkpoint=True)
        self.committer.wait(collect=True)
        self._checkpoint(state, ptc, step, dataset.state())
        Worker.finished = True
        self._write("finished.json", {"generation": self.generation, "step": step})

    def close(self) -> None:
        if self.committer is not None:
            self.committer.close()
        for client in self.clients.values():
            client.close()
        self.clients = {}

    def _write(self, name: str, record) -> None:
        """Write process 0's record (a dataclass or a dict) into the run dir, atomically."""
        if self.process_index == 0:
            write(self.run_dir / name, record)


def _completed(state, deadline: float) -> bool:
    """Whether every array of ``state`` is alive (not donated) and its computation has ended,
    successfully or not, by ``deadline`` (``time.monotonic()``)."""
    arrays = jax.tree.leaves(state)
    if any(a.is_deleted() for a in arrays):
        return False
    if all(a.is_ready() for a in arrays):
        return True
    ended = threading.Event()

    def wait():
        with contextlib.suppress(Exception):  # a failed step has ended too: its copy raises
            jax.block_until_ready(arrays)
        ended.set()

    threading.Thread(target=wait, name="tenplex-live", daemon=True).start()
    return ended.wait(max(deadline - time.monotonic(), 0.0))


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()
