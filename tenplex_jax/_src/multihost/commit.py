"""The commit protocol: versions of a train state in the tensor stores (docs/multihost.md,
"Commits and restores", states the rules). A *version* is the state at one step, laid out in the
stores as::

    v00000012/manifest            JSON, on every store: the step, the PTC (leaf paths, shapes,
                                  dtypes, specs, config, device ids, device -> process map), each
                                  process's slot, the dataset's DataState, and every stored
                                  object's box and the slots holding it
    v00000012/state/<leaf path>   one object per distinct box of the leaf, written once, by its
                                  writer process, to that process's store and the next k stores
    v00000012/commit/<process>    JSON marker, on every store: the process wrote all its objects

The holders of one box of a leaf take turns as its writer by leaf and box index; inside the writer
process the lowest-id device holding the box supplies it. A piece no store can serve raises
``StoreError`` naming the leaf, box and slots tried.

A *live version* (``l00000012/...``, the same layout) is written at a failure by the survivors
from their memory (:func:`commit_live`): the state at their last completed step, which no commit
may hold. Its processes are the survivors, renumbered in order; a box is written once, by one of
the survivors holding it (the same turns), to its store and the next ``replicas`` survivors'.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from tenplex_jax._src import box as boxes
from tenplex_jax._src import tree
from tenplex_jax._src.box import Box
from tenplex_jax._src.data import DataState
from tenplex_jax._src.errors import PlanError, StoreError
from tenplex_jax._src.multihost.rundir import PullReport
from tenplex_jax._src.plan import make_plan
from tenplex_jax._src.ptc import PTC

FORMAT = 1
PUT_THREADS = 4  # objects a process writes at once (each to its k + 1 stores in parallel)
_VERSION = re.compile(r"^([vl])(\d{8})/")


def version_prefix(step: int, *, live: bool = False) -> str:
    """``v<step>`` (a commit) or ``l<step>`` (a live version), eight digits."""
    return f"{'l' if live else 'v'}{step:08d}"


def version_of(path: str) -> tuple[int, bool] | None:
    """The (step, live) of the version an object path belongs to, or None."""
    match = _VERSION.match(path)
    return (int(match.group(2)), match.group(1) == "l") if match else None


@dataclasses.dataclass(frozen=True)
class StoredObject:
    """One distinct box of a leaf as stored: written by ``process``, held by ``slots`` (writer's
    slot first, then its replicas)."""

    path: str  # the leaf's tree path
    box: Box
    process: int
    device: int  # the writer process's device that supplies it
    slots: tuple[int, ...]
    nbytes: int

    @classmethod
    def from_json(cls, record: dict) -> StoredObject:
        """The object from its JSON (``dataclasses.asdict``, as the manifest holds it)."""
        return cls(**record | {"box": boxes.parse(record["box"]), "slots": tuple(record["slots"])})


def stored_objects(
    ptc: PTC, slots: Sequence[int], replicas: int, *, central: bool = False
) -> list[StoredObject]:
    """The objects a commit of a state laid out as ``ptc`` writes, with their writers.

    ``slots[p]`` is process ``p``'s host slot; an object is held by its writer's slot and the slots
    of the next ``replicas`` processes (mod the process count), as ``ReplicatedStore.put`` writes;
    ``central``: by the first process's slot alone (Tenplex-Central).
    """
    n = len(slots)
    k = min(replicas, n - 1)
    held = lambda writer: tuple(slots[(writer + r) % n] for r in range(k + 1))
    if central:
        held = lambda writer: (slots[0],)
    return _objects(ptc, range(n), held)[0]


def live_objects(
    ptc: PTC,
    slots: Sequence[int],
    survivors: Sequence[int],
    replicas: int = 0,
    *,
    central: bool = False,
) -> tuple[list[StoredObject], tuple[str, ...]]:
    """The objects of a live version of a state laid out as ``ptc``, written by the processes
    ``survivors`` (``slots[p]``: process ``p``'s slot), each held by its writer's slot and the
    next ``replicas`` survivors' (``central``: by the first survivor's alone); and the leaves
    some box of which no survivor holds (then there is no live version). The objects'
    ``process`` is the writer's index among the survivors, in order."""
    ring = [slots[p] for p in sorted(survivors)]
    rank = {p: i for i, p in enumerate(sorted(survivors))}
    k = min(replicas, len(ring) - 1)
    where = lambda writer: tuple(ring[(rank[writer] + r) % len(ring)] for r in range(k + 1))
    if central:
        where = lambda writer: (ring[0],)
    objects, orphans = _objects(ptc, survivors, where)
    return [dataclasses.replace(o, process=rank[o.process]) for o in objects], orphans


