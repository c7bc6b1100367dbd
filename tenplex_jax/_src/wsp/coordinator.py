"""The coordinator (Hydrozoa's): virtual workers join and leave while the others keep training.

A :class:`Coordinator` starts VWs on device groups (``add``), lets them finish their wave and leave
(``remove``) or ends them without a word (``kill``: the others drop it after the ledger's timeout
and train its unpushed minibatches), or does all of it from a resource trace (``follow``); with a
planner it re-plans the running VWs when the devices change (``replan``: stages and ``Nm``, applied
at a wave boundary, :mod:`~tenplex_jax._src.wsp.replan`). VWs run
as threads of this process (:class:`Threads`) or as processes of their own (:class:`Processes`:
``python -m tenplex_jax.wsp``, its own JAX and devices: one dies or starts without touching the
others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tenplex_jax._src.elastic.trace import ResourceTrace
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp.policy import ScalingDecision
from tenplex_jax._src.wsp.ps import ParameterServer
from tenplex_jax._src.wsp.waves import WaveRecord
from tenplex_jax._src.wsp.worker import VirtualWorker

WATCH_SECONDS = 0.5  # the longest ``follow`` waits for the ledger before it looks at its VWs


class VWEventKind(enum.StrEnum):
    """What changed in a job of VWs (:class:`VWEvent`)."""

    ADD = "add"  # a VW started
    REMOVE = "remove"  # a VW told to leave
    KILL = "kill"  # a VW ended without a word
    DECIDE = "decide"  # a scaling policy decided (``tj.wsp.Scaler``)
    REPLAN = "replan"  # the VWs re-planned for the devices (``Coordinator.replan``)


@dataclasses.dataclass(frozen=True)
class VWEvent:
    """A change of a job's VWs, as its :class:`Coordinator` logged it.

    Attributes:
      kind: what changed.
      vw: the VW added, removed or killed, or the one a decision names (None: an offer's).
      devices: its devices, or those offered.
      time: ``time.time()`` when it happened.
      decision: a ``DECIDE`` event's :class:`tenplex_jax.wsp.ScalingDecision` (its reason and
        numbers).
    """

    kind: VWEventKind
    vw: str | None
    devices: tuple[int, ...]
    time: float
    decision: ScalingDecision | None = None


@dataclasses.dataclass
class Member:
    name: str
    devices: tuple[int, ...]
    handle: object  # what the runner's ``start`` returned
    started: float


class Runner(Protocol):
    """How a :class:`Coordinator` starts and ends VWs: :class:`Threads` or :class:`Processes`.

    ``start`` builds a VW (its step compiled or loaded) and returns its handle, which every
    other method takes; the VW joins the job only when ``launch``-ed, together with the VWs
    added with it.
    """

    errors: list  # (name, what) of every VW that failed

    def start(self, name: str, devices: tuple[int, ...]) -> object:
        """Build VW ``name`` on the device ids ``devices``; its handle."""

    def launch(self, *handles) -> None:
        """Let the VWs added together join the job."""

    def stop(self, handle) -> None:
        """Tell the VW to leave at its next wave boundary."""

    def kill(self, handle) -> None:
        """End the VW without a word, as a crash: it pushes nothing more and falls silent (the
        others drop it once its heartbeats have stood still for the timeout)."""

    def alive(self, handle) -> bool:
        """Whether the VW runs."""

    def wait(self, handle, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the VW to end."""

    def records(self, handle) -> list[WaveRecord]:
        """The VW's wave records so far."""


@dataclasses.dataclass(frozen=True)
class ThreadHandle:
    """A VW of :class:`Threads`: its thread (started at launch), the VW, its stop event."""

    thread: threading.Thread
    worker: VirtualWorker
    stop: threading.Event


