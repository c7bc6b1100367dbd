"""The one place where tenplex_jax meets the parts of JAX that differ across the supported range
(jax 0.10.2 to 0.12) or that JAX keeps outside its stable API.

Everything else in the library uses the API that jax 0.10.2 and 0.12 share (checked by resolving
every ``jax.``/``flax.``/``optax.``/``orbax.`` name the library uses on both, with warnings as
errors). What is here is either experimental in JAX (and so may move without a deprecation cycle)
or has behaved differently between releases; each function says which.
"""

from __future__ import annotations

import functools
import threading


def backends_started() -> bool:
    """Whether JAX has started its backends (after which ``XLA_FLAGS`` is not read again):
    ``xla_bridge.backends_are_initialized``, private, present in 0.10.2 to 0.12."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


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