def _objects(ptc: PTC, writers, held) -> tuple[list[StoredObject], tuple[str, ...]]:
    """Each distinct box of each leaf, written by one of the processes in ``writers`` that hold
    it (they take turns by leaf and box index) and held by ``held(writer)``; the leaves some box
    of which none of them holds."""
    _check_keys(ptc)
    process_of = dict(zip(ptc.device_ids, ptc.hosts))
    writers = set(writers)
    out, orphans = [], set()
    for i, leaf in enumerate(ptc.leaves):
        holders: dict[Box, list[int]] = {}
        for device, box in ptc.boxes(leaf).items():
            holders.setdefault(box, []).append(device)
        for j, (box, devices) in enumerate(holders.items()):
            processes = sorted({process_of[d] for d in devices} & writers)
            if not processes:
                orphans.add(leaf.path)
                continue
            writer = processes[(i + j) % len(processes)]
            device = min(d for d in devices if process_of[d] == writer)
            size = boxes.nbytes(box, leaf.itemsize)
            out.append(
                StoredObject(
                    path=leaf.path,
                    box=box,
                    process=writer,
                    device=device,
                    slots=held(writer),
                    nbytes=size,
                )
            )
    return out, tuple(sorted(orphans))


def _check_keys(ptc: PTC) -> None:
    keys = [
        leaf.path for leaf in ptc.leaves if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    ]
    if keys:
        raise PlanError(
            f"the tensor store holds numeric arrays; leaves {keys} hold PRNG keys: store their "
            "key data (jax.random.key_data) in the train state instead"
        )


# -- the manifest --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a version holds and where; JSON in every store under ``v<step>/manifest``."""

    step: int
    slots: tuple[int, ...]  # process -> host slot
    replicas: int
    ptc: dict
    objects: tuple[StoredObject, ...]
    data_state: DataState | None = None
    live: bool = False  # written by the survivors of a failure from their memory

    @property
    def num_processes(self) -> int:
        return len(self.slots)

    @property
    def prefix(self) -> str:
        return version_prefix(self.step, live=self.live)

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, record: dict) -> Manifest:
        if record.get("format") != FORMAT:
            raise StoreError(f"manifest format {record.get('format')!r}, expected {FORMAT}")
        data = record.get("data_state")
        objects = tuple(StoredObject.from_json(o) for o in record["objects"])
        data = None if data is None else DataState.from_dict(data)
        fields = {k: v for k, v in record.items() if k != "format"}
        return cls(
            **fields | {"slots": tuple(record["slots"]), "objects": objects, "data_state": data}
        )


# -- versions in the stores (no JAX needed: the launcher calls these too) --------------------------


def versions(clients: dict[int, Any], *, live: bool = False) -> list[int]:
    """Every commit's step (``live``: every live version's) found on the live stores, ascending."""
    found = set()
    for client in clients.values():
        try:
            infos = client.list("l" if live else "v")
        except StoreError:
            continue
        found.update(k[0] for k in (version_of(i.path) for i in infos) if k is not None)
    return sorted(found)


def read_manifest(clients: dict[int, Any], step: int, *, live: bool = False) -> Manifest | None:
    path = f"{version_prefix(step, live=live)}/manifest"
    for client in clients.values():
        try:
            return Manifest.from_json(client.get_json(path))
        except StoreError:
            continue
    return None