class Threads:
    """VWs as threads of this process, each on its own devices: a :class:`Runner`.

    Args:
      make: ``make(name, devices) -> VirtualWorker``: builds a VW (its step compiled) when it is
        added; its thread starts when it is launched.

    Attributes:
      errors: ``(name, exception)`` of every VW thread that raised.
    """

    def __init__(self, make: Callable[[str, tuple[int, ...]], VirtualWorker]):
        self.make = make
        self.errors: list[tuple[str, BaseException]] = []

    def start(self, name: str, devices: tuple[int, ...]) -> ThreadHandle:
        """``make(name, devices)``; its thread, not started yet."""
        worker = self.make(name, devices)
        stop = threading.Event()

        def run():
            try:
                worker.run(stop)
            except BaseException as error:  # reported by the coordinator
                self.errors.append((name, error))

        thread = threading.Thread(target=run, name=f"wsp-{name}", daemon=True)
        return ThreadHandle(thread=thread, worker=worker, stop=stop)

    def launch(self, *handles: ThreadHandle) -> None:
        """Start the threads of ``handles``."""
        for handle in handles:
            handle.thread.start()

    def stop(self, handle: ThreadHandle) -> None:
        """Set ``handle``'s stop event."""
        handle.stop.set()

    def kill(self, handle: ThreadHandle) -> None:
        """Set ``handle``'s VW's ``crashed`` event."""
        handle.worker.crashed.set()

    def alive(self, handle: ThreadHandle) -> bool:
        """Whether ``handle``'s thread runs."""
        return handle.thread.is_alive()

    def wait(self, handle: ThreadHandle, timeout: float) -> None:
        """Join ``handle``'s thread (it cannot be killed: it may still run after ``timeout``)."""
        handle.thread.join(timeout)

    def records(self, handle: ThreadHandle) -> list[WaveRecord]:
        """``handle``'s VW's records."""
        return list(handle.worker.records)


