"""A launched process's membership in its generations: join, leave, and the launcher's messages.

A process that survives a change keeps running: it leaves the generation's ``jax.distributed``
job and joins the next one, with its interpreter, imports and run directory intact. Three facts
of JAX make that work (checked on jax 0.10.2 and 0.12, CPU with gloo collectives):

- The *coordination service* runs in the launcher (``distributed.coordination_service``), not
  in a trainer, so the death of any trainer — process 0 included — takes no other with it. It
  is recoverable: a task that leaves is not waited for at shutdown. ``jax.distributed.initialize``
  starts a service in process 0 whatever it is told, so process 0 starts one on a port nobody
  connects to (loopback), and connects to the launcher's like every other process.
- *Leaving* (:func:`leave`) is ``jax.distributed.shutdown`` (this process's client only), then
  dropping the backends: the next ``initialize`` builds a client over the next generation's
  devices.
- A survivor of a failure is blocked in a collective with the dead peer (gloo never times out):
  :func:`break_collectives` fails it, and the script unwinds (:class:`Control` interrupts it) to
  :func:`tenplex_jax._src.multihost.worker.main`.

The launcher talks to a process on its stdin, one JSON object per line (:class:`Control`):
``{"env": {...}, "log": path}`` gives it a rank in a generation (the environment holding its
``JobSpec``, and the file its output goes to: null for the launcher's own); ``{"end": ...,
"peers": [pid, ...], "endpoints": [...], "survivors": [process, ...]}`` ends the generation it
runs in (a failure elsewhere; the trainers' pids, the collectives endpoints they published at
:func:`join`, in ``RUN_DIR/endpoints-g<gen>-p<id>.json``, and the processes that outlived it,
which keep the state of their last completed step); EOF tells it to exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Callable

import jax

from tenplex_jax._src.multihost import distributed
from tenplex_jax._src.multihost.processes import free_port

INTERRUPT = signal.SIGUSR1  # how the control thread interrupts the main thread
REJOIN = 75  # the exit status of a process whose generation ended while it joined it


def join(
    coordinator: str,
    processes: int,
    process_id: int,
    devices_per_process: int,
    *,
    hosted: bool,
    timeout: float = 120.0,
) -> list[str]:
    """Configure JAX for a launched generation and join its ``jax.distributed`` job; the TCP
    endpoints this process listens on for the generation's collectives (gloo's), as
    :func:`break_collectives` takes them.

    Args:
      coordinator: the coordination service's ``host:port``.
      processes: the generation's process count.
      process_id: this process's index in it.
      devices_per_process: CPU devices per process (``jax_num_cpu_devices``).
      hosted: the launcher runs the service; else process 0 does, bound to the coordinator's
        address only.
      timeout: seconds to wait for every process to connect.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", devices_per_process)
    # recoverable where processes stay (the launcher hosts the service): a task may leave
    # without the others. Where process 0 hosts it, every task leaves at once and process 0
    # last: recoverable tasks skip the shutdown barrier, and process 0's exit would end the
    # service under the others' shutdown (they abort at a planned change, with --no-keep)
    jax.config.update("jax_enable_recoverability", hosted)
    bind = None
    if process_id == 0:  # initialize starts a service in process 0: the launcher's is the real one
        bind = f"127.0.0.1:{free_port()}" if hosted else coordinator
    jax.distributed.initialize(
        coordinator,
        num_processes=processes,
        process_id=process_id,
        initialization_timeout=int(timeout),
        heartbeat_timeout_seconds=distributed.HEARTBEAT_SECONDS,
        coordinator_bind_address=bind,
    )
    # the backend: its creation exchanges every process's devices through the service, a wait
    # as uninterruptible as the connect, so it belongs to joining; gloo listens from then on
    jax.devices()
    return listening(exclude_ports={_port(bind)} if bind is not None else set())


def listening(exclude_ports=frozenset()) -> list[str]:
    """This process's listening TCP endpoints, as ``/proc/net/tcp`` writes them
    (``"0100007F:88F9"``), but those on ``exclude_ports`` (decimal strings)."""
    own = _socket_inodes(os.getpid())
    ports = {f"{int(p):04X}" for p in exclude_ports}
    return sorted(
        local
        for inode, (state, local, _) in _tcp_table(listening=True).items()
        if state == LISTEN and inode in own and _port(local) not in ports
    )