def committed(clients: dict[int, Any], manifest: Manifest) -> list[int]:
    """The processes whose commit marker for ``manifest``'s version is on some live store."""
    done = set()
    for process in range(manifest.num_processes):
        for client in clients.values():
            try:
                client.get_json(f"{manifest.prefix}/commit/{process}")
            except StoreError:
                continue
            done.add(process)
            break
    return sorted(done)


def latest_complete(
    clients: dict[int, Any], below: int | None = None, *, live: bool = False
) -> Manifest | None:
    """The manifest of the latest complete commit (``live``: live version) on the live stores
    (steps < ``below``)."""
    for step in reversed(versions(clients, live=live)):
        if below is not None and step >= below:
            continue
        manifest = read_manifest(clients, step, live=live)
        if manifest is not None and len(committed(clients, manifest)) == manifest.num_processes:
            return manifest
    return None


def missing_objects(clients: dict[int, Any], manifest: Manifest) -> list[StoredObject]:
    """The objects of ``manifest`` that no live store holding a copy lists."""
    prefix = f"{manifest.prefix}/state/"
    held: dict[int, set] = {}
    for slot, client in clients.items():
        try:
            held[slot] = {(i.path, boxes.parse(i.box)) for i in client.list(prefix)}
        except StoreError:
            continue
    return [
        o
        for o in manifest.objects
        if not any((prefix + o.path, o.box) in held.get(s, ()) for s in o.slots)
    ]


def delete_versions(clients: dict[int, Any], keep) -> None:
    """Delete every version, commit or live, whose (step, live) does not satisfy
    ``keep(step, live)`` from the live stores."""
    for client in clients.values():
        try:
            infos = client.list("v") + client.list("l")
            found = {version_of(i.path) for i in infos} - {None}
            for step, live in found:
                if not keep(step, live):
                    client.delete(version_prefix(step, live=live) + "/")
        except StoreError:
            continue


# -- commit ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommitReport:
    """One process's part of one commit."""

    step: int
    objects: int
    nbytes: int
    copy_seconds: float  # device -> host, on the training thread
    write_seconds: float  # host -> stores, on the background thread
    complete: bool  # this process saw every marker of the version


