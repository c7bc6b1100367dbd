"""Compiled steps on disk: a process loads the executable of a layout it has compiled before.

:class:`ExecutableCache` keeps one file per (program, process, layout): the bytes of a
``jax.stages.Compiled`` (``jax.experimental.serialize_executable``, through ``compat``) under a
key that covers everything that makes two executables differ:

- the lowered program (``Lowered.as_text()``: its shapes, dtypes, shardings, donation; no source
  locations, so editing a comment in the user's code is not a miss);
- the mesh: its axis names and sizes and its devices' ids in mesh order (the executable's device
  assignment), their platform, platform version and device kinds;
- the process that owns each of those devices — not the process that compiled: an SPMD
  executable serves every process of its mesh, so one process compiles a layout and the others
  load it (:meth:`ExecutableCache.load` with ``wait``), and a later generation whose processes own
  the same devices loads it too;
- jax's and jaxlib's versions (an upgrade is a miss), JAX's config flags (but the cache and
  logging ones) and the ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS`` environment.

A file is a header (magic, format version, key, payload length, payload sha256) and the payload,
written to a temporary file, fsync-ed and renamed over the entry, so a reader sees a whole entry
or none, and concurrent writers (threads, processes) of one key each leave a whole entry. A load
that finds no entry, a foreign or truncated file, a checksum that does not match, or a payload
JAX cannot load is a miss: the caller compiles and stores over it. Nothing here raises for the
cache's sake; what went wrong is counted and logged.

An executable that JAX's persistent compilation cache served (``enable_compilation_cache``, or
the launcher's ``compile_cache``) is never stored: serialized again, it lacks its kernels, and
its copy loads and then fails when run (XLA CPU, jax 0.10.2 and 0.12: "Function ... not found").
A process that compiles it fresh stores it instead (on CPU, JAX's cache serves only process 0).

A program the user named (``job.jit(step, program=...)``) has a second kind of entry, a
``.program`` file under the key of its name, layout and abstract inputs (:func:`programs.stable`)
in the same context: the digest, output tree and gradients its lowering gave, written by the
process that lowered it, so that another process loads the program's executable with nothing
traced or lowered (:meth:`ExecutableCache.recall`). Written and checked like an executable's.

The payload is a pickle that loads executable code: the directory must be as trusted as the
program (the checksum catches corruption, not an attacker).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import pickle
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from tenplex_jax._src import compat
from tenplex_jax._src.elastic import programs

__all__ = ["ExecutableCache"]

MAGIC = b"TJXEXEC\n"
FORMAT_VERSION = 2  # 1: entries that may hold an executable JAX's persistent cache served
# magic, format version, key (sha256), payload bytes, payload sha256
HEADER = struct.Struct("<8sI32sQ32s")
# JAX flags that change where JAX caches or what it logs, never the executable
UNKEYED_FLAGS = ("cache", "log", "explain", "traceback")
ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


@functools.cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    return (("jax", jax.__version__), ("jaxlib", importlib.metadata.version("jaxlib")))


def _versions() -> dict[str, str]:
    """jax's and jaxlib's versions, as keyed. Test seam: the tests replace this function to
    stand for an upgraded JAX."""
    return dict(_installed_versions())


class ExecutableCache:
    """Serialized executables in ``directory``, one file per key (see the module docstring).

    ``load`` and ``store`` take the ``jax.stages.Lowered`` program and the mesh its shardings are
    on; ``store`` serializes at once and writes on a background thread (``close`` waits for the
    writes). ``log`` is called with one line per entry that could not be used or written;
    ``follow`` is how long a process that does not lead a multi-process mesh waits for its
    leader's entry before compiling the program itself (0: never waits).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        log: Callable[[str], None] | None = None,
        follow: float = 0.0,
    ):
        self.directory = pathlib.Path(directory)
        self.follow = follow
        self.log = log or (lambda text: None)
        self.hits = self.misses = self.writes = 0
        self.problems: list[str] = []  # why an entry was not used or not written, in order
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "tenplex-compile-store")

    @staticmethod
    def digest(lowered: jax.stages.Lowered) -> bytes:
        """The sha256 of ``lowered``'s program text: the part of a key that tracing decides."""
        return hashlib.sha256(lowered.as_text().encode()).digest()

    def key(self, lowered: jax.stages.Lowered, mesh: Mesh, digest: bytes | None = None) -> str:
        """The entry's key (hex sha256) of ``lowered`` compiled on ``mesh``; with ``digest``
        (:meth:`digest` of the same program, remembered), ``lowered`` may be None: no tracing."""
        digest = self.digest(lowered) if digest is None else digest
        devices = list(mesh.devices.flat)
        client = devices[0].client
        flags = {
            name: repr(value)
            for name, value in sorted(jax.config.values.items())
            if not any(word in name for word in UNKEYED_FLAGS)
        }
        context = {
            "format": FORMAT_VERSION,
            "versions": _versions(),
            "platform": [client.platform, client.platform_version],
            "device_kinds": sorted({d.device_kind for d in devices}),
            "mesh": [list(mesh.axis_names), list(mesh.devices.shape)],
            # each device with its process: one SPMD executable serves every process of the
            # mesh, and a later generation whose processes own the same devices (measured: equal
            # results, processes 1.. loading process 0's entry, a 2-process job loading one
            # compiled ahead in a 3-process job)
            "devices": [[d.id, d.process_index] for d in devices],
            "flags": flags,
            "env": {name: os.environ.get(name) for name in ENV_FLAGS},
        }
        key = hashlib.sha256(json.dumps(context, sort_keys=True).encode())
        key.update(b"\0")
        key.update(digest)
        return key.hexdigest()

    def path(self, key: str, kind: str = "xla") -> pathlib.Path:
        """The entry of ``key``: an executable (``xla``) or a named program (``program``)."""
        return self.directory / f"{key}.{kind}"

    def load(
        self,
        lowered: jax.stages.Lowered | None,
        mesh: Mesh,
        *,
        wait: float | None = None,
        known: tuple[bytes, Any, Any] | None = None,
    ) -> jax.stages.Compiled | None:
        """The executable stored for ``lowered`` on ``mesh``, loaded onto the mesh's devices; None
        when there is none or it cannot be used (the reason is recorded and logged).

        ``known``: ``(digest, in_tree, out_tree)`` of ``lowered`` (:meth:`digest`, the trees of
        its arguments ``(args, kwargs)`` and of its outputs), computed already; with ``lowered``
        None, those of a program this process lowered before on such a mesh: nothing is traced.

        With ``wait`` > 0 (default: the cache's ``follow``), a process that does not lead the
        mesh (the leader owns its first device) waits up to that many seconds for the leader to
        store the entry, instead of compiling the same program itself; the leader never waits.
        A leader that cannot store its executable says so in a marker file, which ends the wait
        at once.
        """
        try:
            if lowered is not None:
                self._check_mesh(lowered, mesh)
            if known is None:
                known = (self.digest(lowered), lowered.in_tree, lowered.out_tree)
            digest, in_tree, out_tree = known
            key = self.key(lowered, mesh, digest)
            wait = self.follow if wait is None else wait
            if wait > 0 and _follows(mesh):
                self._await(key, wait)
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return self._miss(None)
        except Exception as error:  # the cache never stops a compile
            return self._miss(f"not loaded: {type(error).__name__}: {error}")
        payload, problem = _verified_payload(data, bytes.fromhex(key))
        if problem is not None:
            return self._miss(f"entry {self.path(key)} ignored: {problem}")
        try:
            compiled = compat.deserialize_executable(payload, in_tree, out_tree, mesh.devices.flat)
        except Exception as error:  # a payload this JAX cannot load is a miss, not a failure
            return self._miss(
                f"entry {self.path(key)} did not load: {type(error).__name__}: {error}"
            )
        with self._lock:
            self.hits += 1
        return compiled

    def compile(
        self, lowered: jax.stages.Lowered, mesh: Mesh, digest: bytes | None = None
    ) -> jax.stages.Compiled:
        """``lowered.compile()``, its entry written in the background (:meth:`store`), unless
        JAX's persistent compilation cache served the executable: serialized again, such an
        executable lacks its kernels (its copy fails when run), so no entry is written and a
        marker tells the mesh's other processes to compile their own, whose entries are whole.
        A program lowered on the mesh's ``AbstractMesh`` (ahead, before its devices existed) is
        compiled for the mesh's devices."""
        abstract = any(
            isinstance(info.sharding, NamedSharding)
            and isinstance(info.sharding.mesh, AbstractMesh)
            for info in jax.tree.leaves(lowered.out_info)
        )
        devices = list(mesh.devices.flat) if abstract else None
        compiled, served = compat.compile_noting_persistent_cache(lowered, devices)
        if served:
            self._decline(
                lowered,
                mesh,
                digest,
                "executable not stored: JAX's persistent compilation cache served it, and "
                "serialized again such an executable lacks its kernels",
            )
        else:
            self.store(lowered, mesh, compiled, digest)
        return compiled

    def store(
        self,
        lowered: jax.stages.Lowered,
        mesh: Mesh,
        compiled: jax.stages.Compiled,
        digest: bytes | None = None,
    ) -> concurrent.futures.Future:
        """Serialize ``compiled`` (the executable of ``lowered`` on ``mesh``; ``digest``: its
        :meth:`digest`, if computed already) now and write its entry in the background; the
        future's result is whether the entry was written."""
        try:
            self._check_mesh(lowered, mesh)
            key = self.key(lowered, mesh, digest)
            payload = compat.serialize_executable(compiled)
        except Exception as error:  # e.g. host callbacks: this step is compiled every time
            self._decline(
                lowered, mesh, digest, f"executable not stored: {type(error).__name__}: {error}"
            )
            done = concurrent.futures.Future()
            done.set_result(False)
            return done
        return self._submit(key, payload)

    def recall(self, program: bytes, mesh: Mesh) -> programs.Lowering | None:
        """The ``programs.Lowering`` of the named ``program`` (:func:`programs.stable`: its name,
        layout and abstract inputs) on ``mesh``, as the process that lowered it stored it
        (:meth:`note`), or None: no entry, or one that cannot be used (recorded and logged)."""
        key = self.key(None, mesh, program)
        path = self.path(key, "program")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except Exception as error:  # the cache never stops a compile
            self._problem(f"program not recalled: {type(error).__name__}: {error}")
            return None
        payload, problem = _verified_payload(data, bytes.fromhex(key))
        try:
            if problem is not None:
                raise ValueError(problem)
            lowering = pickle.loads(payload)
            if not isinstance(lowering, programs.Lowering):
                raise ValueError(f"holds a {type(lowering).__name__}, not a program's lowering")
            return lowering
        except Exception as error:  # a miss: the program is lowered, and its entry written again
            self._problem(f"entry {path} ignored: {error}")
            return None

    def note(self, program: bytes, mesh: Mesh, lowering: programs.Lowering) -> None:
        """Store, in the background, what the named ``program`` lowered to on ``mesh``: its
        ``programs.Lowering`` without the ``Lowered`` (see :meth:`recall`)."""
        key = self.key(None, mesh, program)
        try:
            payload = pickle.dumps(lowering)
        except Exception as error:  # an output tree that does not pickle: traced every time
            self._problem(f"program not stored: {type(error).__name__}: {error}")
            return
        self._submit(key, payload, "program")

    def close(self) -> None:
        """Wait for the writes under way."""
        self._writer.shutdown(wait=True)

    # -- internals --------------------------------------------------------------------------------

    @staticmethod
    def _check_mesh(lowered: jax.stages.Lowered, mesh: Mesh) -> None:
        """Refuse a program whose outputs are not all on ``mesh``: its device assignment would
        not be the mesh's, and loading it onto the mesh's devices would abort the process."""
        for info in jax.tree.leaves(lowered.out_info):
            sharding = info.sharding
            if not isinstance(sharding, NamedSharding) or not (
                sharding.mesh == mesh
                or (  # lowered ahead on the mesh's shape, compiled for its devices
                    isinstance(sharding.mesh, AbstractMesh)
                    and _shape(sharding.mesh) == _shape(mesh.abstract_mesh)
                )
            ):
                raise ValueError(
                    f"an output's sharding {sharding} is not a NamedSharding on {mesh}"
                )

    def _decline(
        self, lowered: jax.stages.Lowered, mesh: Mesh, digest: bytes | None, problem: str
    ) -> None:
        """Record why ``lowered``'s executable has no entry, and leave the marker that ends the
        mesh's other processes' wait for it: they compile it themselves."""
        self._problem(problem)
        with contextlib.suppress(Exception):
            self.directory.mkdir(parents=True, exist_ok=True)
            self.path(self.key(lowered, mesh, digest)).with_suffix(".none").touch()

    def _await(self, key: str, seconds: float) -> None:
        """Until the leader's entry (or its marker of none) exists, or ``seconds`` pass."""
        path, deadline = self.path(key), time.monotonic() + seconds
        while not (path.exists() or path.with_suffix(".none").exists()):
            if time.monotonic() > deadline:
                self._problem(f"no entry {path.name} from the mesh's leader in {seconds:.0f} s")
                return
            time.sleep(0.02)

    def _submit(self, key: str, payload: bytes, kind: str = "xla") -> concurrent.futures.Future:
        """Write ``key``'s entry in the background; the future's result is whether it was."""
        try:
            return self._writer.submit(self._write, key, payload, kind)
        except RuntimeError:  # closed (a compile after the job ended): write on this thread
            done = concurrent.futures.Future()
            done.set_result(self._write(key, payload, kind))
            return done

    def _write(self, key: str, payload: bytes, kind: str = "xla") -> bool:
        header = HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            bytes.fromhex(key),
            len(payload),
            hashlib.sha256(payload).digest(),
        )
        path = self.path(key, kind)
        # unique per process and thread: concurrent writers of one key never share a temp file
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(temp, "wb") as file:
                file.write(header)
                file.write(payload)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)  # atomic: readers see the old entry or the new one, whole
            _fsync_directory(self.directory)
        except OSError as error:
            self._problem(f"executable not stored in {self.directory}: {error}")
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            return False
        with self._lock:
            self.writes += kind == "xla"  # executables written
        return True

    def _miss(self, problem: str | None) -> None:
        with self._lock:
            self.misses += 1
        if problem is not None:
            self._problem(problem)
        return None

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)
        self.log(f"executable cache: {text}")