class Processes:
    """VWs as processes: ``python -m tenplex_jax.wsp --job JOB --name N --devices K ...``, each
    with ``K`` devices of its own, no ``jax.distributed`` job shared with another VW; records
    come back as JSON lines in ``run_dir``. A :class:`Runner`; a handle is the tuple of the VW's
    ``subprocess.Popen``, its leader first. A process builds (compiles or loads its step), then
    waits (``--hold``) until every VW added with it is built too: VWs added together join
    together, as threads do.

    With ``nodes`` (device ``d`` is on node ``nodes[d]``: ``Cluster.nodes``), a VW whose devices
    are on several nodes runs a process per node, with as many devices each, in a
    ``jax.distributed`` job of its own (:mod:`~tenplex_jax._src.wsp.group`): when one of them
    fails, the others are killed, so the VW dies whole and the others drop it.

    Args:
      job: ``"MODULE:FUNCTION"``: ``FUNCTION(devices, **options)`` returns the job's parts
        (``rules``, ``dataset``, ``init``, ``train_step``, ``config``, optionally ``grad_units``).
      stores: the parameter server's store addresses.
      run_dir: where each VW's log (``<name>.log``) and records (``<name>.jsonl``) go.
      options: more command-line options of ``python -m tenplex_jax.wsp`` (``--minibatches``,
        ``--distance``, ``--slowdown``, ``--timeout``, ``--platform``,
        ``--option KEY=VALUE``).
      token_file: a file holding the stores' secret, if any.
      python: the interpreter the VWs run in.
      nodes: each device's node (None: every VW in one process).
      executables: a directory for the VWs' compiled programs (``--executables``): a VW
        that replaces another on the same devices loads them instead of compiling.
      options_for: ``options_for(name, devices)``: more command-line options for one VW (its
        ``--minibatches``, ``--slowdown``, ``--option config=...``), after ``options``.
    """

    def __init__(
        self,
        job: str,
        stores: Sequence[str],
        run_dir: pathlib.Path,
        *,
        options: Sequence[str] = (),
        token_file: str | None = None,
        python: str = sys.executable,
        nodes: Sequence[int] | None = None,
        options_for: Callable[[str, tuple[int, ...]], Sequence[str]] | None = None,
        executables: str | os.PathLike | None = None,
    ):
        self.nodes, self.options_for = nodes, options_for
        self.started: dict[str, tuple[subprocess.Popen, ...]] = {}
        self.ended: set[int] = set()  # the PIDs this runner killed
        self._built: dict[int, int] = {}  # PID -> the read end of its "built" pipe, till launch
        self.job, self.stores, self.run_dir = job, list(stores), pathlib.Path(run_dir)
        self.options, self.token_file, self.python = list(options), token_file, python
        if executables is not None:
            self.options += ["--executables", str(executables)]
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, devices: tuple[int, ...]) -> tuple[subprocess.Popen, ...]:
        """VW ``name``'s processes, one per node its ``devices`` are on.

        Raises:
          WSPError: the VW has unequal numbers of devices on its nodes (``"invalid"``).
        """
        from tenplex_jax._src.multihost.processes import free_port

        nodes: dict[int, int] = {}
        for d in devices:
            node = 0 if self.nodes is None else self.nodes[d]
            nodes[node] = nodes.get(node, 0) + 1
        if len(set(nodes.values())) != 1:
            raise WSPError(
                f"VW {name!r} on devices {list(devices)} has unequal numbers of devices on its "
                f"nodes (node: devices there): {nodes}; a VW's processes run one program, on "
                f"as many devices each",
                "invalid",
            )
        count, local = len(nodes), len(devices) // len(nodes)
        options = [
            *self.options,
            *(self.options_for(name, tuple(devices)) if self.options_for else ()),
        ]
        if count > 1:
            options += ["--processes", str(count), "--coordinator", f"127.0.0.1:{free_port()}"]
        procs = tuple(
            self._spawn(name, local, options + (["--process", str(i)] if count > 1 else []), i)
            for i in range(count)
        )
        self.started[name] = procs
        if count > 1:  # one process's failure ends its VW
            for proc in procs:
                threading.Thread(
                    target=self._end_with, args=(proc, procs), daemon=True, name=f"wsp-watch-{name}"
                ).start()
        return procs

    def _end_with(self, proc: subprocess.Popen, group: Sequence[subprocess.Popen]) -> None:
        """Wait for ``proc``; if it failed (neither 0 nor 3, a dropped VW's status), kill the
        rest of its VW's ``group``: they would wait in a collective for it for ever."""
        if proc.wait() not in (0, 3):
            self.kill(group)

    @property
    def errors(self) -> list[tuple[str, str]]:
        """``(name, what)`` of every VW process that failed (not killed by this runner)."""
        from tenplex_jax._src.multihost.processes import status

        return [
            (name, f"process {i} {status(proc.returncode)}")
            for name, procs in self.started.items()
            for i, proc in enumerate(procs)
            if proc.returncode not in (None, 0, 3) and proc.pid not in self.ended
        ]

    def _spawn(self, name: str, local: int, options: list[str], index: int) -> subprocess.Popen:
        command = [self.python, "-m", "tenplex_jax.wsp", "--job", self.job, "--name", name]
        command += ["--devices", str(local), "--stores", ",".join(self.stores)]
        command += ["--records", str(self.run_dir / f"{name}.jsonl"), *options]
        if self.token_file:
            command += ["--token-file", self.token_file]
        # no preexec_fn: this process runs JAX's threads, so the child must exec at once (its own
        # session keeps a Ctrl-C at the terminal to the coordinator, which ends it by PID)
        log_name = f"{name}.log" if index == 0 else f"{name}.{index}.log"
        read, write = os.pipe()  # "built" comes back on it; go goes to its stdin (launch)
        try:
            with open(self.run_dir / log_name, "wb") as log:
                proc = subprocess.Popen(
                    [*command, "--hold", str(write)],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=log,
                    pass_fds=(write,),
                    start_new_session=True,
                    env=os.environ | {"PYTHONUNBUFFERED": "1"},
                )
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._built[proc.pid] = read
        return proc

    def launch(self, *handles) -> None:
        """Say go to the processes of ``handles`` once every one of them is built or has ended
        (a thread waits for them, not the caller)."""
        procs = [proc for handle in handles for proc in handle]
        pipes = [self._built.pop(proc.pid) for proc in procs]
        threading.Thread(
            target=self._release, args=(procs, pipes), daemon=True, name="wsp-release"
        ).start()

    def _release(self, procs: Sequence[subprocess.Popen], pipes: Sequence[int]) -> None:
        for pipe in pipes:  # each process says "built" on its pipe, or ends (the pipe's end)
            with os.fdopen(pipe, "rb") as built:
                built.readline()
        for proc in procs:  # go; a process that ended has no reader
            with contextlib.suppress(OSError):
                proc.stdin.write(b"go\n")
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def stop(self, handle) -> None:
        """SIGTERM ``handle``'s processes (the VW's leader decides when it leaves)."""
        for proc in handle:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def kill(self, handle) -> None:
        """SIGKILL ``handle``'s processes and reap them. Every one still running is this
        runner's to end before the first is killed: a follower whose leader dies exits on its
        own (a status of 1), and is no failure when this kill was the cause. One that exited
        before is not this runner's, though its waiting thread may not have reaped it yet."""
        from tenplex_jax._src.multihost.processes import exited
        from tenplex_jax._src.multihost.processes import kill as kill_process

        self.ended.update(proc.pid for proc in handle if not exited(proc))
        for proc in handle:
            kill_process(proc)
            if proc.pid in self._built:  # killed before it was launched
                os.close(self._built.pop(proc.pid))

    def alive(self, handle) -> bool:
        """Whether ``handle``'s leader runs."""
        from tenplex_jax._src.multihost.processes import exited

        return not exited(handle[0])

    def wait(self, handle, timeout: float) -> None:
        """SIGKILL ``handle``'s processes still running after ``timeout``."""
        from tenplex_jax._src.multihost.processes import kill as kill_process

        deadline = time.monotonic() + timeout
        for proc in handle:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                kill_process(proc)

    def records(self, handle) -> list[WaveRecord]:
        """``handle``'s, read from ``run_dir/<name>.jsonl`` (none when it does not exist yet)."""
        args = handle[0].args
        path = self.run_dir / f"{args[args.index('--name') + 1]}.jsonl"
        if not path.exists():
            return []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        return [WaveRecord.from_json(json.loads(line)) for line in lines]