class Committer:
    """Writes this process's objects of each version in the background, one commit at a time.

    ``stores[p]`` is the client of process ``p``'s host store (slot ``slots[p]``); ``replicated``
    is a ``ReplicatedStore`` over the same stores in process order.
    """

    def __init__(
        self,
        process: int,
        slots: Sequence[int],
        stores,
        replicated,
        replicas: int,
        *,
        central: bool = False,
    ):
        self.process = process
        self.central = central  # every object to the first process's store alone
        self.slots = tuple(slots)
        self.stores = dict(zip(self.slots, stores))
        self.replicated = replicated
        self.replicas = replicas
        self._thread: threading.Thread | None = None
        self._result: CommitReport | BaseException | None = None
        self._objects: tuple[PTC, list[StoredObject]] | None = None
        self._gc: threading.Thread | None = None  # deletes the versions before a complete one
        self._pool = concurrent.futures.ThreadPoolExecutor(PUT_THREADS, "commit-put")
        self.reports: list[CommitReport] = []

    def commit(
        self, state, ptc: PTC, step: int, data_state: DataState | None, *, wait: bool = False
    ) -> CommitReport | None:
        """Start committing ``state`` as version ``step``; with ``wait``, finish it first.

        The device-to-host copy happens before this returns, so the caller may donate ``state``.
        """
        self.wait()
        tic = time.perf_counter()
        objects = self._objects_of(ptc)
        mine = [o for o in objects if o.process == self.process]
        arrays = _leaves_as(state, ptc)
        index = {leaf.path: i for i, leaf in enumerate(ptc.leaves)}
        copies = [_host_shard(arrays[index[o.path]], o) for o in mine]
        copy_seconds = time.perf_counter() - tic
        manifest = None
        if self.process == 0:
            manifest = Manifest(
                step=step,
                slots=self.slots,
                replicas=0 if self.central else self.replicas,
                ptc=ptc.to_json(),
                objects=tuple(objects),
                data_state=data_state,
            )
        shapes = {leaf.path: leaf.shape for leaf in ptc.leaves}
        args = (step, mine, copies, shapes, manifest, copy_seconds)
        self._thread = threading.Thread(target=self._write, args=args, daemon=True)
        self._thread.start()
        return self.wait() if wait else None

    def wait(self, timeout: float = 600.0, *, collect: bool = False) -> CommitReport | None:
        """Finish the commit in flight (if any); its report, or raise what it raised.

        ``collect`` also waits for the deletion of the versions it made obsolete.
        """
        if collect and self._gc is not None:
            self._gc.join(timeout)
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise StoreError(f"a commit did not finish within {timeout:.0f} s")
        self._thread, result = None, self._result
        self._result = None
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """Finish what is in flight, then release the write threads and connections."""
        try:
            self.wait(collect=True)
        finally:
            self._pool.shutdown(wait=True)
            self.replicated.close()

    def _objects_of(self, ptc: PTC) -> list[StoredObject]:
        if self._objects is None or self._objects[0] != ptc:
            objects = stored_objects(ptc, self.slots, self.replicas, central=self.central)
            self._objects = (ptc, objects)
        return self._objects[1]

    def _write(self, step, mine, copies, shapes, manifest, copy_seconds):
        try:
            tic = time.perf_counter()
            prefix = version_prefix(step)
            if manifest is not None:  # first, so that markers never point at an unknown version
                self._put_json_all(f"{prefix}/manifest", manifest.to_json())
            put = self.replicated.put
            if self.central:
                central = self.stores[self.slots[0]]
                put = lambda process, path, data, **where: central.put(path, data, **where)
            puts = [
                self._pool.submit(
                    put,
                    self.process,
                    f"{prefix}/state/{o.path}",
                    data,
                    box=o.box,
                    global_shape=shapes[o.path],
                )
                for o, data in zip(mine, copies)
            ]
            for put in puts:
                put.result()
            marker = {
                "process": self.process,
                "objects": len(mine),
                "nbytes": sum(o.nbytes for o in mine),
            }
            self._put_json_all(f"{prefix}/commit/{self.process}", marker)
            complete = self._complete(step)
            if complete and (self._gc is None or not self._gc.is_alive()):
                # off the commit's path: deleting many objects costs the stores more than writing
                # them; a version left behind now is deleted with the next complete one
                keep = lambda s, live: s >= step  # a live version before it too
                self._gc = threading.Thread(
                    target=delete_versions, args=(self.stores, keep), daemon=True
                )
                self._gc.start()
            report = CommitReport(
                step=step,
                objects=len(mine),
                nbytes=marker["nbytes"],
                copy_seconds=copy_seconds,
                write_seconds=time.perf_counter() - tic,
                complete=complete,
            )
            self.reports.append(report)
            self._result = report
        except Exception as error:
            self._result = error

    def _put_json_all(self, path: str, obj) -> None:
        # flush=False: a store that dies takes its slot with it (never restarted), so a restore
        # reads live stores' memory; waiting for fsyncs would make every commit as slow as disk
        for client in self.stores.values():
            client.put_json(path, obj, flush=False)

    def _complete(self, step: int) -> bool:
        own = {self.slots[self.process]: self.stores[self.slots[self.process]]}
        manifest = read_manifest(own, step)
        return manifest is not None and len(committed(own, manifest)) == manifest.num_processes


def _leaves_as(state, ptc: PTC) -> list[jax.Array]:
    """``state``'s leaves, which must be those ``ptc`` describes (else ``PlanError``)."""
    arrays = jax.tree.leaves(state)
    if len(arrays) != len(ptc.leaves) or any(
        a.shape != leaf.shape for a, leaf in zip(arrays, ptc.leaves)
    ):
        paths, values, _ = tree.arrays(state)
        leaves = tree.leaves_of(paths, values)
        raise PlanError(
            f"a commit writes the state its PTC describes, but the state's {len(arrays)} "
            f"leaves are not the PTC's {len(ptc.leaves)}: "
            + tree.difference(leaves, ptc.leaves, ("the state", "the PTC"))
        )
    return arrays


