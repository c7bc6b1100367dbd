"""``tenplex-jax launch --ray ADDRESS SCRIPT``: the elastic job on a Ray cluster.

The same launcher as on one host (:class:`tenplex_jax._src.multihost.launch.Launcher`) with a
slot per Ray node: each node's tensor store and worker are processes started by Ray actors
pinned to the node, driven as the launcher drives its children (:class:`Remote`).
docs/multihost.md ("On a Ray cluster") states the rest: deaths, joins, the token, and why Ray
Core and not Ray Train's ``JaxTrainer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import signal
import subprocess
import sys
import time

from tenplex_jax._src.errors import LaunchError
from tenplex_jax._src.multihost.launch import Launcher, _Slot
from tenplex_jax._src.multihost.processes import free_port, spawn
from tenplex_jax._src.multihost.rundir import Progress, RunDir, RunEvent
from tenplex_jax._src.multihost.spec import STANDBY, Action, LaunchOptions, Request
from tenplex_jax._src.planner.growth import Growth, growth

POLL_NODES_SECONDS = 1.0  # how often the launcher looks for new nodes
ANSWER_SECONDS = 10.0  # how long a node has to show it is alive, once a failure is seen


@functools.cache
def _host_class():
    import ray

    # wait() blocks one thread of the actor
    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(_Host)


class _Host:
    """A process on this actor's node: started, signalled, waited for (reaped by PID)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def where(self) -> tuple[str, str]:
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, command: list[str], env: dict, log: str | None) -> int:
        out = open(log, "ab") if log else None  # noqa: SIM115 (closed when it exits)
        self.proc = spawn(command, env=os.environ | env, stdout=out, stderr=out)
        return self.proc.pid

    def stand_by(self, command: list[str], env: dict) -> int:
        """A standby process (see ``worker._warm``), its rank to come on its stdin."""
        self.proc = spawn(command, env=os.environ | env, stdin=subprocess.PIPE)
        return self.proc.pid

    def tell(self, data: bytes) -> str | None:
        """Write the launcher's message (a rank, an end) to the process's stdin; why not,
        when it is gone."""
        try:
            if self.proc.poll() is not None:
                return f"exited with {self.proc.returncode}"
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError as error:
            return str(error)
        return None

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def start_store(self, directory: str, host: str, token_file: str) -> tuple:
        from tenplex_jax._src.multihost.store.process import StoreProcess

        store = StoreProcess.start(directory, host=host, token_file=token_file)
        self.proc = store.popen
        return store.address, store.pid

    def wait(self) -> int:
        return self.proc.wait()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)


class Remote:
    """A process on a Ray node, driven as a ``subprocess.Popen`` is (``poll``, ``wait``,
    ``send_signal``, ``kill``, ``pid``), so the launcher treats it as its own children. When its
    node dies, Ray fails the ``wait`` call: the process is gone, as if SIGKILLed."""

    def __init__(self, actor, pid: int, node: str):
        self.actor, self.pid, self.node = actor, pid, node
        self.returncode: int | None = None
        self._done = actor.wait.remote()
        self.stdin = _RemoteStdin(actor)

    def poll(self) -> int | None:
        import ray

        if self.returncode is None:
            ready, _ = ray.wait([self._done], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(self._done))
                except ray.exceptions.RayError:  # the node (or its actor) died
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ready, _ = ray.wait([self._done], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"process {self.pid} on node {self.node}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        import ray

        if self.poll() is None:  # (a RayError: its node is gone, so is the process)
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(self.actor.signal.remote(int(sig)), timeout=30)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _RemoteStdin:
    """A Ray process's stdin, as the launcher writes a child's: what is written goes at
    ``flush``; BrokenPipeError when the process or its node is gone."""

    def __init__(self, actor):
        self.actor, self._pending = actor, b""

    def write(self, data: bytes) -> None:
        self._pending += data

    def flush(self) -> None:
        import ray

        data, self._pending = self._pending, b""
        try:
            problem = ray.get(self.actor.tell.remote(data), timeout=30)
        except ray.exceptions.RayError as error:  # its node died
            raise BrokenPipeError(f"its node is gone ({type(error).__name__})") from None
        if problem is not None:
            raise BrokenPipeError(problem)

    def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.actor.close_stdin.remote(), timeout=30)