class Coordinator:
    """Starts and ends the VWs of the job on ``ps`` with ``runner`` (:class:`Threads` or
    :class:`Processes`); every change is an event in ``events``.

    A context manager: leaving it kills every VW still running. Example::

        with Coordinator(ps, Threads(make_vw)) as coordinator:
            coordinator.add([0, 1], [2, 3])          # vw1, vw2
            coordinator.follow(trace, group=2)       # offers add VWs, preemptions remove them
            coordinator.wait()

    Args:
      ps: the job's :class:`ParameterServer` (the coordinator reads the ledger).
      runner: the :class:`Runner`: :class:`Threads` or :class:`Processes`.
      log: called with one line of text per event (default: silent).
      planner: ``planner(device ids) -> WSPChoice`` (``tj.wsp.plan_workers`` on the cluster's
        description of them): :meth:`replan` plans with it, and :meth:`follow` re-plans at each
        change of the trace's devices. None: VWs are added and ended as told.

    Attributes:
      members: name -> the running VWs.
      gone: name -> the VWs removed or killed.
      events: every :class:`VWEvent`, in order.
      plans: the sorted device ids of each VW of the last plan -> its ``WorkerPlan``
        (:meth:`plan_of`, which the runner's ``make`` reads).
      replans: every :class:`~tenplex_jax._src.wsp.replan.Replanned`, in order.
    """

    def __init__(
        self,
        ps: ParameterServer,
        runner: Runner,
        log: Callable | None = None,
        *,
        planner: Callable | None = None,
    ):
        self.ps, self.runner, self.log, self.planner = ps, runner, log, planner
        self.plans: dict[tuple[int, ...], object] = {}
        self.replans: list = []
        self.members: dict[str, Member] = {}
        self.gone: dict[str, Member] = {}
        self.events: list[VWEvent] = []
        self._count = 0

    def add_event(
        self, kind: VWEventKind, vw: str | None, devices, decision: ScalingDecision | None = None
    ) -> None:
        """Log a :class:`VWEvent` of ``kind`` for ``vw`` on ``devices`` (a ``DECIDE``'s
        ``decision``), now, and its line."""
        event = VWEvent(
            kind=kind, vw=vw, devices=tuple(devices), time=time.time(), decision=decision
        )
        self.events.append(event)
        if self.log is not None:
            said = "" if decision is None else f", {decision.action}: {decision.reason}"
            self.log(f"wsp: {kind}: vw={vw}, devices={list(devices)}{said}")

    def add(self, *groups: Sequence[int]) -> list[str]:
        """Start a VW on each of ``groups`` of device ids; their names (``vw1, vw2, ...``, numbered
        over the job). All are built before any starts, so they join together (each at the
        slowest member's clock, after pulling the global weights).

        Raises:
          WSPError: the runner refused a group (``"invalid"``): the VWs of this call already
            started are killed, none of them joins.
        """
        added = []
        try:
            for devices in groups:
                self._count += 1
                name, devices = f"vw{self._count}", tuple(devices)
                handle = self.runner.start(name, devices)
                self.members[name] = Member(
                    name=name, devices=devices, handle=handle, started=time.time()
                )
                added.append(name)
        except BaseException:
            for name in added:
                self.runner.kill(self.members.pop(name).handle)
            raise
        self.runner.launch(*(self.members[name].handle for name in added))
        for name in added:
            self.add_event(VWEventKind.ADD, name, self.members[name].devices)
        return added

    def remove(self, name: str) -> None:
        """End the running VW ``name`` with notice: it finishes its wave, pushes it, and leaves
        (a ``KeyError`` if no running VW has that name)."""
        member = self.members.pop(name)
        self.runner.stop(member.handle)
        self.gone[name] = member
        self.add_event(VWEventKind.REMOVE, name, member.devices)

    def kill(self, name: str) -> None:
        """End the running VW ``name`` without a word (a preemption without notice, a crash): the
        others drop it after the ledger's timeout, and its unpushed minibatches are trained by
        others (a ``KeyError`` if no running VW has that name)."""
        member = self.members.pop(name)
        self.runner.kill(member.handle)
        self.gone[name] = member
        self.add_event(VWEventKind.KILL, name, member.devices)

    def plan_of(self, devices: Sequence[int]):
        """The last plan's ``WorkerPlan`` for the VW on ``devices`` (None: not planned)."""
        return self.plans.get(tuple(sorted(devices)))

    def replan(self, devices: Sequence[int], timeout: float = 600.0):
        """The cluster is now ``devices``: plan its VWs with the planner and apply the plan at a
        wave boundary (VWs it keeps train on; the others push their wave and leave, their leases
        back in the ledger; the new ones join from the parameter server's weights). Logged as a
        ``REPLAN`` event; returns the ``Replanned`` record. ``timeout``: the seconds each VW
        told to leave has to end.

        Raises:
          WSPError: no planner, a plan over other devices, or a VW that did not leave.
          PlanError: no plan fits ``devices`` (nothing is stopped).
        """
        from tenplex_jax._src.wsp.replan import replan

        done = replan(self, devices, timeout)
        self.replans.append(done)
        self.add_event(VWEventKind.REPLAN, None, done.devices)
        return done

    def held(self) -> list[int]:
        """The device ids the running VWs hold, sorted."""
        return sorted(d for m in self.members.values() for d in m.devices)

    def free(self, devices: Sequence[int]) -> list[int]:
        """Those of the device ids ``devices`` that no running VW uses, in their order."""
        used = {d for m in self.members.values() for d in m.devices}
        return [d for d in devices if d not in used]

    def follow(
        self, trace: ResourceTrace, group: int, *, timeout: float = 600.0, scaler=None
    ) -> None:
        """Apply a resource trace's events as the job trains; return when the run is done (or
        no VW is left running: each that failed is in the runner's ``errors``).

        An event applies when the job has committed as many minibatches as its step. An offer
        of ``count`` devices adds ``count // group`` VWs on free devices; a preempt (removed)
        or fail (killed) of ``count`` ends the VWs holding the job's last ``count`` devices.
        With a ``scaler``, Hydrozoa's policy decides instead: each group offered is taken or
        declined (and a VW taken is reviewed), and a preempt of any ``count`` devices removes
        the least efficient VWs. With a ``planner`` (and no scaler), an offer or a preempt
        re-plans the VWs for the devices held then (:meth:`replan`); a failure kills the VWs
        on the failed devices (the others drop them) without a re-plan.

        Args:
          trace: the :class:`tenplex_jax.elastic.ResourceTrace` (its steps count minibatches).
          group: devices per VW.
          timeout: seconds the job may take.
          scaler: a :class:`tenplex_jax.wsp.Scaler` of this coordinator, or None.

        Raises:
          WSPError: the job did not finish within ``timeout`` (``"busy"``), or an event is not
            an offer, preempt or fail (``"invalid"``).
        """
        deadline = time.monotonic() + timeout
        pending, ledger = list(trace.events), self.ps.ledger()
        while True:
            trained = ledger.trained_count
            while pending and trained >= pending[0].step:
                self._apply(pending.pop(0), group, trace.devices, scaler)
            if ledger.done or not any(self.runner.alive(m.handle) for m in self.members.values()):
                return  # done, or no VW left running (those that failed are the runner's errors)
            if time.monotonic() > deadline:
                raise WSPError(
                    f"the job did not finish in {timeout:.0f} s: {trained} of "
                    f"{ledger.total} minibatches trained",
                    "busy",
                )
            ledger = self.ps.wait(WATCH_SECONDS)  # the next commit (or a VW's end, within this)

    def _apply(self, event, group: int, total: int, scaler) -> None:
        if self.planner is not None and scaler is None and event.kind in ("offer", "preempt"):
            held = self.held()
            if event.kind == "offer":
                offered = self.free(range(total)) if event.devices is None else event.devices
                count = len(offered) if event.devices is not None else event.count
                self.replan(sorted({*held, *list(offered)[:count]}))
            else:
                gone = set(event.devices or held[-event.count :])
                self.replan([d for d in held if d not in gone])
            return
        if event.kind == "offer":
            free = self.free(range(total)) if event.devices is None else list(event.devices)
            count = len(free) if event.devices is not None else min(event.count, len(free))
            groups = [free[i * group : (i + 1) * group] for i in range(count // group)]
            if scaler is None:
                self.add(*groups)
            for devices in groups if scaler is not None else ():
                scaler.offer(devices)
                scaler.review()  # the VW it added, if it did
            return
        if event.kind not in ("preempt", "fail"):
            raise WSPError(
                f"a trace event for virtual workers is offer, preempt or fail; got {event.kind!r}",
                "invalid",
            )
        if scaler is not None and event.kind == "preempt" and event.devices is None:
            for _ in range(-(-event.count // group)):
                if self.members:
                    scaler.shrink(f"a preemption of {event.count} devices")
            return
        held = sorted(self.members.values(), key=lambda m: max(m.devices))
        gone = set(event.devices or ())
        if event.devices is None:
            ids = sorted(d for m in held for d in m.devices)
            gone = set(ids[-event.count :])
        for member in [m for m in held if set(m.devices) & gone]:
            (self.remove if event.kind == "preempt" else self.kill)(member.name)

    def wait_joined(self, timeout: float = 600.0) -> None:
        """Wait at most ``timeout`` seconds until every running VW has joined the ledger (built,
        its first pull done), so that what comes next (a trace's events) finds each one
        training: a VW in processes builds for seconds after :meth:`add`, and one killed before
        it joins was never a member, so nothing drops it. A VW that ended meanwhile is not
        waited for (a failure is in the runner's ``errors``).

        Raises:
          WSPError: a VW still had not joined after ``timeout`` (``"busy"``).
        """
        deadline, ledger = time.monotonic() + timeout, self.ps.ledger()
        while True:
            seen = {*ledger.clocks, *ledger.dropped, *ledger.left}
            waiting = [
                name
                for name, member in self.members.items()
                if name not in seen and self.runner.alive(member.handle)
            ]
            if not waiting or ledger.done:
                return
            if time.monotonic() > deadline:
                raise WSPError(f"{waiting} did not join in {timeout:.0f} s", "busy")
            ledger = self.ps.wait(WATCH_SECONDS)  # the next change (a join), or within this

    def wait(self, timeout: float = 600.0) -> None:
        """Wait for every VW to end (when the run is done or it is told to), ``timeout`` seconds
        for all of them together (a process still running then is killed; a thread is left)."""
        deadline = time.monotonic() + timeout
        for member in [*self.members.values(), *self.gone.values()]:
            self.runner.wait(member.handle, max(deadline - time.monotonic(), 0.1))

    def stop(self, timeout: float = 600.0) -> None:
        """Tell every VW to leave, and :meth:`wait` for them (``timeout`` seconds)."""
        for name in list(self.members):
            self.remove(name)
        self.wait(timeout)

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc) -> None:
        """Leaving the block ends every VW still running: killed (threads fall silent)."""
        for name in list(self.members):
            self.kill(name)
        self.wait(timeout=60.0)

    def records(self) -> list[WaveRecord]:
        """Every VW's wave records, in wave start order."""
        out = []
        for member in [*self.members.values(), *self.gone.values()]:
            out += self.runner.records(member.handle)
        return sorted(out, key=lambda r: r.started)
