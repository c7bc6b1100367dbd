"""``tenplex-jax launch``: run a training script as an elastic multi-process job.

The :class:`Launcher` starts one store per host slot, then generations of workers, each ended by
a failure, a planned resize or SIGTERM, the next one restored from the stores, the orbax
checkpoint or ``init``: docs/multihost.md ("The launcher") states the protocol; ``rundir`` what
the run directory holds. Process 0 writes to the launcher's stdout, the others to
``RUN_DIR/logs/g<gen>-p<id>.log`` (the tail is printed when one fails).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import threading
import time

from tenplex_jax._src.errors import LaunchError, StoreError
from tenplex_jax._src.multihost import distributed
from tenplex_jax._src.multihost.processes import (
    free_port,
    kill,
    release,
    spawn,
    status,
    write_token,
)
from tenplex_jax._src.multihost.rundir import (
    LiveReport,
    Progress,
    RunDir,
    RunEvent,
    Source,
    write,
)
from tenplex_jax._src.multihost.spec import (
    CHECKPOINT,
    CONTROL,
    STANDBY,
    Action,
    JobSpec,
    LaunchOptions,
    Request,
    Restore,
)

__all__ = ["Launcher", "launch"]

SPARE = -1  # the standby kept for a slot the job does not have yet (a growth)
LEAVE_SECONDS = 10.0  # how long a survivor gets to leave its generation before it is killed
ANSWER_SECONDS = 5.0  # how long a store has to show it is alive, once a failure is seen
# how long a planned growth waits for its stores and warm process before it is asked for anyway
GROW_WAIT_SECONDS = 30.0
SERVICE_SHUTDOWN_SECONDS = 15.0  # the most the launcher waits at its end for a service to shut down


@dataclasses.dataclass
class _Slot:
    index: int
    store: subprocess.Popen
    address: str


@dataclasses.dataclass
class _Generation:
    number: int
    slots: list[int]
    workers: list[subprocess.Popen]
    logs: list[pathlib.Path | None]
    restore: Restore
    warm: list[bool]  # per process: a standby or a survivor took the rank
    kept: list[bool]  # per process: a process of the last generation took the rank
    service: object = None  # the coordination service the launcher runs, if it does


@dataclasses.dataclass(frozen=True)
class _Outcome:
    kind: RunEvent  # FINISHED, FAILURE, RESIZE or STOP
    lost_slots: tuple[int, ...] = ()
    count: int | None = None
    detail: str = ""


class Launcher:
    """Runs the job described by ``options``; :meth:`run` returns the exit status.

    One store per host slot, then generations of worker processes until the job finishes, is
    stopped (SIGTERM) or gives up; a failure or a resize (``echo N > RUN_DIR/resize``) starts the
    next generation from the stores. :func:`launch` is ``Launcher(options, log).run()``.

    Args:
      options: the :class:`LaunchOptions`.
      log: called with one line of text per event (default: ``print``); every event also goes
        to ``RUN_DIR/events.jsonl``.
    """

    def __init__(self, options: LaunchOptions, log=None):
        self.options = options
        self.log = log or functools.partial(print, flush=True)
        if options.run_dir is None:
            self.run_dir = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-launch-"))
        else:
            self.run_dir = pathlib.Path(options.run_dir)
        self.store_dir = pathlib.Path(options.store_dir or self.run_dir / "stores")
        self.slots: dict[int, _Slot] = {}
        self._early: dict[int, tuple] = {}  # slot -> (store, ready file), started for a growth
        self.workers: list[subprocess.Popen] = []
        self.standbys: dict[int, subprocess.Popen] = {}  # slot -> a warm process, not yet used
        self.kept: dict[int, subprocess.Popen] = {}  # slot -> a survivor waiting for its rank
        self._terminate = False
        self.token_file: pathlib.Path | None = None
        self._closing: list[threading.Thread] = []  # coordination services shutting down

    # -- the main loop -----------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to its end; every store and worker is killed and reaped on the way out.

        Returns:
          The exit status: 0 when the workers finished or the job was stopped, 1 when the
          launcher gave up (too many restarts, too few slots, no copy of the state: a
          ``LaunchError``, logged as an ``error`` event), 130 on Ctrl-C.
        """
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        for name in (CONTROL, "resize", "progress.json", "finished.json"):
            (self.run_dir / name).unlink(missing_ok=True)
        for pattern in ("left-g*.json", "live-g*.json"):  # an earlier run's
            for record in self.run_dir.glob(pattern):
                record.unlink(missing_ok=True)
        if self.options.token:
            self.token_file = write_token(self.run_dir / "token")
        previous = self._install_signals()
        try:
            self._start_stores(range(self.options.nprocs))
            self._generations(list(range(self.options.nprocs)))
            return 0
        except LaunchError as error:
            self._event(RunEvent.ERROR, detail=str(error))
            return 1
        except KeyboardInterrupt:
            self._event(RunEvent.INTERRUPTED, detail="Ctrl-C: killing every process")
            return 130
        finally:
            self._teardown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _generations(self, slots: list[int]) -> None:
        """Generations on ``slots``, then on what each leaves, until the job finishes or stops;
        ``LaunchError`` when the launcher gives up."""
        opts = self.options
        restarts, number, reached = 0, 0, None
        while True:
            outcome, reached = self._generation(number, slots, reached)
            if outcome.kind in (RunEvent.FINISHED, RunEvent.STOP):
                return
            if outcome.kind == RunEvent.FAILURE:
                restarts += 1
                if restarts > opts.max_restarts:
                    raise LaunchError(
                        f"{restarts} failures, more than --max-restarts {opts.max_restarts}"
                    )
                slots = self._survivors(slots, outcome)
            else:
                slots = self._resized(slots, outcome.count)
            if len(slots) < opts.min_procs:
                raise LaunchError(
                    f"{len(slots)} slots left, fewer than --min-procs {opts.min_procs}"
                )
            number += 1

    def _generation(self, number: int, slots: list[int], reached: int | None):
        """Run generation ``number`` on ``slots`` to its end; (how it ended, the step reached).
        ``reached``: the last generation's, for its lost steps."""
        restore = self._choose_source(number - 1)
        if restore.source == Source.LIVE:  # the survivors' newest completed step is the reach
            newest = [r.newest for r in self._live_reports(number - 1) if r.newest is not None]
            reached = max(newest, default=restore.step)
        gen = self._start_generation(number, slots, restore)
        self._event(
            RunEvent.GENERATION,
            generation=number,
            processes=len(slots),
            slots=slots,
            pids=[w.pid for w in gen.workers],
            warm=gen.warm,
            kept=gen.kept,
            restore=restore.source,
            step=restore.step,
            lost_steps=None if reached is None else max(reached - restore.step, 0),
        )
        outcome = self._watch(gen)
        if outcome.kind == RunEvent.FAILURE:  # before the survivors are told who they are
            outcome = self._confirmed(gen, outcome)
        reached = self._progress(number, default=restore.step)
        self._end_generation(gen, outcome)
        self._event(
            outcome.kind,
            generation=number,
            step=reached,
            lost_slots=list(outcome.lost_slots),
            detail=outcome.detail,
        )
        return outcome, reached

    # -- stores
    # --------------------------------------------------------------------------------------

    def _prepare_stores(self, current: int, count: int) -> None:
        """A planned growth from ``current`` to ``count`` slots: start the new slots' stores now
        (those :meth:`_resized` will name), while the generation trains on to the change, so
        that they listen when it comes."""
        new = [max(self.slots) + 1 + i for i in range(count - current)]
        for i in new:
            if i not in self._early:
                self._early[i] = self._spawn_store(i)
        pids = {i: self._early[i][0].pid for i in new}
        self._event(
            RunEvent.GROWING, slots=pids, detail=f"stores of slots {new} started for the growth"
        )

    def _start_stores(self, indices) -> None:
        started = {}
        for i in indices:  # those started early (a planned growth) are waited for here
            started[i] = self._early.pop(i) if i in self._early else self._spawn_store(i)
            self.slots[i] = _Slot(index=i, store=started[i][0], address="")
        deadline = time.monotonic() + self.options.start_timeout
        for i, (proc, ready) in started.items():
            while not (address := _address(ready)):
                if proc.poll() is not None:
                    raise LaunchError(
                        f"the store of slot {i} exited with {proc.returncode}; see "
                        f"{self.run_dir / 'logs' / f'store-{i}.log'}"
                    )
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"the store of slot {i} did not listen within "
                        f"{self.options.start_timeout:.0f} s"
                    )
                time.sleep(0.05)
            self.slots[i].address = address
        self._event(
            RunEvent.STORES,
            slots={
                i: {"pid": s.store.pid, "address": s.address}
                for i, s in self.slots.items()
                if i in started
            },
            detail=f"stores up for slots {sorted(started)}: "
            + ", ".join(self.slots[i].address for i in sorted(started)),
        )

    def _spawn_store(self, i: int) -> tuple[subprocess.Popen, pathlib.Path]:
        """Start slot ``i``'s store; (its process, the file it writes its address to)."""
        ready = self.run_dir / f"store-{i}.addr"
        ready.unlink(missing_ok=True)
        command = [self.options.python, "-m", "tenplex_jax.multihost.store", "--host", "127.0.0.1"]
        command += [
            "--port",
            "0",
            "--dir",
            str(self.store_dir / str(i)),
            "--ready-file",
            str(ready),
        ]
        if self.token_file is not None:
            command += ["--token-file", str(self.token_file)]
        with open(self.run_dir / "logs" / f"store-{i}.log", "ab") as log:
            return spawn(command, stdout=log, stderr=log), ready

    def _up(self, slot: int) -> bool:
        return slot in self.slots and self.slots[slot].store.poll() is None

    def _token(self) -> str | None:
        return None if self.token_file is None else self.token_file.read_text().strip()

    def _clients(self) -> dict:
        from tenplex_jax._src.multihost.store.client import StoreClient

        clients = {}
        for i in sorted(self.slots):
            if self._up(i):
                with contextlib.suppress(StoreError, OSError):
                    clients[i] = StoreClient(
                        self.slots[i].address, token=self._token(), timeout=30.0
                    )
        return clients

    # -- where the next generation's state comes from ------------------------------------------

    def _choose_source(self, ended: int) -> Restore:
        """Where the next generation restores from: the newest of the survivors' live version
        of generation ``ended``'s failure, the latest complete commit in the stores, each only
        when every shard has a copy on a live store, and the latest orbax checkpoint (the live
        version, then the stores at a tie); ``init`` when nothing was committed. A failure
        whose survivors' memory did not serve is a ``rewind`` event, which says why. Newer,
        incomplete or unreadable versions are deleted: they would mix with the next commits of
        a step."""
        from tenplex_jax._src.multihost.commit import delete_versions, latest_complete

        clients = self._clients()
        try:
            manifest = latest_complete(clients)
            live = latest_complete(clients, live=True)
            checkpoint = self._latest_checkpoint()
            # newest first, the live version before a commit of its step; a version is checked
            # for lost shards (an event names their leaves) only when it would be chosen
            found = [(v.step, rank, v) for rank, v in ((1, live), (0, manifest)) if v is not None]
            source = None
            for step, _, version in sorted(found, key=lambda f: f[:2], reverse=True):
                if checkpoint is not None and checkpoint > step:
                    break
                if self._every_shard_lives(clients, version):
                    source = Source.LIVE if version.live else Source.STORE
                    break
            if source is None and checkpoint is not None:
                source, step = Source.CHECKPOINT, checkpoint
                if found:
                    self._event(
                        RunEvent.FALLBACK,
                        step=step,
                        detail=f"restoring the orbax checkpoint "
                        f"of step {step} from {self._checkpoint_dir()}",
                    )
            elif source is None and not found:  # nothing was committed yet: start over
                source, step = Source.INIT, 0
            elif source is None:
                raise LaunchError(
                    "cannot recover the state: no complete version in the stores has every shard "
                    f"and there is no orbax checkpoint (--checkpoint-dir "
                    f"{self.options.checkpoint_dir})"
                )
            self._rewound(ended, source, step)

            def keep(s: int, live: bool) -> bool:
                if live:
                    return source == Source.LIVE and s == step
                return source in (Source.STORE, Source.LIVE) and s <= step

            delete_versions(clients, keep)
            return Restore(source=source, step=step)
        finally:
            for client in clients.values():
                client.close()

    def _live_reports(self, generation: int) -> list[LiveReport]:
        """What the survivors of ``generation``'s failure kept of its state (none: no failure,
        or no survivor)."""
        run = RunDir(self.run_dir)
        reports = [run.read(LiveReport, generation, p) for p in range(len(self.slots))]
        return [r for r in reports if r is not None]

    def _rewound(self, ended: int, source: Source, step: int) -> None:
        """A ``rewind`` event when the survivors of generation ``ended``'s failure kept its state
        but the next one restores an older step: which leaves forced it, or why."""
        reports = self._live_reports(ended)
        newest = max((r.newest for r in reports if r.newest is not None), default=None)
        if not reports or (source == Source.LIVE and step == newest):
            return
        orphans = sorted({leaf for r in reports for leaf in r.orphans})
        whys = sorted({r.why for r in reports if r.why is not None and not r.orphans})
        kept = sorted({r.step for r in reports if r.step is not None})
        if orphans:
            why = f"no survivor holds every box of the leaves {orphans}"
        elif whys:
            why = "; ".join(whys)
        else:
            why = f"the survivors kept different steps {kept}, or a store lost their copies"
        self._event(
            RunEvent.REWIND,
            step=step,
            source=source,
            newest=newest,
            leaves=orphans,
            detail=f"the survivors' memory (newest completed step {newest}) does not serve the "
            f"state: {why}; restoring {source} step {step}",
        )

    def _every_shard_lives(self, clients: dict, manifest) -> bool:
        """Whether every object of ``manifest`` has a copy on a live store; else an event names
        the leaves of those that have none."""
        from tenplex_jax._src.multihost.commit import missing_objects

        missing = missing_objects(clients, manifest)
        if missing:
            leaves = sorted({o.path for o in missing})
            held = sorted({s for o in missing for s in o.slots})
            self._event(
                RunEvent.REPLICAS_LOST,
                step=manifest.step,
                leaves=leaves,
                detail=f"no copy of {len(missing)} shards of version {manifest.step} "
                f"survives (held by slots {held}, now down): leaves {leaves}",
            )
        return not missing

    def _checkpoint_dir(self) -> pathlib.Path | None:
        """``--checkpoint-dir``, else the one the script's job uses (it says so in the run dir)."""
        if self.options.checkpoint_dir is not None:
            return pathlib.Path(self.options.checkpoint_dir)
        try:
            return pathlib.Path(json.loads((self.run_dir / CHECKPOINT).read_text())["directory"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _latest_checkpoint(self) -> int | None:
        directory = self._checkpoint_dir()
        if directory is None or not directory.exists():
            return None
        from tenplex_jax._src.checkpoint import latest_checkpoint

        return latest_checkpoint(directory)

    # -- generations -----------------------------------------------------------------------------

    def _start_generation(self, number: int, slots: list[int], restore: Restore) -> _Generation:
        opts = self.options
        (self.run_dir / CONTROL).unlink(missing_ok=True)
        # a survivor the next generation has no slot for: told to exit now, reaped once the
        # others have their ranks (its exit takes a fraction of a second)
        leaving = [self.kept.pop(slot) for slot in set(self.kept) - set(slots)]
        for proc in leaving:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        coordinator = self._coordinator(slots[0])
        service = None
        if self.options.keep:  # here, so that no trainer's death takes the others with it
            service = distributed.coordination_service(coordinator, len(slots))
        stores = {i: s.address for i, s in self.slots.items() if self._up(i)}
        workers, logs, warms, kept = [], [], [], []
        for pid in range(len(slots)):
            spec = JobSpec(
                coordinator=coordinator,
                process_id=pid,
                num_processes=len(slots),
                devices_per_process=opts.devices_per_proc,
                generation=number,
                slots=tuple(slots),
                stores=stores,
                replicas=opts.replicas,
                commit_every=opts.commit_every,
                restore=restore,
                run_dir=str(self.run_dir),
                checkpoint_dir=None if opts.checkpoint_dir is None else str(opts.checkpoint_dir),
                checkpoint_every=opts.checkpoint_every,
                token_file=None if self.token_file is None else str(self.token_file),
                executables=opts.executables,
                hosted=service is not None,
                central=opts.central,
            )
            path = None if pid == 0 else self.run_dir / "logs" / f"g{number}-p{pid}.log"
            proc, how = self._start_process(slots[pid], spec, path)
            workers.append(proc)
            warms.append(how is not None)
            kept.append(how == "kept")
            logs.append(path)
        self.workers = workers
        for slot in set(self.standbys) - {*slots, SPARE}:  # a slot the job left: its standby too
            kill(self.standbys.pop(slot))
        for proc in leaving:
            release(proc)
        return _Generation(
            number=number,
            slots=list(slots),
            workers=workers,
            logs=logs,
            restore=restore,
            warm=warms,
            kept=kept,
            service=service,
        )

    def _start_process(self, slot: int, spec: JobSpec, log: pathlib.Path | None):
        """The process of ``spec``'s rank on ``slot`` (its output to ``log``; None: ours): a
        waiting one (:meth:`_activate`), else a fresh one; (it, how it was waiting or None)."""
        proc, how = self._activate(slot, spec.to_env(), log)
        if proc is None and self.options.keep:  # a fresh process, ranked on its stdin as the others
            proc = self._spawn_standbys([slot])[slot]
            self._give_rank(proc, spec.to_env(), log, warm=False)
        elif proc is None:
            env = spec.to_env() | self._worker_env()
            proc = self._spawn_worker(slot, self._command(), env, log)
        return proc, how

    def _refill_standbys(self, gen: _Generation) -> None:
        """A warm process for each of the generation's slots and a spare for a new slot, started
        once the generation has stepped: never beside its start-up and first compile."""
        if not self.options.standby:
            return
        missing = [slot for slot in self._standby_slots(gen) if slot not in self.standbys]
        started = self._spawn_standbys(missing) if missing else {}
        self.standbys |= started
        if started:
            self._event(
                RunEvent.STANDBY,
                generation=gen.number,
                pids={s: w.pid for s, w in started.items()},
                detail=f"warm standby processes for slots {sorted(started)}"
                + (" (-1: a spare, for a new slot)" if SPARE in started else ""),
            )

    def _command(self) -> list[str]:
        opts = self.options
        return [opts.python, "-m", "tenplex_jax.multihost", opts.script, *opts.args]

    def _worker_env(self) -> dict[str, str]:
        env = {"PYTHONUNBUFFERED": "1"}
        if self.options.compile_cache is not None:  # a layout compiled by any generation loads
            env["JAX_COMPILATION_CACHE_DIR"] = str(self.options.compile_cache)
        return env

    def _standby_slots(self, gen: _Generation) -> list[int]:
        """The slots a standby is kept for: the generation's, and a spare for a new slot."""
        return [*gen.slots, SPARE]

    def _give_rank(self, proc, env: dict, log: pathlib.Path | None, *, warm: bool = True) -> None:
        """Hand a waiting process its rank: the environment ``env`` and its output file (None:
        the launcher's own); ``warm``: it was waiting before it was needed. OSError when it is
        gone. Its stdin stays open for the launcher's next messages when survivors stay."""
        if proc.poll() is not None:
            raise BrokenPipeError(f"exited with {proc.returncode}")
        self._tell(proc, {"env": env, "log": None if log is None else str(log), "warm": warm})
        if not self.options.keep:
            proc.stdin.close()

    @staticmethod
    def _tell(proc, message: dict) -> None:
        """One message to a launched process: a JSON line on its stdin (``membership.Control``
        reads it); OSError when it is gone."""
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.flush()

    def _spawn_standbys(self, slots: list[int]) -> dict:
        """A warm process on each of ``slots``' hosts: it imports what the job needs, says so
        (``RUN_DIR/warm-<pid>``), then waits for the rank :meth:`_activate` writes to its stdin
        (its output: the launcher's until then)."""
        env = os.environ | self._worker_env() | {STANDBY: str(self.run_dir)}
        return {slot: spawn(self._command(), env=env, stdin=subprocess.PIPE) for slot in slots}

    def _activate(self, slot: int, env: dict, log: pathlib.Path | None):
        """A waiting process for ``slot`` — the survivor on it, else its standby, else the
        spare — given a rank (``env``) and its output file: ``(process, "kept" or "warm")``, or
        ``(None, None)`` when none is alive (the caller starts a fresh one)."""
        for pool, owner, how in (
            (self.kept, slot, "kept"),
            (self.standbys, slot, "warm"),
            (self.standbys, SPARE, "warm"),
        ):
            proc = pool.pop(owner, None)
            if proc is None:
                continue
            try:
                self._give_rank(proc, env, log)
            except OSError as error:  # BrokenPipeError: it died since the last poll
                self._event(
                    RunEvent.STANDBY_LOST,
                    slot=owner,
                    detail=f"the {how} process of slot {owner} {error}",
                )
                kill(proc)
                continue
            return proc, how
        return None, None

    def _survivors(self, slots: list[int], outcome: _Outcome) -> list[int]:
        """The slots the next generation runs on after a failure: not the failed workers' (on
        one host, a worker's failure is its host's), and only where the store is up."""
        return [s for s in slots if s not in outcome.lost_slots and self._up(s)]

    def _coordinator(self, slot: int) -> str:
        """The jax.distributed coordinator's address for a generation led by ``slot``."""
        return f"127.0.0.1:{free_port()}"

    def _spawn_worker(self, slot: int, command: list[str], env: dict, log: pathlib.Path | None):
        """A worker process on ``slot``'s host (stdout and stderr to ``log``; None: ours)."""
        if log is None:
            return spawn(command, env=os.environ | env)
        with open(log, "wb") as out:
            return spawn(command, env=os.environ | env, stdout=out, stderr=out)

    def _watch(self, gen: _Generation) -> _Outcome:
        """Poll ``gen`` until it ends: a failure, the workers done, or a planned end asked for
        (a growth is asked of the workers once its stores, its warm process and its step are
        ready, at most ``GROW_WAIT_SECONDS`` later)."""
        opts = self.options
        requested, deadline, stepped, ask_by = None, None, False, None
        while True:
            if not stepped and self._progress(gen.number, default=-1) >= 0:
                stepped = True
                self._refill_standbys(gen)
            codes = [w.poll() for w in gen.workers]
            if (failure := self._failure(gen, codes)) is not None:
                return failure
            if all(c == 0 or self._left(gen, i) for i, c in enumerate(codes)):
                if (self.run_dir / "finished.json").exists():
                    return _Outcome(kind=RunEvent.FINISHED)
                if requested is not None:
                    return _Outcome(kind=RunEvent(requested.action), count=requested.processes)
                return _Outcome(
                    kind=RunEvent.FAILURE, detail="every worker exited 0 before finishing"
                )
            if requested is None:
                requested = self._request(len(gen.slots))
                if requested is not None:
                    deadline = time.monotonic() + opts.stop_timeout
                    if requested.action == Action.RESIZE and requested.processes > len(gen.slots):
                        self._prepare_stores(len(gen.slots), requested.processes)
                        self._announce(gen, requested.processes)
                        ask_by = time.monotonic() + GROW_WAIT_SECONDS
                    else:
                        write(self.run_dir / CONTROL, requested)
            elif ask_by is not None and (self._ready_to_grow(gen) or time.monotonic() > ask_by):
                write(self.run_dir / CONTROL, requested)
                ask_by = None
            elif time.monotonic() > deadline:
                return _Outcome(
                    kind=RunEvent.FAILURE,
                    detail=f"the planned {requested.action} took longer than "
                    f"--stop-timeout {opts.stop_timeout:.0f} s",
                )
            time.sleep(0.05)

    def _failure(self, gen: _Generation, codes: list[int | None]) -> _Outcome | None:
        """The failure of ``gen``'s workers whose exit ``codes`` are not 0 (their logs' tails
        printed), or of its stores; None when there is none."""
        failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
        stores_down = [s for s in gen.slots if not self._up(s)]
        if not failed and not stores_down:
            return None
        detail = "; ".join(
            [
                f"process {i} (slot {gen.slots[i]}, pid {gen.workers[i].pid}) {status(codes[i])}"
                for i in failed
            ]
            + [f"the store of slot {s} died" for s in stores_down]
        )
        for i in failed:
            self._tail(gen, i)
        lost = tuple(sorted({gen.slots[i] for i in failed} | set(stores_down)))
        return _Outcome(kind=RunEvent.FAILURE, lost_slots=lost, detail=detail)

    def _confirmed(self, gen: _Generation, outcome: _Outcome) -> _Outcome:
        """The failure ``outcome`` of ``gen`` once every other slot is known alive, the slots
        that do not answer (:meth:`_answering`) added to its lost slots: the survivors the end
        message names each write their part of the live version, and the part of one that is
        already dead never comes (the version is incomplete, and the next generation rewinds
        though the others held every shard). Processes killed together end one at a time, and
        the first end the launcher sees is the failure, while the others look alive."""
        lost = set(outcome.lost_slots)
        silent = sorted(set(gen.slots) - lost - self._answering(set(gen.slots) - lost))
        if not silent:
            return outcome
        found = "; ".join(f"the {self.ANSWERING} of slot {s} does not answer" for s in silent)
        return dataclasses.replace(
            outcome,
            lost_slots=tuple(sorted(lost | set(silent))),
            detail=f"{outcome.detail}; {found}" if outcome.detail else found,
        )

    ANSWERING = "store"  # what answers for a slot in :meth:`_answering`

    def _answering(self, slots) -> set[int]:
        """Those of ``slots`` whose stores are up and answer a new connection's hello within
        ``ANSWER_SECONDS``, all asked at once (a killed store cannot answer, reaped or not)."""
        from tenplex_jax._src.multihost.store.client import StoreClient

        def answers(slot: int) -> bool:
            if not self._up(slot):
                return False
            client = StoreClient(
                self.slots[slot].address, token=self._token(), connect_timeout=ANSWER_SECONDS
            )
            with client:
                return client.ping()

        slots = sorted(slots)
        with concurrent.futures.ThreadPoolExecutor(max(len(slots), 1), "tenplex-answer") as pool:
            return {s for s, ok in zip(slots, pool.map(answers, slots)) if ok}

    def _request(self, current: int) -> Request | None:
        """A planned end of the generation: SIGTERM, or a process count in RUN_DIR/resize."""
        request = None
        if self._terminate:
            request = Request(action=Action.STOP, processes=current)
        resize = self.run_dir / "resize"
        if request is None and resize.exists():
            text = resize.read_text()
            if not text:  # created, not yet written (a shell's > or write_text): look again
                return None
            text = text.strip()
            resize.unlink(missing_ok=True)
            if not text.isdigit() or int(text) < 1:
                self._event(
                    RunEvent.IGNORED, detail=f"RUN_DIR/resize holds {text!r}, not a count >= 1"
                )
                return None
            if int(text) == current:
                return None
            request = Request(action=Action.RESIZE, processes=int(text))
        if request is not None:
            self._event(RunEvent.REQUEST, action=request.action, processes=request.processes)
        return request

    def _announce(self, gen: _Generation, count: int) -> None:
        """Tell the generation's processes, which stay, of the growth to ``count`` processes: each
        lowers the grown layout's step while it trains on (``LaunchedJob``), and says so in
        ``RUN_DIR/grown-g<gen>-p<id>.json``."""
        if gen.service is None:  # survivors do not stay: nothing they lower would serve
            return
        for proc in gen.workers:
            with contextlib.suppress(OSError):
                self._tell(proc, {"grow": count})

    def _ready_to_grow(self, gen: _Generation) -> bool:
        """Whether a planned growth may end the generation: the new slots' stores listen, the
        spare standby has imported what the job needs, and every process that stays has
        lowered the grown step or said why not (the generation trains on meanwhile)."""
        stores = all(_address(ready) for _, ready in self._early.values())
        spare = self.standbys.get(SPARE)  # (a dead one is replaced by a fresh process)
        warm = spare is None or spare.poll() is not None
        warm = warm or (self.run_dir / f"warm-{spare.pid}").exists()
        return stores and warm and self._lowered_growth(gen)

    def _lowered_growth(self, gen: _Generation) -> bool:
        """Whether every process of ``gen`` that stays has lowered an announced growth's step,
        or said why not (:meth:`_announce`)."""
        return gen.service is None or all(
            (self.run_dir / f"grown-g{gen.number}-p{i}.json").exists()
            for i in range(len(gen.workers))
        )

    def _left(self, gen: _Generation, i: int) -> bool:
        """Whether process ``i`` of ``gen`` has left it and waits for a rank (it stays)."""
        return gen.service is not None and (self.run_dir / f"left-g{gen.number}-p{i}.json").exists()

    def _endpoints(self, gen: _Generation) -> list[str]:
        """The collectives endpoints ``gen``'s processes published when they joined it."""
        out = []
        for i in range(len(gen.workers)):
            with contextlib.suppress(OSError, ValueError, KeyError):
                path = self.run_dir / f"endpoints-g{gen.number}-p{i}.json"
                out += json.loads(path.read_text())["endpoints"]
        return out

    def _end_generation(self, gen: _Generation, outcome: _Outcome) -> None:
        """End ``gen``: its survivors leave it and wait for the next rank (with ``keep``; told
        to at a failure), the rest are killed (after ``--grace`` seconds without ``keep``) and
        reaped by PID; a survivor not left within ``LEAVE_SECONDS``, or whose slot the job
        loses, is killed too."""
        if gen.service is not None and outcome.kind in (RunEvent.FAILURE, RunEvent.RESIZE):
            alive = [
                i
                for i, w in enumerate(gen.workers)
                if w.poll() is None and gen.slots[i] not in outcome.lost_slots
            ]
            if outcome.kind == RunEvent.FAILURE:
                message = {
                    "end": outcome.kind,
                    "peers": [w.pid for w in gen.workers],
                    "endpoints": self._endpoints(gen),
                    "survivors": alive if self.options.live else None,
                }
                for i in alive:
                    with contextlib.suppress(OSError):
                        self._tell(gen.workers[i], message)
            deadline = time.monotonic() + LEAVE_SECONDS
            waiting = set(alive)
            while waiting and time.monotonic() < deadline:
                waiting = {
                    i for i in waiting if not self._left(gen, i) and gen.workers[i].poll() is None
                }
                time.sleep(0.01)
            for i in alive:
                if self._left(gen, i) and gen.workers[i].poll() is None:
                    self.kept[gen.slots[i]] = gen.workers[i]
        else:
            deadline = time.monotonic() + self.options.grace
            while any(w.poll() is None for w in gen.workers) and time.monotonic() < deadline:
                time.sleep(0.05)
        for w in gen.workers:
            if w not in self.kept.values():
                kill(w)
        if gen.service is not None:  # 5 s while a process still waits in a call: not waited for
            closing = threading.Thread(target=gen.service.shutdown, daemon=True)
            closing.start()
            self._closing.append(closing)
        self.workers = []

    def _resized(self, slots: list[int], count: int) -> list[int]:
        if count <= len(slots):
            return sorted(slots)[:count]
        new = [max(self.slots) + 1 + i for i in range(count - len(slots))]
        self._start_stores(new)
        return sorted(slots) + new

    def _progress(self, number: int, default: int) -> int:
        """The step generation ``number`` has reached, or ``default`` before its first."""
        progress = RunDir(self.run_dir).read(Progress)
        return progress.step if progress is not None and progress.generation == number else default

    def _tail(self, gen: _Generation, i: int, lines: int = 15) -> None:
        if gen.logs[i] is None:
            return
        with contextlib.suppress(OSError):
            tail = gen.logs[i].read_text(errors="replace").splitlines()[-lines:]
            self.log("\n".join(f"  [p{i}] {line}" for line in tail))

    # -- signals and teardown ------------------------------------------------------------------

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_term(signum, frame):
            self._terminate = True

        return {signal.SIGTERM: signal.signal(signal.SIGTERM, on_term)}

    def _teardown(self) -> None:
        for w in self.kept.values():
            release(w)
        for w in [*self.workers, *self.standbys.values()]:
            kill(w)
        self.standbys, self.kept = {}, {}
        for proc in [s.store for s in self.slots.values()] + [p for p, _ in self._early.values()]:
            kill(proc, signal.SIGTERM, timeout=5.0)
        self._early = {}
        self.workers = []
        # a service still shutting down when the interpreter exits aborts it ("terminate called
        # ... exception not rethrown": its thread is torn down inside C++)
        for closing in self._closing:
            closing.join(timeout=SERVICE_SHUTDOWN_SECONDS)
        self._closing = []

    def _event(self, kind: RunEvent, **fields) -> None:
        record = {"event": kind, "time": time.time(), **fields}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        text = fields.get("detail") or ", ".join(
            f"{k}={v}" for k, v in fields.items() if k not in ("detail", "pids", "slots")
        )
        self.log(f"tenplex launch: {kind}: {text}")


def _address(ready: pathlib.Path) -> str:
    """The address a store wrote to its ready file, or "" while it has not."""
    try:
        return ready.read_text().strip()
    except FileNotFoundError:
        return ""


def launch(options: LaunchOptions, log=None) -> int:
    """Run a job as :class:`Launcher` does; what ``tenplex-jax launch`` calls.

    Args:
      options: the :class:`LaunchOptions`.
      log: called with one line of text per event (default: ``print``).

    Returns:
      The exit status: 0 done or stopped, 1 gave up, 130 interrupted.
    """
    return Launcher(options, log).run()