def _host_shard(array: jax.Array, o: StoredObject) -> np.ndarray:
    for shard in array.addressable_shards:
        if shard.device.id == o.device:
            # a copy: the next train step donates (and may overwrite) the device buffer
            return np.array(shard.data, copy=True)
    raise PlanError(f"device {o.device} of this process holds no shard of {o.path!r} box {o.box}")


def commit_live(
    clients: dict[int, Any],
    state,
    ptc: PTC,
    step: int,
    data_state: DataState | None,
    slots: Sequence[int],
    survivors: Sequence[int],
    process: int,
    *,
    replicas: int = 0,
    central: bool = False,
    objects: Sequence[StoredObject] | None = None,
) -> tuple[int, int]:
    """Process ``process``'s part of the live version of ``state`` (the state at ``step``, laid
    out as ``ptc``; ``slots[p]``: process ``p``'s slot) after a failure that ``survivors``
    outlived: its objects (:func:`live_objects`) copied to host, then written to the stores of
    their holders (``clients``: slot -> client, those up; memory tier) as a commit's are, with
    the version's manifest and this process's marker on every survivor's store that is up. A
    copy that a dead store cannot take is skipped while another holder takes it: a survivor's
    store may die with the failure, and its memory still serves. ``objects``: the version's
    objects if the caller has them (:func:`live_objects` with these arguments). Returns
    (objects, bytes).

    Raises:
      PlanError: some box has no holder among the survivors (:func:`live_objects` names them),
        or the state is not the PTC's.
      StoreError: no holder's store took some object (then there is no marker).
      Exception: a shard could not be read (its computation failed): nothing is written.
    """
    if objects is None:
        objects, orphans = live_objects(ptc, slots, survivors, replicas, central=central)
        if orphans:
            raise PlanError(f"no survivor holds every box of the leaves {list(orphans)}")
    rank = sorted(survivors).index(process)
    arrays = _leaves_as(state, ptc)
    index = {leaf.path: i for i, leaf in enumerate(ptc.leaves)}
    mine = [o for o in objects if o.process == rank]
    copies = [_host_shard(arrays[index[o.path]], o) for o in mine]  # before any write
    ring = tuple(slots[p] for p in sorted(survivors))
    manifest = Manifest(
        step=step,
        slots=ring,
        replicas=0 if central else min(replicas, len(ring) - 1),
        ptc=ptc.to_json(),
        objects=tuple(objects),
        data_state=data_state,
        live=True,
    )
    shapes = {leaf.path: leaf.shape for leaf in ptc.leaves}
    up = {s: clients[s] for s in ring if s in clients}
    _put_json_any(up, f"{manifest.prefix}/manifest", manifest.to_json())

    def put(o: StoredObject, data: np.ndarray) -> None:
        path, tried = f"{manifest.prefix}/state/{o.path}", []
        for slot in o.slots:
            try:
                up[slot].put(path, data, box=o.box, global_shape=shapes[o.path])
            except (KeyError, StoreError) as error:
                tried.append(f"slot {slot}: {error!r}")
        if len(tried) == len(o.slots):
            raise StoreError(f"no store took {path} box {o.box}: " + "; ".join(tried))

    with concurrent.futures.ThreadPoolExecutor(PUT_THREADS, "live-put") as pool:
        for done in [pool.submit(put, o, data) for o, data in zip(mine, copies)]:
            done.result()
    nbytes = sum(o.nbytes for o in mine)
    marker = {"process": rank, "objects": len(mine), "nbytes": nbytes}
    _put_json_any(up, f"{manifest.prefix}/commit/{rank}", marker)
    return len(mine), nbytes


def _put_json_any(clients: dict[int, Any], path: str, obj) -> None:
    """``obj`` at ``path`` on every store of ``clients`` that takes it; ``StoreError`` if none."""
    taken = 0
    for client in clients.values():
        try:
            client.put_json(path, obj, flush=False)
            taken += 1
        except StoreError:
            continue
    if not taken:
        raise StoreError(f"no survivor's store took {path}")


# -- restore ---------------------------------------------------------------------------------------