def leave(*, broken: bool) -> None:
    """Leave the generation's ``jax.distributed`` job and drop the backends over its devices.

    Args:
      broken: the generation's collectives were broken (:func:`break_collectives`): its
        backends stay referenced, never destroyed, since a destructor would wait for
        computations whose peers are gone.
    """
    distributed.drop_backends(keep_alive=broken)


def break_collectives(peers: list[int], endpoints: list[str] = ()) -> int:
    """Shut down this process's TCP connections with the generation's trainers, itself included
    (gloo connects a process's own devices over TCP too, through its published endpoint), so
    that the collectives blocked on them fail instead of waiting forever. A connection is the
    trainers' when one of its ends is a trainer's collectives endpoint (``endpoints``, as each
    published it at :func:`join`: on any host), or, on this host, an endpoint of another
    trainer (``peers``: their pids) or a loopback endpoint that is gone (a dead peer's, which
    may not have published its own). Connections to anything else stay: the stores, the
    coordination service, and this process's own services (a compile-only topology's, whose
    clients would end the process if their connections broke). Gloo's connections all go
    through the endpoints published at :func:`join`, this process's own too (checked on jax
    0.10.2 and 0.12). Returns how many were shut."""
    table = _tcp_table()
    local = {ends[1] for ends in table.values()}
    published = set(endpoints)
    own = {_port(e) for e in set(listening()) & published}  # this process's own listeners
    anywhere = {_port(e) for e in published if _wildcard(e)}  # listening on every address
    theirs = set()
    for pid in set(peers) - {os.getpid()}:
        theirs |= {table[i][1] for i in _socket_inodes(pid) if i in table}
    shut = 0
    for fd, inode in _socket_fds(os.getpid()):
        if inode not in table:
            continue
        _, mine, remote = table[inode]
        trainers = remote in published or _port(remote) in anywhere or _port(mine) in own
        if trainers or remote in theirs or (remote not in local and _loopback(remote)):
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    shut += 1
                finally:
                    sock.detach()  # the fd stays the collectives' own
    return shut


LISTEN, CLOSE = "0A", "07"  # /proc/net/tcp's states


def _tcp_table(*, listening: bool = False) -> dict[int, tuple[str, str, str]]:
    """TCP sockets of this network namespace, connected ones (not closed; with ``listening``,
    listening ones too): inode -> (state, local, remote) address, as ``/proc/net/tcp`` writes
    them."""
    table = {}
    skip = {CLOSE} if listening else {CLOSE, LISTEN}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(name) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] not in skip and int(fields[9]):  # (orphans have no inode)
                    table[int(fields[9])] = (fields[3], fields[1], fields[2])
    return table


def _port(endpoint: str) -> str:
    return endpoint.rsplit(":", 1)[1]


def _wildcard(endpoint: str) -> bool:
    """Whether a listening endpoint is on every address (0.0.0.0 or ::)."""
    return set(endpoint.rsplit(":", 1)[0]) == {"0"}


def _loopback(address: str) -> bool:
    """Whether ``/proc/net/tcp``'s ``address`` is on 127.0.0.0/8 (or ::1, or IPv4 in IPv6)."""
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian: the last byte pair is the first octet
        return host[6:8] == "7F"
    return host in ("00000000000000000000000001000000",) or host.endswith("0100007F")


def _socket_fds(pid) -> list[tuple[int, int]]:
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.append((int(fd), int(target[8:-1])))
    return out


def _socket_inodes(pid: int) -> set[int]:
    return {inode for _, inode in _socket_fds(pid)}


class GenerationEnded(BaseException):
    """The launcher ended this process's generation (a failure elsewhere): raised in the main
    thread while it runs the script, wherever it is, so that the script unwinds and the process
    stays for the next generation. A ``BaseException``, as ``SystemExit``: a script's ``except
    Exception`` does not stop it."""


