"""Where the multihost wing meets ``jax.distributed``'s experimental and private parts.

As ``compat.py`` is for the one-process library: each function says which part of JAX it uses
and that it behaves the same on jax 0.10.2 and 0.12. Only the wings that run many processes (the
launcher's processes, a HetPipe VW over nodes) call these.
"""

from __future__ import annotations

import contextlib
import threading


def reached_preemption_sync_point(step: int) -> bool:
    """Whether every process of a ``jax.distributed`` job has reached ``step`` after the
    coordination service announced a preemption (``jax.experimental.multihost_utils``)."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)


def broadcast_one_to_all(value, is_source: bool | None = None):
    """Process 0's ``value`` (or the source's) on every process of a ``jax.distributed`` job
    (``jax.experimental.multihost_utils``)."""
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(value, is_source=is_source)


def distributed_client():
    """This process's ``jax.distributed`` client: its key-value store (``key_value_set_bytes``,
    ``blocking_key_value_get_bytes``, ``key_value_delete``); JAX keeps it in a private module."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized in this process")
    return distributed.global_state.client


# seconds without a heartbeat after which the service fails a task: the same in the service as
# in its clients (JAX's default), whose heartbeats come at a fraction of their own timeout
HEARTBEAT_SECONDS = 100


def coordination_service(address: str, processes: int, *, shutdown_seconds: int = 10):
    """A ``jax.distributed`` coordination service for ``processes`` tasks, run in this process
    (the launcher), recoverable (tasks may leave without the others waiting for them). What
    ``jax.distributed.initialize`` starts in process 0: ``_jax.get_distributed_runtime_service``,
    private, the same in 0.10.2 and 0.12. ``shutdown()`` stops it."""
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_service(
        address,
        processes,
        heartbeat_timeout=HEARTBEAT_SECONDS,
        shutdown_timeout=shutdown_seconds,
        recoverable=True,
    )


@contextlib.contextmanager
def cpu_topology(processes: int, devices_per_process: int, *, port: int, timeout: int = 60):
    """The devices of a ``processes`` x ``devices_per_process`` CPU job that does not exist, for
    compiling only: what process 0 of such a job would see (ids ``p * 2048 + k``, each with its
    ``process_index``), so that a program compiled for them loads, serialized, in the real job's
    processes (equal results on jax 0.10.2 and 0.12). In this process: a coordination service on
    ``127.0.0.1:port`` (a client ends the process when its connection to it breaks) and one CPU
    client per process, whose gloo collectives never connect. Private API (``_jax``'s runtime
    service and client, ``xla_client.make_cpu_client``), the same in 0.10.2 and 0.12. On
    leaving, every client leaves the service together (a barrier), then the service stops."""
    from jax._src.lib import _jax, xla_client

    address = f"127.0.0.1:{port}"
    service = _jax.get_distributed_runtime_service(address, processes)
    runtime: list = [None] * processes
    clients: list = [None] * processes
    errors: list[BaseException] = []

    def each(task, i: int) -> None:
        try:
            task(i)
        except BaseException as error:  # raised below, on the caller's thread
            errors.append(error)

    def together(task) -> None:
        threads = [threading.Thread(target=each, args=(task, i)) for i in range(processes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def join(i: int) -> None:
        runtime[i] = _jax.get_distributed_runtime_client(address, i, init_timeout=timeout)
        runtime[i].connect()
        clients[i] = xla_client.make_cpu_client(
            distributed_client=runtime[i],
            node_id=i,
            num_nodes=processes,
            collectives=_jax.make_gloo_tcp_collectives(distributed_client=runtime[i]),
            num_devices=devices_per_process,
        )

    def leave(i: int) -> None:
        if runtime[i] is not None:
            runtime[i].shutdown()

    try:
        together(join)
        if errors:
            raise errors[0]
        yield list(clients[0].devices())
    finally:
        clients.clear()
        together(leave)
        service.shutdown()


def drop_backends(*, keep_alive: bool) -> None:
    """Leave ``jax.distributed`` and drop the backends, so that the next ``initialize`` builds a
    client over other devices (``jax._src.api.clear_backends``: ``jax.clear_backends`` left the
    public API). ``keep_alive`` keeps the dropped backends referenced for the process's life: a
    destructor would wait for computations blocked on peers that are gone. A client that never
    connected (its generation ended while it joined) is forgotten, not shut down."""
    import jax
    from jax._src import api, distributed, xla_bridge

    if keep_alive:
        _KEPT_BACKENDS.append(dict(xla_bridge._backends))
    try:
        jax.distributed.shutdown()
    except Exception:
        state = distributed.global_state
        state.client = state.service = state.preemption_sync_manager = None
    api.clear_backends()


_KEPT_BACKENDS: list = []