def pull(
    clients: dict[int, Any],
    manifest: Manifest,
    target: PTC,
    slot: int,
    *,
    devices: Sequence[jax.Device] | None = None,
    threads: int = 8,
) -> tuple[list[jax.Array], PullReport]:
    """This process's shards of ``target``, read from the stores; (arrays in leaf order, report).

    ``clients`` maps the slots whose stores are up to their clients; ``slot`` is this process's.
    """
    tic = time.perf_counter()
    source = PTC.from_json(manifest.ptc, target)
    # offset the stored devices' ids: they belong to processes that no longer exist, and a shared
    # id would make the plan "keep" a box that this process does not hold
    offset = max(target.device_ids) + 1
    source = dataclasses.replace(source, device_ids=tuple(d + offset for d in source.device_ids))
    plan = make_plan(source, target)
    where = {(o.path, o.box): o for o in manifest.objects}
    local = {d.id: d for d in (devices or jax.local_devices())}
    reader = _Reader(clients, slot, manifest.prefix)
    jobs = []  # (leaf index, target box): one read per distinct box of this process
    for i, leaf_plan in enumerate(plan.leaves):
        distinct = {s.box: s for s in leaf_plan.shards if s.device in local}
        jobs += [(i, shard) for shard in distinct.values()]

    def fetch(job):
        i, shard = job
        leaf = target.leaves[i]
        out = np.empty(boxes.shape(shard.box), dtype=np.dtype(leaf.dtype))
        for piece in shard.pieces:
            o = where[(leaf.path, piece.src_box)]
            out[boxes.index(piece.box, shard.box)] = reader.read(o, piece.box)
        return (i, shard.box), out

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        data = dict(pool.map(fetch, jobs))
    mesh = target.mesh(list(jax.devices()))
    arrays = []
    for i, (leaf, leaf_plan) in enumerate(zip(target.leaves, plan.leaves)):
        shards = [
            jax.device_put(data[i, s.box], local[s.device])
            for s in leaf_plan.shards
            if s.device in local
        ]
        sharding = NamedSharding(mesh, leaf.spec)
        arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards))
    held = collections.Counter()
    for o in manifest.objects:
        held.update(dict.fromkeys(o.slots, o.nbytes))
    report = PullReport(
        step=manifest.step,
        nbytes=dict(reader.nbytes),
        by_slot=dict(reader.by_slot),
        skipped=tuple(reader.skipped),
        replica_for_lost_writer=reader.rescued,
        seconds=time.perf_counter() - tic,
        held_by_slot=dict(held),
    )
    return arrays, report


class _Reader:
    """Reads a piece from the closest store holding its object: own slot, writer, replicas."""

    def __init__(self, clients: dict[int, Any], slot: int, prefix: str):
        self.clients = clients
        self.slot = slot
        self.prefix = prefix
        self.lock = threading.Lock()
        self.nbytes: dict[str, int] = collections.Counter()
        self.by_slot: dict[int, int] = collections.Counter()
        self.skipped: list[str] = []
        self.rescued = 0

    def read(self, o: StoredObject, box: Box) -> np.ndarray:
        writer = o.slots[0]
        order = ([self.slot] if self.slot in o.slots else []) + [
            s for s in o.slots if s != self.slot
        ]
        tried, writer_down = [], writer not in self.clients
        for s in order:
            client = self.clients.get(s)
            if client is None:
                tried.append(f"slot {s}: store down")
                continue
            try:
                data = client.get(f"{self.prefix}/state/{o.path}", box)
            except StoreError as error:
                tried.append(f"slot {s}: {error}")
                writer_down |= s == writer
                continue
            with self.lock:
                self.nbytes["local" if s == self.slot else "remote"] += data.nbytes
                self.nbytes["writer" if s == writer else "replica"] += data.nbytes
                self.by_slot[s] += data.nbytes
                self.skipped.extend(tried)
                if s != writer and writer_down:
                    self.rescued += data.nbytes
            return data
        raise StoreError(
            f"no store serves box {box} of leaf {o.path!r} in version {self.prefix} (written by "
            f"process {o.process}, held by slots {list(o.slots)}): " + "; ".join(tried)
        )