class RayLauncher(Launcher):
    """The launcher with its stores and workers on the nodes of the Ray cluster at ``address``
    (``"auto"``: the one this machine belongs to). ``resource``: only nodes offering this custom
    resource take part. ``nprocs`` processes start (one per node); the job grows onto nodes that
    join when growing pays."""

    def __init__(
        self,
        options: LaunchOptions,
        address: str = "auto",
        *,
        resource: str | None = None,
        log=None,
    ):
        super().__init__(dataclasses.replace(options, token=True), log)
        self.address, self.resource = address, resource
        self.nodes: dict[int, str] = {}  # slot -> node id
        self.hosts: dict[int, object] = {}  # slot -> its store's actor
        self._looked = 0.0
        self._declined: set[str] = set()  # nodes whose offer did not pay: not weighed again
        self._running = 0  # the generation running (its progress times its step)

    # -- Ray's nodes -----------------------------------------------------------------------------

    def run(self) -> int:
        import ray

        started = not ray.is_initialized()
        if started:
            ray.init(address=self.address, log_to_driver=False, logging_level="ERROR")
        try:
            return super().run()
        finally:
            if started:
                ray.shutdown()

    def alive(self) -> list[str]:
        """The ids of the live nodes that may take part, in the cluster's order."""
        import ray

        return [
            n["NodeID"]
            for n in ray.nodes()
            if n["Alive"] and (self.resource is None or self.resource in n["Resources"])
        ]

    def _actor(self, node: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return (
            _host_class()
            .options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
            .remote()
        )

    # -- the launcher's processes, on nodes ------------------------------------------------------

    def _prepare_stores(self, current: int, count: int) -> None:
        """(A growth's stores start on the nodes it takes, when it takes them.)"""

    def _ready_to_grow(self, gen) -> bool:
        # (its stores start with the growth; its standbys are on other nodes)
        return self._lowered_growth(gen)

    def _start_stores(self, indices) -> None:
        import ray

        free = [n for n in self.alive() if n not in self.nodes.values()]
        indices = list(indices)
        if len(free) < len(indices):
            raise LaunchError(
                f"{len(indices)} slots asked for, but the Ray cluster has "
                f"{len(free)} free live nodes"
                + (f" with resource {self.resource!r}" if self.resource else "")
            )
        calls = {}
        for i, node in zip(indices, free):
            actor = self._actor(node)
            ip, _ = ray.get(actor.where.remote(), timeout=self.options.start_timeout)
            self.nodes[i], self.hosts[i] = node, actor
            calls[i] = actor.start_store.remote(
                str(self.store_dir / str(i)), ip, str(self.token_file)
            )
        for i, call in calls.items():
            try:
                address, pid = ray.get(call, timeout=self.options.start_timeout)
            except ray.exceptions.RayError as error:
                raise LaunchError(
                    f"the store of slot {i} (node {self.nodes[i]}) did not start: {error}"
                ) from None
            remote = Remote(self.hosts[i], pid, self.nodes[i])
            self.slots[i] = _Slot(index=i, store=remote, address=address)
        self._event(
            RunEvent.STORES,
            slots={
                i: {
                    "pid": self.slots[i].store.pid,
                    "node": self.nodes[i],
                    "address": self.slots[i].address,
                }
                for i in calls
            },
            detail=f"stores up for slots {sorted(calls)} on nodes "
            + ", ".join(f"{self.nodes[i][:8]} ({self.slots[i].address})" for i in calls),
        )

    def _coordinator(self, slot: int) -> str:
        import ray

        if self.options.keep:  # the service runs here, in the launcher: no node's death ends it
            ip = ray.util.get_node_ip_address()
            return f"{ip}:{free_port(ip)}"
        ip, _ = ray.get(self.hosts[slot].where.remote(), timeout=30)
        port = ray.get(self.hosts[slot].free_port.remote(ip), timeout=30)
        return f"{ip}:{port}"

    def _spawn_worker(self, slot: int, command, env: dict, log: pathlib.Path | None):
        import ray

        actor = self._actor(self.nodes[slot])
        try:
            pid = ray.get(
                actor.start.remote(command, env, None if log is None else str(log)),
                timeout=self.options.start_timeout,
            )
        except ray.exceptions.RayError:
            return _Dead(self.nodes[slot])  # its node died already: the watch sees a failure
        return Remote(actor, pid, self.nodes[slot])

    # -- warm standby processes: one per node of the generation, in its own actor -----------------

    def _standby_slots(self, gen) -> list[int]:
        return list(gen.slots)  # a spare would need a node the job does not have yet

    def _spawn_standbys(self, slots: list[int]) -> dict:
        import ray

        env = self._worker_env() | {STANDBY: "1"}
        actors = {slot: self._actor(self.nodes[slot]) for slot in slots}
        calls = {slot: a.stand_by.remote(self._command(), env) for slot, a in actors.items()}
        started = {}
        for slot, call in calls.items():  # all at once: the watch waits for one round trip
            try:
                pid = ray.get(call, timeout=self.options.start_timeout)
            except ray.exceptions.RayError:  # its node died: the next generation starts cold
                started[slot] = _Dead(self.nodes[slot])
            else:
                started[slot] = Remote(actors[slot], pid, self.nodes[slot])
        return started

    def _start_generation(self, number: int, slots: list[int], restore):
        self._running = number
        return super()._start_generation(number, slots, restore)

    def _survivors(self, slots: list[int], outcome) -> list[int]:
        """On Ray the unit of failure is the node: a slot survives while its node (and store)
        lives, also when its worker failed because a peer's did (a coordinator gone aborts the
        others). Every slot must also still answer, whether its worker was seen to fail or not:
        a removed node's death may reach Ray after its peers' aborts (its worker not yet seen
        dead), and a generation started on it (its coordinator, when it is slot 0) would only
        fail again."""
        answering = self._answering({s for s in slots if self._up(s)})
        return [s for s in slots if s in answering]

    ANSWERING = "node"

    def _answering(self, slots) -> set[int]:
        """Those of ``slots`` whose nodes are alive: their stores' actors answer a call within
        ``ANSWER_SECONDS``, all asked at once (Ray fails a call at once once it knows the node
        died; a dead node's actor that Ray does not know dead yet never answers). A slot that
        does not answer has lost its store too. Ray reports a node's death seconds after it,
        and nodes that die together one at a time (what :meth:`Launcher._confirmed` asks
        this for)."""
        import ray

        calls = {s: self.hosts[s].where.remote() for s in slots}
        if not calls:
            return set()
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=ANSWER_SECONDS)
        answered = set()
        for slot, call in calls.items():
            if call in ready:
                try:
                    ray.get(call)
                    answered.add(slot)
                    continue
                except ray.exceptions.RayError:  # the actor or its node died
                    pass
            self.slots[slot].store.returncode = -signal.SIGKILL
        return answered

    # -- joins ------------------------------------------------------------------------------------

    def _request(self, current: int) -> Request | None:
        """A planned end (SIGTERM, RUN_DIR/resize), or growth onto nodes that joined."""
        asked = super()._request(current)
        if asked is not None:
            return asked
        if time.monotonic() - self._looked < POLL_NODES_SECONDS:
            return None
        self._looked = time.monotonic()
        offered = [
            n for n in self.alive() if n not in self.nodes.values() and n not in self._declined
        ]
        rule = self._growth(current, current + len(offered)) if offered else None
        if rule is None:
            return None
        self._event(
            RunEvent.OFFER,
            nodes=offered,
            processes=current + len(offered),
            **dataclasses.asdict(rule),
            detail=f"{len(offered)} node(s) joined; grow: {rule.grow} (gain "
            f"{rule.gain_seconds:.1f} s against a cost of {rule.cost_seconds:.1f} s)",
        )
        if not rule.grow:
            self._declined = set(offered)
            return None
        request = Request(action=Action.RESIZE, processes=current + len(offered))
        self._event(RunEvent.REQUEST, action=request.action, processes=request.processes)
        return request  # the launcher asks the workers for it

    def _growth(self, now: int, then: int) -> Growth | None:
        """``ElasticJob.offer``'s rule on the launcher's measurements: the step time and steps
        left from process 0's progress, the state's bytes, the bandwidth of the generation's
        restore, its start-up and its first step's compile (process 0's
        :class:`~tenplex_jax._src.multihost.rundir.RestoreReport`); None before a step time of this
        generation exists (timed from the end of its first step, which includes the compile)."""
        run = RunDir(self.run_dir)
        seen = run.read(Progress)
        if seen is None or seen.generation != self._running or seen.step - seen.first_step < 2:
            return None
        step_now = (seen.time - seen.first_time) / (seen.step - seen.first_step)
        restored = run.restored(self._running)
        known = restored is not None and restored.seconds > 0
        return growth(
            step_seconds_now=step_now,
            step_seconds_new=step_now * now / then,
            remaining_steps=None if seen.steps is None else max(seen.steps - seen.step, 0),
            bytes_moved=restored.state_bytes if known else 0,
            bandwidth=max(restored.state_bytes / restored.seconds, 1.0) if known else 1e9,
            compile_seconds=max(seen.first_time - restored.restored, 0.0) if known else 0.0,
            compiled_ahead=False,
            source="launcher",
            restart_seconds=restored.restored - restored.started if known else 0.0,
        )


class _Dead:
    """A worker whose node died before it started: it has already failed."""

    pid, returncode = -1, -signal.SIGKILL

    def __init__(self, node: str):
        self.node = node
        self.stdin = self

    def write(self, data: bytes) -> None:
        raise BrokenPipeError(f"node {self.node} is gone")

    flush = close = kill = lambda self: None
    send_signal = lambda self, sig: None
    poll = wait = lambda self, timeout=None: self.returncode


def launch_on_ray(
    options: LaunchOptions, address: str = "auto", *, resource: str | None = None, log=None
) -> int:
    """Run a job on a Ray cluster; the exit status (0 done or stopped, 1 gave up, 130
    interrupted)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("tenplex-jax launch --ray needs Ray: pip install 'tenplex_jax[ray]'", file=sys.stderr)
        return 2
    return RayLauncher(options, address, resource=resource, log=log).run()