def _shape(mesh: AbstractMesh) -> tuple:
    """A mesh's axes, sizes and types (an ``AbstractMesh`` may also name a device kind)."""
    return (tuple(mesh.axis_names), tuple(mesh.axis_sizes), tuple(mesh.axis_types))


def _follows(mesh: Mesh) -> bool:
    """Whether this process waits for another to compile ``mesh``'s programs: the mesh spans
    several processes and its first device is not this process's."""
    processes = {d.process_index for d in mesh.devices.flat}
    return len(processes) > 1 and mesh.devices.flat[0].process_index != jax.process_index()


def _verified_payload(data: bytes, key: bytes) -> tuple[bytes, str | None]:
    """The payload of an entry's bytes, or why they are not a whole entry for ``key``."""
    if len(data) < HEADER.size:
        return b"", f"{len(data)} bytes, shorter than the {HEADER.size}-byte header"
    magic, version, stored_key, length, checksum = HEADER.unpack_from(data)
    if magic != MAGIC:
        return b"", f"not an executable entry (magic {magic!r}, expected {MAGIC!r})"
    if version != FORMAT_VERSION:
        return b"", f"format version {version}, expected {FORMAT_VERSION}"
    if stored_key != key:
        return b"", "its header holds another key"
    payload = data[HEADER.size :]
    if len(payload) != length:
        return b"", f"payload of {len(payload)} bytes, the header says {length}"
    if hashlib.sha256(payload).digest() != checksum:
        return b"", "payload sha256 does not match the header's"
    return payload, None


def _fsync_directory(directory: pathlib.Path) -> None:
    """Make the rename durable; a filesystem that cannot fsync a directory keeps the entry
    anyway (it is only lost on a crash, and a lost entry is a miss)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)
