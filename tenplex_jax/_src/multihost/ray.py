"""``tenplex-jax launch --ray ADDRESS SCRIPT``: the elastic job on a Ray cluster.

The same launcher as on one host (:class:`tenplex_jax._src.multihost.launch.Launcher`: generations,
commits to the tensor stores, recovery from replicas or the orbax tier, events) with its processes
on Ray nodes instead of this host. A slot is a Ray node:

- **a tensor store per node**, started by a Ray actor pinned to the node
  (``NodeAffinitySchedulingStrategy``, not soft), bound to the node's address with the job's
  token; it outlives worker generations (it is not one of their actors);
- **a worker per node**: an actor pinned to the node starts ``python -m tenplex_jax.multihost
  SCRIPT`` there, writes the launcher's messages to its stdin and reports its exit. The
  ``jax.distributed`` coordination service runs in the launcher (the driver's node address and a
  free port; with ``--no-keep``, in process 0, on its node), so a worker whose node survives a
  change stays for the next generation; once a generation has stepped, another actor per node
  starts a warm standby process there (imports loaded, waiting for its rank on stdin), for a
  worker that could not stay. A survivor frees itself from collectives blocked on a dead peer by
  shutting down its connections with the trainers it finds through ``/proc``, so on nodes of one
  machine (the tests' clusters); on separate machines a survivor blocked on a remote peer is
  killed after ``LEAVE_SECONDS`` and its standby takes its rank;
- **deaths**: Ray reports an actor whose node died (the ``wait`` call fails); for the launcher
  that worker or store is gone, the generation ends, and the next runs on the surviving nodes,
  every shard from the surviving stores' replicas (or the orbax tier, the leaves named);
- **joins**: a new node (with the job's resource, if one is named) is an offer; the launcher
  grows onto it when the rule of ``ElasticJob.offer`` (``tenplex_jax._src.planner.growth``)
  says
  it pays, from the step time it measured, the steps left, the state's bytes over the bandwidth the
  last restore reached, the last generation's compile and start-up; the decision and its numbers
  are an event in ``RUN_DIR/events.jsonl``.

Every store needs the job's token, a fresh secret in ``RUN_DIR/token`` (mode 0600); processes
are given the file's path, never the secret, so no log, event or command line shows it. ``RUN_DIR``
holds the job's control files and must be on a file system every node sees (on one machine it is).

Ray Train's ``JaxTrainer`` was the first candidate; it is not used: in ray 2.60 its backend sets up
``jax.distributed`` only for TPUs and GPUs (``on_start`` returns at once on CPU), it owns the worker
group's processes and lifetime (a store beside them would be ours to place and keep alive anyway),
and it needs the ``ray[train]`` extra. Ray Core actors give the placement and the death reports
this needs, nothing more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tenplex_jax._src.errors import LaunchError
from tenplex_jax._src.multihost.launch import Launcher, _Slot
from tenplex_jax._src.multihost.spec import STANDBY, LaunchOptions

POLL_NODES_SECONDS = 1.0  # how often the launcher looks for new nodes
ANSWER_SECONDS = 10.0  # how long a node whose worker failed has to show it is alive


@functools.cache
def _host_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)  # wait() blocks one thread
    class Host:
        """A process on this actor's node: started, signalled, waited for (reaped by PID)."""

        def __init__(self):
            self.proc: subprocess.Popen | None = None

        def where(self) -> tuple[str, str]:
            import ray

            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

        def free_port(self, host: str) -> int:
            import socket

            with socket.socket() as s:
                s.bind((host, 0))
                return s.getsockname()[1]

        def start(self, command: list[str], env: dict, log: str | None) -> int:
            from tenplex_jax._src.multihost.processes import spawn

            out = open(log, "ab") if log else None  # noqa: SIM115 (closed when it exits)
            self.proc = spawn(command, env=os.environ | env, stdout=out, stderr=out)
            return self.proc.pid

        def stand_by(self, command: list[str], env: dict) -> int:
            """A standby process (see ``worker.stand_by``), its rank to come on its stdin."""
            from tenplex_jax._src.multihost.processes import spawn

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

        def start_store(self, directory: str, host: str, token_file: str, python: str) -> tuple:
            from tenplex_jax._src.multihost.store.process import StoreProcess

            store = StoreProcess.start(directory, host=host, token_file=token_file)
            self.proc = store.popen
            return store.address, store.pid

        def wait(self) -> int:
            return self.proc.wait()

        def signal(self, sig: int) -> None:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(sig)

    return Host


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

        if self.poll() is None:
            with contextlib.suppress(
                ray.exceptions.RayError
            ):  # its node is gone: so is the process
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
        self._progress_seen: list[tuple[float, int]] = []  # (time, step): the step time

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
                str(self.store_dir / str(i)), ip, str(self.token_file), self.options.python
            )
        for i, call in calls.items():
            try:
                address, pid = ray.get(call, timeout=self.options.start_timeout)
            except ray.exceptions.RayError as error:
                raise LaunchError(
                    f"the store of slot {i} (node {self.nodes[i]}) did not start: {error}"
                ) from None
            self.slots[i] = _Slot(i, Remote(self.hosts[i], pid, self.nodes[i]), address)
        self._event(
            "stores",
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

        if self._keeps:  # the service runs here, in the launcher: no node's death ends it
            import socket

            ip = ray.util.get_node_ip_address()
            with socket.socket() as s:
                s.bind((ip, 0))
                return f"{ip}:{s.getsockname()[1]}"
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

    def _start_generation(self, number: int, slots: list[int], source: str):
        self._progress_seen, self._generation = [], number  # step times are this generation's
        return super()._start_generation(number, slots, source)

    def _survivors(self, slots: list[int], outcome) -> list[int]:
        """On Ray the unit of failure is the node: a slot survives while its node (and store)
        lives, also when its worker failed because a peer's did (a coordinator gone aborts the
        others). Every slot must also still answer, whether its worker was seen to fail or not:
        a removed node's death may reach Ray after its peers' aborts (its worker not yet seen
        dead), and a generation started on it (its coordinator, when it is slot 0) would only
        fail again."""
        return [s for s in slots if self._up(s) and self._answers(s)]

    def _answers(self, slot: int) -> bool:
        """Whether ``slot``'s node is alive: its store's actor answers a call within
        ``ANSWER_SECONDS`` (Ray fails the call at once once it knows the node died). A slot
        that does not answer has lost its store too."""
        import ray

        try:
            ray.get(self.hosts[slot].where.remote(), timeout=ANSWER_SECONDS)
            return True
        except ray.exceptions.RayError:  # the actor or its node died, or no answer in time
            self.slots[slot].store.returncode = -signal.SIGKILL
            return False

    # -- joins ------------------------------------------------------------------------------------

    def _request(self, current: int) -> tuple[str, int] | None:
        """A planned end (SIGTERM, RUN_DIR/resize), or growth onto nodes that joined."""
        asked = super()._request(current)
        if asked is not None:
            return asked
        self._note_progress()
        if time.monotonic() - self._looked < POLL_NODES_SECONDS:
            return None
        self._looked = time.monotonic()
        offered = [
            n for n in self.alive() if n not in self.nodes.values() and n not in self._declined
        ]
        if not offered:
            return None
        rule = self._growth(current, current + len(offered))
        if rule is None:
            return None
        self._event(
            "offer",
            nodes=offered,
            processes=current + len(offered),
            **rule,
            detail=f"{len(offered)} node(s) joined; grow: {rule['grow']} (gain "
            f"{rule['gain_seconds']:.1f} s against a cost of {rule['cost_seconds']:.1f} s)",
        )
        if not rule["grow"]:
            self._declined = set(offered)
            return None
        self._event("request", action="resize", processes=current + len(offered))
        return "resize", current + len(offered)  # the launcher asks the workers for it

    def _note_progress(self) -> None:
        try:
            record = json.loads((self.run_dir / "progress.json").read_text())
        except (OSError, ValueError):
            return
        if record.get("generation") != getattr(self, "_generation", None):
            return  # the last generation's last step
        point = (float(record["time"]), int(record["step"]))
        if "first" in record:  # the generation's first step and this one: whatever polls missed
            first = (float(record["first"][0]), int(record["first"][1]))
            self._progress_seen = [first, point] if first[1] != point[1] else [first]
        elif not self._progress_seen or point[1] != self._progress_seen[-1][1]:
            self._progress_seen = (self._progress_seen + [point])[-20:]
        self._total_steps = record.get("steps")

    def _growth(self, now: int, then: int) -> dict | None:
        """``ElasticJob.offer``'s rule on the launcher's measurements; None before any exist."""
        from tenplex_jax._src.planner.growth import growth

        seen = self._progress_seen
        if len(seen) < 2 or seen[-1][1] - seen[0][1] < 2:
            # no step time of this generation yet (timed from the end of its first step, which
            # includes the compile): look again at the next poll
            return None
        (t0, s0), (t1, s1) = seen[0], seen[-1]
        step_now = (t1 - t0) / max(s1 - s0, 1)
        total = getattr(self, "_total_steps", None)
        restore = self._last_restore()
        return growth(
            step_seconds_now=step_now,
            step_seconds_new=step_now * now / then,
            remaining_steps=None if total is None else max(int(total) - s1, 0),
            bytes_moved=restore.get("state_bytes", 0),
            bandwidth=restore.get("bandwidth", 1e9),
            compile_seconds=restore.get("compile_seconds", 0.0),
            compiled_ahead=False,
            source="launcher",
            restart_seconds=restore.get("restart_seconds", 0.0),
        )

    def _last_restore(self) -> dict:
        """The newest generation's restore, as process 0 recorded it: its state's bytes, the
        bandwidth it pulled them at, and its start-up and first step's seconds."""
        records = sorted(
            self.run_dir.glob("restore-g*-p0.json"),
            key=lambda p: int(p.stem.split("-g")[1].split("-")[0]),
        )
        if not records:
            return {}
        record = json.loads(records[-1].read_text())
        times, out = record.get("times", {}), {"state_bytes": record.get("state_bytes", 0)}
        if record.get("seconds"):
            out["bandwidth"] = max(record["state_bytes"] / record["seconds"], 1.0)
        if "started" in times and "restored" in times:
            out["restart_seconds"] = times["restored"] - times["started"]
        first = self._progress_seen[0][0] if self._progress_seen else None
        if first is not None and "restored" in times and first > times["restored"]:
            out["compile_seconds"] = first - times["restored"]
        return out


class _Dead:
    """A worker whose node died before it started: it has already failed."""

    pid, returncode = -1, -signal.SIGKILL

    def __init__(self, node: str):
        self.node = node
        self.stdin = self

    def write(self, data: bytes) -> None:
        raise BrokenPipeError(f"node {self.node} is gone")

    flush = close = lambda self: None

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass


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
