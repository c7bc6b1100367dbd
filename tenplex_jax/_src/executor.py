"""The state transformer: executes a reconfiguration plan on a live state, in one process.

``reshard(state, plan)`` checks the state against ``plan.src``, then builds every target shard as
the plan says, on the device path (:func:`_device_leaf`: JAX ops, any platform) or the host path
(:func:`_host_leaf`: NumPy copies into fresh buffers the CPU devices adopt, a thread per core),
deleting each old leaf none of whose buffers is kept once its new one is built.
``docs/concepts.md`` ("The executor", "Donation and peak memory") states the contract.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import itertools
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from tenplex_jax._src import box as boxes
from tenplex_jax._src import libc, tree
from tenplex_jax._src.box import Box
from tenplex_jax._src.errors import LayoutError, PlanError, one_of, where
from tenplex_jax._src.mesh import show_mesh
from tenplex_jax._src.plan import LeafPlan, Plan, ShardKind
from tenplex_jax._src.ptc import PTC

CHUNK_BYTES = 4 * 2**20  # the host path's copy task: large pieces are cut, so threads share them
# a task with fewer bytes is copied by the calling thread: handing it to the pool costs more (the
# GIL passes to a worker and back) than copying it
INLINE_BYTES = 256 * 2**10
AHEAD = 1  # leaves whose host copies run while the one before is finished


class ReshardMethod(enum.StrEnum):
    """How :func:`reshard` moves a state: ``"plan"``, the per-shard executor, or
    ``"device_put"``, the whole tree handed to ``jax.device_put`` (a baseline)."""

    PLAN = "plan"
    DEVICE_PUT = "device_put"


class Executor(enum.StrEnum):
    """How the per-shard executor copies bytes: ``"auto"`` (``"host"`` for CPU leaves,
    ``"device"`` for the rest), ``"host"`` (through host memory) or ``"device"`` (JAX ops)."""

    AUTO = "auto"
    HOST = "host"
    DEVICE = "device"


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """What an execution did, measured from the buffers it copied (not copied from the plan).

    The second value :func:`reshard` returns; ``str(report)`` is one line.

    Attributes:
      method: the :class:`ReshardMethod` :func:`reshard` was called with.
      bytes_moved: bytes copied from one device to another (the plan's count for
        ``"device_put"``, which does not say what it copied).
      bytes_kept: bytes of target shards that came from the same device.
      seconds: wall time of the copies, the checks before them not included.
      leaves: leaves built.
      kinds: executor path (``"host"``, ``"device"``) -> shard kind -> shards it built; empty for
        ``"device_put"``.
    """

    method: ReshardMethod
    bytes_moved: int
    bytes_kept: int
    seconds: float
    leaves: int
    kinds: dict[Executor, collections.Counter] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        return (
            f"{self.method}: moved {self.bytes_moved / 2**20:.3f} MiB, kept "
            f"{self.bytes_kept / 2**20:.3f} MiB, {self.leaves} leaves in {self.seconds:.3f} s"
        )


def reshard(
    state,
    plan: Plan,
    *,
    donate: bool = True,
    method: ReshardMethod | str = "plan",
    executor: Executor | str = "auto",
    devices: Sequence[jax.Device] | None = None,
):
    """Apply ``plan`` to ``state``: the same values, bit for bit, laid out as ``plan.dst``.

    The state is checked against ``plan.src`` (tree, shapes, dtypes, device boxes) before a byte
    is copied or freed; a kept shard reuses its buffer. Rebind the result
    (``state, report = reshard(state, plan)``): with ``donate``, the old arrays are deleted leaf
    by leaf as the new ones are built. Example::

        plan = tj.make_plan(ptc, tj.allocate(ptc, ptc.relayout(tj.ParallelConfig(data=2), devs)))
        state, report = tj.reshard(state, plan)
        print(report)        # plan: moved ... MiB, kept ... MiB, N leaves in ... s

    Args:
      state: the tree the plan's source PTC describes, laid out as it says: an ``nnx.State``, a
        pytree of ``jax.Array``, or NNX graph nodes, whose ``nnx.state`` is used (write the
        result back with ``nnx.update(nodes, new_state)``).
      plan: a :class:`tenplex_jax.typing.Plan` from :func:`tenplex_jax.make_plan`.
      donate: delete each old leaf once its new one is built, so the peak stays near the state
        plus one leaf (a leaf whose buffers live on as kept shards is freed when the caller
        drops the old state).
      method: a :class:`tenplex_jax.typing.ReshardMethod`: ``"plan"`` (the per-shard executor)
        or ``"device_put"`` (a baseline).
      executor: with ``"plan"``, how bytes are copied (:class:`tenplex_jax.typing.Executor`):
        ``"auto"``, ``"host"`` or ``"device"``.
      devices: where the target PTC's device ids are looked up (default ``jax.devices()``).

    Returns:
      ``(new_state, report)``: the state on the target mesh, in the target PTC's containers, and
      a :class:`tenplex_jax.typing.ReshardReport`.

    Raises:
      PlanError: the state is not laid out as ``plan.src`` says (tree, shape, dtype, boxes, a
        deleted array), ``executor="host"`` meets a leaf NumPy cannot view, or ``method`` or
        ``executor`` is unknown; nothing was moved.
      LayoutError: the target names devices this process does not have; nothing was moved.
    """
    method = one_of(ReshardMethod, method, "reshard's method", PlanError)
    executor = one_of(Executor, executor, "reshard's executor", PlanError)
    paths, arrays, treedef = tree.arrays(state)
    mesh, paths_of = _checked(paths, arrays, plan, devices, executor)
    if isinstance(plan.dst.treedef, jax.tree_util.PyTreeDef):
        treedef = plan.dst.treedef  # the target's containers (an orbax target's dicts, boxes, ...)
    run = _device_put if method == ReshardMethod.DEVICE_PUT else _execute
    out, report = run(arrays, plan, mesh, paths_of, donate)
    return jax.tree_util.tree_unflatten(treedef, out), report


def _checked(paths, arrays, plan: Plan, devices, executor: Executor):
    """Everything checked before anything moves: the state against ``plan.src``, the target's
    devices, each leaf's path. Returns (the target mesh, each leaf's path)."""
    check_tree(paths, arrays, plan.src)
    check_state(arrays, plan)
    mesh = _target_mesh(plan, devices)
    choose = {
        Executor.AUTO: _path_of,
        Executor.HOST: _host_only,
        Executor.DEVICE: lambda array, leaf: _device_leaf,
    }
    return mesh, [choose[executor](array, leaf) for array, leaf in zip(arrays, plan.leaves)]


def _device_put(arrays, plan: Plan, mesh, paths_of, donate: bool):
    """The baseline: the whole tree to ``jax.device_put``; the report counts the plan's bytes."""
    start = time.perf_counter()
    shardings = [NamedSharding(mesh, leaf.dst.spec) for leaf in plan.leaves]
    out = jax.device_put(arrays, shardings, donate=donate)
    jax.block_until_ready(out)
    report = ReshardReport(
        method=ReshardMethod.DEVICE_PUT,
        bytes_moved=plan.bytes_moved,
        bytes_kept=plan.bytes_kept,
        seconds=time.perf_counter() - start,
        leaves=len(out),
    )
    return out, report