class Control:
    """The launcher's messages on this process's stdin, read by a daemon thread.

    When the launcher ends the running generation, the thread breaks this process's collectives
    with its peers, sets ``ending`` and, while the main thread runs the script (between
    :meth:`arm` and :meth:`disarm`), interrupts it with ``SIGUSR1``, whose handler raises
    :class:`GenerationEnded`: in Python code and in waits Python can interrupt (a lock, a
    future's result, a sleep, a socket), where an asynchronous exception would wait for the wait
    to end. A wait inside JAX on a collective ends when the collectives break. A process still
    joining (:meth:`joining`) exits instead, with ``REJOIN``: neither the connect nor the
    backend's creation can be interrupted; the launcher gives its rank to its standby.
    :meth:`rank` waits for the next rank. A planned growth is announced while the generation
    trains on (``{"grow": processes}``): :meth:`watch_growth` hands it to the running job.
    """

    def __init__(self, stream=None):
        self._stream = sys.stdin if stream is None else stream
        self._ranks: queue.Queue = queue.Queue()
        self.ending = threading.Event()
        self._lock = threading.Lock()
        self._armed = False
        self._joining = False
        self._interrupt = False  # set by the control thread, consumed by the handler
        self._main = threading.main_thread().ident
        # the generation's processes that outlived the failure that ended it (the end message's)
        self.survivors: list[int] | None = None
        self._growth: int | None = None  # the processes of a growth announced to this generation
        self._on_growth: Callable[[int], None] | None = None
        self._previous = signal.signal(INTERRUPT, self._on_signal)  # from the main thread
        threading.Thread(target=self._read, name="tenplex-control", daemon=True).start()

    def _read(self) -> None:
        try:
            for line in self._stream:
                message = json.loads(line)
                if "end" in message:
                    self.survivors = message.get("survivors")
                    break_collectives(message.get("peers", []), message.get("endpoints", []))
                    self.ending.set()
                    with self._lock:
                        if self._joining:
                            sys.stdout.flush()
                            sys.stderr.flush()
                            os._exit(REJOIN)
                        if self._armed:
                            self._armed = False
                            self._interrupt = True
                            signal.pthread_kill(self._main, INTERRUPT)
                elif "grow" in message:
                    with self._lock:
                        self._growth, notify = int(message["grow"]), self._on_growth
                    if notify is not None:
                        notify(self._growth)
                else:
                    with self._lock:
                        self._growth = None  # announced to the generation that has ended
                    self._ranks.put(message)
        except (OSError, ValueError):
            pass
        self._ranks.put(None)

    def _on_signal(self, signum, frame) -> None:
        if self._interrupt:  # no lock here: the main thread may hold it when this runs
            self._interrupt = False
            raise GenerationEnded

    def close(self) -> None:
        """Give ``SIGUSR1`` back its previous handler (the reader thread ends at EOF)."""
        signal.signal(INTERRUPT, self._previous)

    def arm(self) -> None:
        """The main thread starts running the script: an end of the generation interrupts it."""
        with self._lock:
            self._armed = not self.ending.is_set()

    @contextlib.contextmanager
    def joining(self):
        """The main thread joins a generation: an end of it meanwhile ends the process."""
        with self._lock:
            if self.ending.is_set():
                raise GenerationEnded
            self._joining = True
        try:
            yield
        finally:
            with self._lock:
                self._joining = False

    def disarm(self) -> None:
        """The main thread leaves the script: nothing interrupts it any more. Call it inside a
        ``try`` that catches :class:`GenerationEnded`: one raised just before lands here."""
        with self._lock:
            self._armed = False
        for _ in range(8):  # backward jumps: a signal sent just before is handled here
            pass

    def watch_growth(self, notify: Callable[[int], None] | None) -> None:
        """Call ``notify(processes)`` on the control thread when a growth is announced to this
        generation, at once if one was already; None stops it. ``notify`` must not raise and
        must return soon (it delays the launcher's next messages)."""
        with self._lock:
            self._on_growth, growth = notify, self._growth
        if notify is not None and growth is not None:
            notify(growth)

    def rank(self, timeout: float | None = None) -> dict | None:
        """The next rank the launcher gives (``{"env": ..., "log": ...}``); None at EOF (exit)
        or after ``timeout`` seconds."""
        try:
            return self._ranks.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_ending(self, timeout: float) -> bool:
        """Whether the launcher ends the generation within ``timeout`` seconds."""
        return self.ending.wait(timeout)
