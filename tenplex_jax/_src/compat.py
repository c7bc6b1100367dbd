"""The one place where tenplex_jax meets the parts of JAX that differ across the supported range
(jax 0.10.2 to 0.12) or that JAX keeps outside its stable API.

Everything else in the library uses the API that jax 0.10.2 and 0.12 share (checked by resolving
every ``jax.``/``flax.``/``optax.``/``orbax.`` name the library uses on both, with warnings as
errors). What is here is either experimental in JAX (and so may move without a deprecation cycle)
or has behaved differently between releases; each function says which.
"""

from __future__ import annotations

import contextlib
import functools
import threading


def reset_compilation_cache() -> None:
    """Make JAX decide again whether its persistent compilation cache is on.

    JAX reads ``jax_compilation_cache_dir`` once per process, at the first compile; after the
    option changes, ``compilation_cache.reset_cache`` (in ``jax.experimental``, so not covered by
    JAX's deprecation policy; present in 0.10.2 to 0.12) makes the next compile read it again.
    """
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


def compile_noting_persistent_cache(lowered, devices=None):
    """``lowered.compile()`` (with ``devices``: a program lowered on an ``AbstractMesh``,
    compiled for those devices in mesh order, ``compile(device_assignment=)``), and whether the
    executable is one JAX loaded from its persistent compilation cache (now, or earlier in this
    process: JAX's in-memory cache then hands the same executable back without another read).
    Serialized again, such an executable lacks its kernels: on XLA CPU its copy loads and then
    fails when run ("Function ... not found"), measured on jax 0.10.2 and 0.12. A hit is JAX's
    ``/jax/compilation_cache/cache_hits`` monitoring event (its name is not public API),
    recorded on the compiling thread."""
    _listen_for_persistent_cache_hits()
    before = getattr(_PERSISTENT_HITS, "count", 0)
    compiled = lowered.compile() if devices is None else _compile_for(lowered, list(devices))
    executable = compiled.runtime_executable()
    with _PERSISTENT_LOCK:
        if getattr(_PERSISTENT_HITS, "count", 0) > before:
            _FROM_PERSISTENT_CACHE[id(executable)] = executable
        return compiled, _FROM_PERSISTENT_CACHE.get(id(executable)) is executable


def _compile_for(lowered, devices):
    """A program lowered on an ``AbstractMesh`` compiled for ``devices``, on their client. The
    client the lowering recorded may be gone (lowered in a survivor's earlier generation, whose
    backends were cleared since): the devices' takes its place in ``Lowered``'s compile
    arguments (not public API; the same in jax 0.10.2 and 0.12: compiled on the old client, the
    executable refuses the new client's buffers)."""
    arguments = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if isinstance(arguments, dict) and "backend" in arguments:
        arguments["backend"] = devices[0].client
    return lowered.compile(device_assignment=tuple(devices))


_PERSISTENT_HITS = threading.local()  # .count: JAX persistent cache hits on this thread
_PERSISTENT_LOCK = threading.Lock()
# the executables JAX read from it, by id; held, since they cannot be weakly referenced: one
# freed would hand its id to the next executable made, which would then never be stored
_FROM_PERSISTENT_CACHE: dict[int, object] = {}


@functools.cache
def _listen_for_persistent_cache_hits() -> None:
    import jax

    def listen(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _PERSISTENT_HITS.count = getattr(_PERSISTENT_HITS, "count", 0) + 1

    jax.monitoring.register_event_listener(listen)


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


def coordination_service(address: str, processes: int, *, heartbeat_seconds: int):
    """A ``jax.distributed`` coordination service for ``processes`` tasks, run in this process,
    recoverable (tasks may leave without the others waiting for them). What
    ``jax.distributed.initialize`` starts in process 0: ``_jax.get_distributed_runtime_service``,
    private, the same in 0.10.2 and 0.12. ``shutdown()`` stops it."""
    from jax._src.lib import _jax

    return _jax.get_distributed_runtime_service(
        address,
        processes,
        heartbeat_timeout=heartbeat_seconds,
        shutdown_timeout=heartbeat_seconds,
        recoverable=True,
    )


@contextlib.contextmanager
def cpu_topology(processes: int, devices_per_process: int, *, port: int, timeout: int = 60):
    """The devices of a ``processes`` x ``devices_per_process`` CPU job that does not exist, for
    compiling only: what process 0 of such a job would see (ids ``p * 2048 + k``, each with its
    ``process_index``), so that a program compiled for them loads, serialized, in the real job's
    processes (measured on jax 0.10.2 and 0.12: equal results). In this process: a coordination
    service on a loopback port and one CPU client per process, each with gloo collectives that
    never connect (nothing runs); the service listens on ``127.0.0.1:port`` (a client ends the
    process when its connection to it breaks). Private API (``_jax``'s runtime service and
    client, ``xla_client.make_cpu_client``), the same in 0.10.2 and 0.12. On leaving, every
    client leaves the service together (its shutdown is a barrier), then the service stops."""
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


def serialize_executable(compiled) -> bytes:
    """The bytes of a ``jax.stages.Compiled`` (``jax.experimental.serialize_executable``; the
    same in 0.10.2 and 0.12). Its pytrees are dropped: the loader passes its own, since user
    state may hold pytree nodes that do not pickle. Raises what JAX raises for an executable
    that cannot be serialized (host callbacks, captured constants)."""
    from jax.experimental import serialize_executable

    payload, _, _ = serialize_executable.serialize(compiled)
    return payload


def deserialize_executable(payload: bytes, in_tree, out_tree, devices):
    """The ``jax.stages.Compiled`` of :func:`serialize_executable`'s ``payload``, loaded onto
    ``devices``: exactly the compiled program's device assignment, in its order (XLA aborts the
    process, not raises, on a device count that differs from the program's)."""
    from jax.experimental import serialize_executable

    devices = list(devices)
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
    )