def _execute(arrays, plan: Plan, mesh, paths_of, donate: bool):
    """The per-shard executor: every leaf built as the plan says, in a window (:class:`_Window`);
    the host path's copies on a thread per core."""
    start = time.perf_counter()
    pool = contextlib.nullcontext()  # no pool on one core, nor without host copies
    if _host_leaf in paths_of and (os.cpu_count() or 1) > 1:
        pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count(), "tenplex-copy")
    with pool as pool:
        window = _Window(plan, mesh, donate, pool)
        for array, leaf, execute, nbytes in zip(arrays, plan.leaves, paths_of, window.new_bytes):
            window.start(array, leaf, execute, nbytes)
        while window.started:
            window.finish()
    jax.block_until_ready(window.out)
    report = ReshardReport(
        method=ReshardMethod.PLAN,
        bytes_moved=window.moved,
        bytes_kept=window.kept,
        seconds=time.perf_counter() - start,
        leaves=len(window.out),
        kinds=window.kinds,
    )
    return window.out, report


class _Window:
    """The per-shard executor's schedule, leaf by leaf: the host copies of at most ``AHEAD``
    leaves run while one is finished, while their new buffers stay within ``limit`` (an eighth of
    the state, or one leaf), which is also what deleted leaves free before memory goes back."""

    def __init__(self, plan: Plan, mesh, donate: bool, pool):
        self.mesh, self.donate, self.pool = mesh, donate, pool
        self.by_id = {d.id: d for d in mesh.devices.flat}
        self.new_bytes = [_new_bytes(leaf) for leaf in plan.leaves]
        self.limit = max([plan.dst.nbytes // 8] + self.new_bytes)
        self.started: collections.deque = collections.deque()  # (array, leaf, path, work, bytes)
        self.ahead = 0  # new bytes of the leaves started and not finished
        self.freed = 0  # bytes of old leaves deleted since host memory was last given back
        self.out: list[jax.Array] = []
        self.moved = self.kept = 0
        self.kinds: dict[Executor, collections.Counter] = {}

    def start(self, array: jax.Array, leaf: LeafPlan, execute, nbytes: int) -> None:
        """Start a leaf (its host copies, on the pool), first finishing the leaves it must
        wait for."""
        while self.started and (len(self.started) > AHEAD or self.ahead + nbytes > self.limit):
            self.finish()
        work = _HostCopies(array, leaf, self.pool) if execute is _host_leaf else None
        self.started.append((array, leaf, execute, work, nbytes))
        self.ahead += nbytes

    def finish(self) -> None:
        """Finish the oldest leaf started: its new array, its counts, its old buffers freed."""
        array, leaf, execute, work, nbytes = self.started.popleft()
        self.ahead -= nbytes
        shards, moved, kept = execute(array, leaf, self.by_id, work)
        new = jax.make_array_from_single_device_arrays(
            leaf.dst.shape, NamedSharding(self.mesh, leaf.dst.spec), shards
        )
        self.out.append(new)
        self.moved, self.kept = self.moved + moved, self.kept + kept
        path = Executor.HOST if execute is _host_leaf else Executor.DEVICE
        self.kinds.setdefault(path, collections.Counter()).update(s.kind for s in leaf.shards)
        if self.donate and not any(s.kind == ShardKind.KEEP for s in leaf.shards):
            jax.block_until_ready(new)  # the copies read the old buffers; they must finish
            self.freed += sum(shard.data.nbytes for shard in array.addressable_shards)
            array.delete()
            if execute is _host_leaf and self.freed >= self.limit:
                libc.release_host_memory()  # else freed shards stay in the heap
                self.freed = 0


def place(state, ptc):
    """Lay ``state`` (host arrays, or arrays on any devices) out as ``ptc`` says:
    ``jax.device_put``.

    Use it once, for a state built without a mesh (``nnx.use_eager_sharding(False)``); afterwards
    move the state with plans. The placed arrays never share buffers with ``state``
    (``may_alias=False``), so a later donating ``reshard`` of the placed state cannot free arrays
    the caller still holds. Example::

        state = tj.place(nnx.state((model, optimizer)), ptc)

    Args:
      state: the state ``ptc`` was built from (or one with the same tree): an ``nnx.State``,
        NNX graph nodes, or a pytree of NumPy or JAX arrays; dtypes may differ from the PTC's.
      ptc: the layout to place it in; its devices are looked up in ``jax.devices()``.

    Returns:
      The state as ``jax.Array`` s sharded as ``ptc`` says, in the state's own containers.

    Raises:
      PlanError: the state's leaves (paths, shapes) are not the PTC's; nothing was placed.
      LayoutError: the PTC names devices this process does not have.
    """
    paths, arrays, treedef = tree.arrays(state)
    check_tree(paths, arrays, ptc, dtypes=False)  # host data may come in another dtype
    mesh = ptc.mesh()
    shardings = [NamedSharding(mesh, leaf.spec) for leaf in ptc.leaves]
    placed = jax.device_put(arrays, shardings, may_alias=False)
    # jax 0.10 still hands back the input's own buffer for a leaf replicated onto a device that
    # holds it, may_alias=False or not: copy those, or a donating reshard would free the caller's
    placed = [_unaliased(x, y, s) for x, y, s in zip(arrays, placed, shardings)]
    return jax.tree_util.tree_unflatten(treedef, placed)


def _unaliased(given, placed: jax.Array, sharding: NamedSharding) -> jax.Array:
    if not isinstance(given, jax.Array):
        return placed  # host data: always copied
    extended = jax.dtypes.issubdtype(given.dtype, jax.dtypes.extended)  # no buffer pointer
    if extended or _buffers(given) & _buffers(placed):
        return jax.device_put(jnp.copy(given), sharding)
    return placed


def _buffers(array: jax.Array) -> set[tuple[int, int]]:
    return {(s.device.id, s.data.unsafe_buffer_pointer()) for s in array.addressable_shards}


def check_tree(paths: list[str], values: list, ptc: PTC, *, dtypes: bool = True) -> None:
    """``PlanError`` unless the state's leaves (``paths`` and array-like ``values``,
    from :func:`tree.arrays`) are the PTC's: the same paths in the same order, shapes and (with
    ``dtypes``) dtypes; the message names the leaves that differ, both sides of each."""
    leaves = tree.leaves_of(paths, values)
    diff = tree.difference(leaves, ptc.leaves, ("the state", "the PTC"), dtypes=dtypes)
    if diff:
        raise PlanError(
            f"the state's tree does not match the PTC's ({len(paths)} leaves vs "
            f"{len(ptc.leaves)}; PTC on {ptc.config.describe()} over {list(ptc.device_ids)}): "
            f"{diff}"
        )


def _target_mesh(plan: Plan, devices) -> jax.sharding.Mesh:
    """The target mesh, or a ``LayoutError`` naming the target devices this process lacks and the
    first leaf that would go there, before anything moves."""
    have = {d.id for d in (jax.devices() if devices is None else devices)}
    missing = sorted(set(plan.dst.device_ids) - have)
    if not missing:
        return plan.dst.mesh(devices)
    leaf = next(
        (item for item in plan.leaves if any(s.device in missing for s in item.shards)), None
    )
    raise LayoutError(
        f"a plan runs on devices this process has, but the target PTC names devices {missing} "
        f"that it does not have (it has {sorted(have)}); nothing was moved"
        + (": " + _both(leaf, plan) if leaf is not None else "")
    )


def _both(leaf: LeafPlan, plan: Plan) -> str:
    """A leaf in both layouts: path, shape, source and target specs and meshes."""
    return where(
        leaf.path,
        leaf.dst.shape,
        f"{leaf.src.spec} -> {leaf.dst.spec}",
        f"{plan.src.config.describe()} over {list(plan.src.device_ids)} -> "
        f"{plan.dst.config.describe()} over {list(plan.dst.device_ids)}",
    )


def check_state(arrays, plan: Plan) -> None:
    """Raise ``PlanError`` unless ``arrays`` are laid out exactly as ``plan.src`` says."""
    src = plan.src
    ptc_mesh = (tuple(src.config.names), tuple(src.config.sizes), tuple(src.device_ids))
    meshes: dict[int, tuple] = {}  # id(mesh) -> its names, shape and device ids, read once
    for array, leaf in zip(arrays, src.leaves):
        if not isinstance(array, jax.Array):
            raise PlanError(
                f"a live state holds jax.Arrays, got {type(array).__name__}: "
                + where(leaf.path, leaf.shape, leaf.spec, src.config.describe())
            )
        if array.is_deleted():
            raise PlanError(
                "the state holds a deleted array (donated by an earlier reshard or jit): "
                + where(leaf.path, leaf.shape, leaf.spec, src.config.describe())
            )
        if _placed_as(array.sharding, leaf, ptc_mesh, meshes):
            continue  # the PTC's own sharding: its boxes are the PTC's, no need to compare them
        have = {
            d.id: boxes.of_index(idx, leaf.shape)
            for d, idx in array.sharding.devices_indices_map(leaf.shape).items()
        }
        if have != src.boxes(leaf):
            sharding = array.sharding
            placed = (
                f"{sharding.spec} on {show_mesh(sharding.mesh, devices=False)}"
                if isinstance(sharding, NamedSharding)
                else f"{sharding}"
            )
            raise PlanError(
                f"the state is not laid out as the plan's source PTC says: the array is placed "
                f"as {placed} over devices {sorted(have)}, the PTC says {leaf.spec} on "
                f"{src.config.describe()} over {list(src.device_ids)}; build the plan from the "
                f"state's current PTC (PTC.from_shardings(state) reads it): "
                + where(leaf.path, leaf.shape, leaf.spec, src.config.describe())
            )


def _placed_as(sharding, leaf, ptc_mesh: tuple, meshes: dict[int, tuple]) -> bool:
    """Whether ``sharding`` is ``NamedSharding(the PTC's mesh, the leaf's spec)`` (names, shape,
    device order) and divides the leaf evenly: then every device's box is the PTC's. ``False``
    only means "compare the boxes"."""
    if not isinstance(sharding, NamedSharding) or sharding.spec != leaf.spec:
        return False
    try:
        sharding.shard_shape(leaf.shape)  # raises unless the mesh axes divide every dim
    except ValueError:
        return False
    mesh = sharding.mesh
    if id(mesh) not in meshes:
        devices = getattr(mesh, "devices", None)  # an AbstractMesh has none
        meshes[id(mesh)] = (
            ()
            if devices is None
            else (tuple(mesh.axis_names), devices.shape, tuple(d.id for d in devices.flat))
        )
    return meshes[id(mesh)] == ptc_mesh


# -- choosing a path ---------------------------------------------------------------------------


def _on_host(array: jax.Array) -> bool:
    """Whether NumPy can view this array's buffers: plain dtypes on CPU devices."""
    return not jax.dtypes.issubdtype(array.dtype, jax.dtypes.extended) and all(
        s.device.platform == "cpu" for s in array.addressable_shards
    )


def _path_of(array: jax.Array, leaf: LeafPlan):
    return _host_leaf if _on_host(array) else _device_leaf


def _host_only(array: jax.Array, leaf: LeafPlan):
    if not _on_host(array):
        platforms = sorted({s.device.platform for s in array.addressable_shards})
        raise PlanError(
            f"executor='host' copies through NumPy views of CPU buffers, but this leaf is "
            f"{array.dtype} on {platforms}; use executor='auto' or 'device': "
            + where(leaf.path, leaf.dst.shape, leaf.dst.spec, "the plan's target")
        )
    return _host_leaf


def _sources(array: jax.Array, leaf: LeafPlan) -> dict[int, jax.Array]:
    """The source shards the plan reads, by device id: a failed device's are never touched."""
    needed = {piece.src_device for shard in leaf.shards for piece in shard.pieces}
    return {s.device.id: s.data for s in array.addressable_shards if s.device.id in needed}


# -- the device path ---------------------------------------------------------------------------


def _device_leaf(array: jax.Array, leaf: LeafPlan, by_id, work=None):
    """One target leaf's shards with JAX ops; (shards in target order, bytes moved, kept).

    Every piece reaches its target device before it is assembled: JAX refuses to concatenate
    arrays committed to different devices.
    """
    local = _sources(array, leaf)
    moved = kept = 0
    pieces, targets = [], []  # every piece, sliced at its source, and the device it goes to
    for shard in leaf.shards:
        if shard.kind == ShardKind.KEEP:
            continue
        for piece in shard.pieces:
            data = local[piece.src_device]
            if piece.box != piece.src_box:
                data = data[boxes.index(piece.box, piece.src_box)]  # runs on the source device
            if piece.local:
                kept += data.nbytes
            else:
                moved += data.nbytes
            pieces.append(data)
            targets.append(by_id[shard.device])
    arrived = iter(jax.device_put(pieces, targets) if pieces else ())
    shards = []
    for shard in leaf.shards:
        if shard.kind == ShardKind.KEEP:
            shards.append(local[shard.device])
            kept += local[shard.device].nbytes
            continue
        parts = [(piece.box, next(arrived)) for piece in shard.pieces]
        shards.append(_assemble(parts))
    return shards, moved, kept


def _assemble(parts: list[tuple[Box, jax.Array]]) -> jax.Array:
    """Concatenate pieces that tile a box on a grid (all on one device): split on the first dim
    with several starts, recursively."""
    if len(parts) == 1:
        return parts[0][1]
    for dim in range(len(parts[0][0])):
        starts = sorted({box[dim][0] for box, _ in parts})
        if len(starts) > 1:
            groups = [[p for p in parts if p[0][dim][0] == s] for s in starts]
            return jax.lax.concatenate([_assemble(g) for g in groups], dim)
    raise PlanError(f"pieces {[box for box, _ in parts]} overlap; a merge needs disjoint pieces")


# -- the host path -----------------------------------------------------------------------------


def _new_bytes(leaf: LeafPlan) -> int:
    """Bytes of the new buffers a leaf's execution allocates (every shard but the kept)."""
    return sum(boxes.nbytes(s.box, leaf.dst.itemsize) for s in leaf.shards if s.kind != "keep")


class _HostCopies:
    """One leaf's host copies, started: every non-kept target shard gets a fresh aligned buffer,
    and every piece is copied into its place from a zero-copy NumPy view of its source, in chunks
    of at most ``CHUNK_BYTES`` along the piece's first dim, so that the pool's threads share the
    bytes evenly however the leaf is cut (NumPy releases the GIL while it copies).

    Small chunks are packed into tasks of up to ``CHUNK_BYTES``, and a task under
    ``INLINE_BYTES`` is copied at once by the calling thread: a leaf of many small pieces costs a
    few hand-offs to the pool, not one per piece."""

    def __init__(self, array: jax.Array, leaf: LeafPlan, pool=None):
        self.local = _sources(array, leaf)
        self.views = views = {i: np.asarray(a) for i, a in self.local.items()}  # zero-copy on CPU
        self.blocks: dict[int, np.ndarray] = {}
        tasks: list[_Task] = []
        task = _Task()
        for i, shard in enumerate(leaf.shards):
            if shard.kind == ShardKind.KEEP:
                continue
            dtype = views[shard.pieces[0].src_device].dtype
            out = self.blocks[i] = _aligned_empty(boxes.shape(shard.box), dtype)
            for piece in shard.pieces:
                src = views[piece.src_device][boxes.index(piece.box, piece.src_box)]
                dst = out[boxes.index(piece.box, shard.box)]
                for a, b in _chunks(src, dst):
                    if task.nbytes and task.nbytes + a.nbytes > CHUNK_BYTES:
                        tasks.append(task)
                        task = _Task()
                    task.add(a, b, piece.local)
        if task.nbytes or task.copies:
            tasks.append(task)
        # the pool runs tasks FIFO across leaves, so the next leaf's copies follow this one's
        inline = pool is None
        self.copies = [
            _done(task.run) if inline or task.nbytes < INLINE_BYTES else pool.submit(task.run)
            for task in tasks
        ]

    def result(self) -> tuple[int, int]:
        """Wait for the copies: (bytes moved, bytes kept) as copied."""
        moved = kept = 0
        for future in self.copies:
            task_moved, task_kept = future.result()
            moved, kept = moved + task_moved, kept + task_kept
        return moved, kept


class _Task:
    """Copies one thread makes in a row: ``(src, dst)`` views, and the bytes moved and kept."""

    __slots__ = ("copies", "kept", "moved", "nbytes")

    def __init__(self):
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []
        self.nbytes = self.moved = self.kept = 0

    def add(self, src: np.ndarray, dst: np.ndarray, local: bool) -> None:
        self.copies.append((src, dst))
        self.nbytes += src.nbytes
        if local:
            self.kept += src.nbytes
        else:
            self.moved += src.nbytes

    def run(self) -> tuple[int, int]:
        """Copy; (bytes moved, bytes kept), counted from the arrays copied."""
        for src, dst in self.copies:
            np.copyto(dst, src)
        return self.moved, self.kept


def _chunks(src: np.ndarray, dst: np.ndarray):
    """``(src, dst)`` cut along their first dim longer than 1 into parts of at most
    ``CHUNK_BYTES`` (one part when the piece is small or cannot be cut)."""
    parts = -(-src.nbytes // CHUNK_BYTES)
    dim = next((d for d, n in enumerate(src.shape) if n > 1), None)
    if parts <= 1 or dim is None:
        yield src, dst
        return
    cuts = np.linspace(0, src.shape[dim], min(parts, src.shape[dim]) + 1).astype(int)
    for lo, hi in itertools.pairwise(cuts):
        index = (slice(None),) * dim + (slice(lo, hi),)
        yield src[index], dst[index]


def _done(fn, *args) -> concurrent.futures.Future:
    """Run ``fn`` now, as a completed future (no pool on one core, or a task too small to hand
    to it)."""
    future = concurrent.futures.Future()
    future.set_result(fn(*args))
    return future


def _host_leaf(array: jax.Array, leaf: LeafPlan, by_id, work: _HostCopies | None = None):
    """One target leaf's shards through host memory; (shards in target order, bytes moved, kept).

    ``work`` is the leaf's copies already started (:class:`_HostCopies`); without it they run now.
    The fresh, aligned buffers are adopted by their target devices without a second copy.
    """
    work = work if work is not None else _HostCopies(array, leaf)
    moved, kept = work.result()
    shards: list = [None] * len(leaf.shards)
    for i, shard in enumerate(leaf.shards):
        if shard.kind == ShardKind.KEEP:
            shards[i] = work.local[shard.device]
            kept += work.views[shard.device].nbytes  # NumPy's count: a jax.Array's is slower
    built = sorted(work.blocks)
    placed = jax.device_put(
        [work.blocks[i] for i in built],
        [by_id[leaf.shards[i].device] for i in built],
        may_alias=True,
    )
    for i, data in zip(built, placed):
        shards[i] = data
    return shards, moved, kept


def _aligned_empty(shape, dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialized array whose data starts on an ``alignment``-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)
