"""Reconfiguration plans: the delta between two PTCs.

``make_plan(src, dst)`` says, for every leaf and every target shard, where the shard's bytes come
from (a :class:`ShardKind`), reading the closest replica; ``allocate(src, dst)`` reorders the
target's devices so that the most bytes stay in place. Planning is pure: it reads two PTCs, never
device memory, and computes the shard plans once per leaf layout (the moments mirror their params,
layers repeat), which keeps thousands of devices and leaves under a second. ``docs/concepts.md``
states the contract.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import gc
import heapq
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import tree
from tenplex_jax._src.box import Box
from tenplex_jax._src.errors import LostShardsError, PlanError
from tenplex_jax._src.ptc import PTC, LeafLayout


class ShardKind(enum.StrEnum):
    """Where a target shard's bytes come from (:attr:`ShardPlan.kind` says what each means)."""

    KEEP = "keep"
    SPLIT = "split"
    MOVE = "move"
    MERGE = "merge"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A box of a leaf copied from ``src_device``, whose shard there covers ``src_box``.

    Attributes:
      src_device: the id of the device the bytes are read from.
      src_box: the box of the leaf that the source device's shard covers (``box`` lies in it).
      box: the box of the leaf this piece copies, in the leaf's global indices.
      nbytes: the piece's bytes.
      local: the source device is the target device (a copy on the device, or none for a keep).
    """

    src_device: int
    src_box: Box
    box: Box
    nbytes: int
    local: bool


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How the shard ``box`` of a leaf on ``device`` is produced.

    Attributes:
      device: the target device's id.
      box: the box of the leaf the target shard covers.
      kind: a :class:`ShardKind`: ``"keep"`` (the device holds exactly this box already),
        ``"split"`` (a slice of a larger box it holds), ``"move"`` (one piece from another
        device) or ``"merge"`` (several pieces, local or remote, concatenated).
      pieces: the :class:`Piece` s that tile ``box``.
    """

    device: int
    box: Box
    kind: ShardKind
    pieces: tuple[Piece, ...]

    @property
    def bytes_moved(self) -> int:
        """Bytes of the pieces copied from other devices."""
        return sum(p.nbytes for p in self.pieces if not p.local)

    @property
    def bytes_kept(self) -> int:
        """Bytes of the pieces taken from the target device itself."""
        return sum(p.nbytes for p in self.pieces if p.local)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan of one leaf: its source and target layouts, and a :class:`ShardPlan` per target
    device.

    Leaves laid out alike (same shape, itemsize and specs) share one ``shards`` tuple.

    Attributes:
      src: the leaf's layout in the source PTC.
      dst: its layout in the target PTC.
      shards: one :class:`ShardPlan` per target device, in the target PTC's device order.
      totals: ``(bytes moved, bytes kept, kinds)`` of ``shards`` when the planner already
        counted them (not compared); ``None`` to count them on demand.
    """

    src: LeafLayout
    dst: LeafLayout
    shards: tuple[ShardPlan, ...]
    totals: tuple[int, int, collections.Counter] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def path(self) -> str:
        """The leaf's tree path."""
        return self.dst.path

    @property
    def bytes_moved(self) -> int:
        """Bytes of this leaf copied between devices."""
        if self.totals is not None:
            return self.totals[0]
        return sum(s.bytes_moved for s in self.shards)

    @property
    def bytes_kept(self) -> int:
        """Bytes of this leaf's target shards taken from the same device."""
        if self.totals is not None:
            return self.totals[1]
        return sum(s.bytes_kept for s in self.shards)

    @property
    def kinds(self) -> collections.Counter:
        """Shard kind (``keep``, ``split``, ``move``, ``merge``) -> how many of this leaf's
        shards."""
        if self.totals is not None:
            return collections.Counter(self.totals[2])
        return collections.Counter(s.kind for s in self.shards)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The reconfiguration plan from ``src`` to ``dst``: one ``LeafPlan`` per leaf.

    What :func:`make_plan` returns and :func:`tenplex_jax.reshard` executes; ``print(plan)``
    shows :meth:`summary`.

    Attributes:
      src: the PTC the state is laid out as now.
      dst: the PTC it is laid out as after the plan.
      leaves: one :class:`LeafPlan` per leaf, in the PTCs' leaf order.
    """

    src: PTC
    dst: PTC
    leaves: tuple[LeafPlan, ...]

    @property
    def bytes_moved(self) -> int:
        """Bytes copied between devices."""
        return sum(leaf.bytes_moved for leaf in self.leaves)

    @property
    def bytes_kept(self) -> int:
        """Bytes of target shards taken from the same device (keep, split, local pieces of a
        merge)."""
        return sum(leaf.bytes_kept for leaf in self.leaves)

    @property
    def kinds(self) -> collections.Counter:
        """Shard kind (``keep``, ``split``, ``move``, ``merge``) -> how many target shards."""
        return sum((leaf.kinds for leaf in self.leaves), collections.Counter())

    @property
    def senders(self) -> dict[int, int]:
        """Source device id → bytes it sends to other devices."""
        load: dict[int, int] = collections.Counter()
        for leaf in self.leaves:
            for shard in leaf.shards:
                for p in shard.pieces:
                    if not p.local:
                        load[p.src_device] += p.nbytes
        return dict(load)

    def summary(self, depth: int | None = None) -> str:
        """The plan as a table: per leaf group, its leaves, bytes of state, kept and moved, and
        shard kinds; then the totals.

        Args:
          depth: group leaves by the first ``depth`` parts of their paths (default: by parent,
            the path without its last part).

        Returns:
          The table, one line per group.
        """
        groups: dict[str, list[LeafPlan]] = {}
        for leaf in self.leaves:
            parts = leaf.path.split("/")
            key = "/".join(parts[: len(parts) - 1 if depth is None else depth]) or "/"
            groups.setdefault(key, []).append(leaf)
        mib = lambda n: f"{n / 2**20:10.3f}"
        lines = [
            (
                f"plan {self.src.config} on {_devs(self.src.device_ids)} -> {self.dst.config} on "
                f"{_devs(self.dst.device_ids)}"
            ),
            (
                f"  {'group':40s} {'leaves':>6s} {'state MiB':>10s} {'kept MiB':>10s} "
                f"{'moved MiB':>10s}  keep/split/move/merge"
            ),
        ]
        for key, leaves in groups.items():
            kinds = sum((leaf.kinds for leaf in leaves), collections.Counter())
            notes = sorted(
                {
                    f"{leaf.dst.path.split('/')[-1]}: replicated {leaf.dst.replicated}"
                    for leaf in leaves
                    if leaf.dst.replicated
                }
            )
            lines.append(
                f"  {key[-40:]:40s} {len(leaves):6d} "
                f"{mib(sum(leaf.dst.nbytes for leaf in leaves))} "
                f"{mib(sum(leaf.bytes_kept for leaf in leaves))} "
                f"{mib(sum(leaf.bytes_moved for leaf in leaves))}  "
                + "/".join(str(kinds[k]) for k in ShardKind)
                + ("  " + "; ".join(notes) if notes else "")
            )
        kinds = self.kinds
        lines.append(
            f"  {'total':40s} {len(self.leaves):6d} {mib(self.dst.nbytes)} {mib(self.bytes_kept)} "
            f"{mib(self.bytes_moved)}  " + "/".join(str(kinds[k]) for k in ShardKind)
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _devs(ids: Iterable[int]) -> str:
    ids = list(ids)
    if len(ids) > 1 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"devices {ids[0]}..{ids[-1]}"
    return f"devices {ids}"


def make_plan(src: PTC, dst: PTC, *, failed: Iterable[int] = ()) -> Plan:
    """The reconfiguration plan that turns a state laid out as ``src`` into one laid out as ``dst``.

    For every target shard, where its bytes come from: kept in place, split from a larger local
    shard, moved from another device (the closest replica: the device itself, then its host, then
    the least loaded), or merged from several pieces. Pure: it reads two PTCs, no device memory.

    >>> from flax import linen as nn
    >>> w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "mlp"))
    >>> src = PTC.of({"w": w}, [("mlp", "tensor")], ParallelConfig(data=2, tensor=2), range(4))
    >>> plan = make_plan(src, src.relayout(ParallelConfig(tensor=4), range(4)))
    >>> plan.bytes_moved, plan.bytes_kept, plan.kinds == {"split": 2, "move": 2}  # 0, 1 split
    (256, 256, True)
    >>> make_plan(src, src.relayout(ParallelConfig(tensor=2), [2, 3]), failed=[0, 1]).kinds["keep"]
    2

    Args:
      src: the layout the state has (a :class:`PTC`).
      dst: the layout it should have: a PTC of the same state (same leaf paths, shapes and dtypes,
        in order), any mesh and devices.
      failed: ids of devices whose buffers are lost: no piece is read from them (not even a
        local keep); every box comes from a surviving replica.

    Returns:
      The :class:`tenplex_jax.typing.Plan`, for :func:`tenplex_jax.reshard`.

    Raises:
      PlanError: ``src`` and ``dst`` are not layouts of the same state, or ``dst`` uses a
        failed device.
      LostShardsError: some box is held only by failed devices; ``error.lost`` names every such
        leaf and box (the state must come back from a checkpoint).
    """
    failed = frozenset(int(d) for d in failed)
    if failed & set(dst.device_ids):
        raise PlanError(
            f"the target PTC ({dst.config.describe()} on {list(dst.device_ids)}) uses failed "
            f"devices {sorted(failed & set(dst.device_ids))}; a plan around failed devices must "
            f"target the devices that remain"
        )
    check_same_state(src, dst)
    layouts = _ByLayout(src, dst, failed)
    leaves, lost = [], []  # lost: (path, boxes held only by failed devices)
    with _collector_paused():
        for s, d in zip(src.leaves, dst.leaves):
            shards, totals = layouts.plan(s, d)
            if shards:
                leaves.append(LeafPlan(s, d, shards, totals))
            else:
                lost.append((s.path, tuple(totals)))
    if lost:
        raise LostShardsError(src, failed, tuple(lost))
    return Plan(src, dst, tuple(leaves))


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a plan is built: a plan is a tree of small
    objects with no cycles, and the collector's passes over them, triggered by their number, took
    40 % of ``make_plan`` at 4,096 devices (0.43 against 0.77 s for 1,000 tensors)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _ByLayout:
    """The shard plans of each leaf layout (shape, itemsize, source and target specs), computed
    once for all the leaves laid out so; a layout with boxes only failed devices hold has no
    shards, and its lost boxes in place of the totals."""

    def __init__(self, src: PTC, dst: PTC, failed: frozenset[int]):
        self.src, self.dst, self.failed = src, dst, failed
        self.host = dict(zip(src.device_ids, src.hosts)) | dict(zip(dst.device_ids, dst.hosts))
        # layout -> (shards, bytes each sender sends, totals or lost boxes)
        self.by_layout: dict[tuple, tuple[tuple[ShardPlan, ...], dict[int, int], Any]] = {}
        self.uses: collections.Counter = collections.Counter()  # layout -> leaves planned so far

    def plan(self, s: LeafLayout, d: LeafLayout) -> tuple[tuple[ShardPlan, ...], Any]:
        """(the leaf's shard plans, their totals); ``((), lost boxes)`` for a lost leaf."""
        key = (s.shape, s.itemsize, s.spec, d.spec)
        if key not in self.by_layout:
            self.by_layout[key] = self._planned(s, d)
        self.uses[key] += 1
        shards, _, totals = self.by_layout[key]
        return shards, totals

    def _planned(self, s: LeafLayout, d: LeafLayout):
        load: dict[int, int] = collections.Counter()  # bytes each sender sends so far
        for key, count in self.uses.items():
            for device, n in self.by_layout[key][1].items():
                load[device] += count * n
        held = self.src.boxes(s)
        if self.failed:
            alive = {dev: box for dev, box in held.items() if dev not in self.failed}
            gone = sorted(set(held.values()) - set(alive.values()))
            if gone:
                return (), {}, gone
            held = alive
        return _plan_leaf(s, held, self.dst.boxes(d), self.host, load)


def check_same_state(src: PTC, dst: PTC) -> None:
    """``PlanError`` unless ``src`` and ``dst`` have the same leaves in the same order (paths,
    shapes, dtypes): two layouts of one state. The containers may differ (an ``nnx.State`` and the
    plain dict of an orbax target, Linen boxes and unboxed arrays); the message names the leaves
    that differ (:func:`tree.difference`) and both meshes."""
    diff = tree.difference(src.leaves, dst.leaves, ("the source", "the target"))
    if diff:
        raise PlanError(
            f"a plan maps one state onto a new layout of the same state (the same leaf paths, "
            f"shapes and dtypes, in order), but the source PTC ({len(src.leaves)} leaves on "
            f"{src.config.describe()} over {_devs(src.device_ids)}) and the target PTC "
            f"({len(dst.leaves)} leaves on {dst.config.describe()} over "
            f"{_devs(dst.device_ids)}) differ: {diff}"
        )


def allocate(src: PTC, dst: PTC) -> PTC:
    """``dst`` with its devices reordered over the mesh so that the most bytes stay in place.

    The order of a mesh's devices is the PTC's *allocation*: which device gets which box. For the
    same device set and config, some orders let devices keep (or split) the shards they hold while
    others make every shard move. This solves the assignment of devices to mesh positions that
    maximizes the bytes each device already holds of its new boxes, so ``make_plan(src,
    allocate(src, dst))`` moves no more bytes than ``make_plan(src, dst)``, usually fewer. Devices
    are only permuted, never added or dropped; a device stays where it is unless moving it gains.

    Devices that hold the same boxes of every leaf (data-parallel replicas) are interchangeable,
    and so are positions that get the same boxes: the assignment is solved between these classes
    as a transportation problem (an LP whose vertex solutions are integral), a few dozen classes
    where a device-by-position assignment would have thousands of rows: 4096 devices take
    milliseconds instead of minutes.

    >>> from flax import linen as nn
    >>> w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "mlp"))
    >>> src = PTC.of({"w": w}, [("mlp", "tensor")], ParallelConfig(data=2, tensor=2), range(4))
    >>> dst = src.relayout(ParallelConfig(data=2, tensor=2), [3, 2, 1, 0])   # halves swapped
    >>> make_plan(src, dst).bytes_moved, allocate(src, dst).device_ids
    (1024, (2, 3, 0, 1))
    >>> make_plan(src, allocate(src, dst)).bytes_moved       # the replicas trade places instead
    0

    Args:
      src: the layout the state has.
      dst: the target layout: its config and device set are kept, its device order is the
        starting point.

    Returns:
      ``dst`` with ``device_ids`` and ``hosts`` permuted (``dst`` itself when its order is
      already as good).

    Raises:
      PlanError: the assignment's linear program fails (a solver error, not a user error).
    """
    held = {d: i for i, d in enumerate(src.device_ids)}
    rows = [held.get(d, -1) for d in dst.device_ids]  # each dst device's mesh index in src
    if all(r < 0 for r in rows):
        return dst
    src_class, src_boxes = _classes(src)  # [src devices] -> class; class -> boxes per layout
    dst_class, dst_boxes = _classes(dst)
    weight = _weights(src, dst, src_boxes, dst_boxes)
    device_class = np.array([src_class[r] if r >= 0 else -1 for r in rows])
    flow = _transport(weight, device_class, dst_class)
    given = sum(weight[c, j] for c, j in zip(device_class, dst_class) if c >= 0)
    if (flow * weight).sum() <= given:
        return dst  # the given order is already as good: keep the user's allocation
    order = _assign(flow, device_class, dst_class)
    return dataclasses.replace(
        dst,
        device_ids=tuple(dst.device_ids[i] for i in order),
        hosts=tuple(dst.hosts[i] for i in order),
    )


def _weights(src: PTC, dst: PTC, src_boxes: tuple, dst_boxes: tuple) -> np.ndarray:
    """The bytes a device of source class i holds of the boxes of a position of target class j,
    ``[source classes, target classes]``, summed over the leaves (:func:`_classes`' boxes)."""
    weight = np.zeros((len(src_boxes[0]), len(dst_boxes[0])), dtype=np.float64)
    for (s_key, d_key), itemsize in _layout_pairs(src, dst).items():
        a = src_boxes[1][s_key]  # [dims, source classes, 2]
        b = dst_boxes[1][d_key]  # [dims, target classes, 2]
        lo = np.maximum(a[:, :, None, 0], b[:, None, :, 0])
        hi = np.minimum(a[:, :, None, 1], b[:, None, :, 1])
        # a scalar has no dims: the empty product is 1 element, held in full by every replica
        weight += np.prod(np.clip(hi - lo, 0, None), axis=0) * itemsize
    return weight


def _classes(ptc: PTC) -> tuple[np.ndarray, tuple[list, dict]]:
    """Each mesh position's class (positions holding the same box of every leaf share one) and,
    per leaf layout ``(shape, spec)``, the classes' intervals ``[dims, classes, 2]``."""
    per_layout, keys = {}, []
    for leaf in ptc.leaves:
        key = (leaf.shape, leaf.spec)
        if key not in per_layout:
            per_layout[key] = ptc.intervals(leaf)  # [dims, positions, 2]
            keys.append(key)
    n = len(ptc.device_ids)
    signature = np.concatenate(
        [per_layout[k].transpose(1, 0, 2).reshape(n, -1) for k in keys] + [np.zeros((n, 1), int)],
        axis=1,
    )
    _, first, which = np.unique(signature, axis=0, return_index=True, return_inverse=True)
    which = which.ravel()
    return which, (list(first), {k: v[:, first] for k, v in per_layout.items()})


def _layout_pairs(src: PTC, dst: PTC) -> dict[tuple, int]:
    """((src shape, spec), (dst shape, spec)) -> the itemsizes of the leaves laid out so, summed."""
    pairs: dict[tuple, int] = collections.Counter()
    for s, d in zip(src.leaves, dst.leaves):
        pairs[((s.shape, s.spec), (d.shape, d.spec))] += d.itemsize
    return pairs


def _transport(weight: np.ndarray, device_class: np.ndarray, position_class: np.ndarray):
    """How many devices of each source class go to positions of each target class: the
    transportation problem maximizing the bytes kept, over the class pairs that share bytes (every
    other pair gains nothing, so the leftover devices fill the leftover positions in any order)."""
    from scipy.optimize import linprog  # a dependency of jax itself
    from scipy.sparse import csr_matrix

    supply = np.bincount(device_class[device_class >= 0], minlength=weight.shape[0])
    demand = np.bincount(position_class, minlength=weight.shape[1])
    flow = np.zeros_like(weight)
    i, j = np.nonzero(weight)
    if not len(i):
        return flow
    n = len(i)
    rows = np.concatenate([i, weight.shape[0] + j])
    constraints = csr_matrix(
        (np.ones(2 * n), (rows, np.concatenate([np.arange(n)] * 2))), shape=(sum(weight.shape), n)
    )
    # scale to keep HiGHS's tolerances meaningful for byte counts of any size
    result = linprog(
        -weight[i, j] / weight.max(),
        A_ub=constraints,
        b_ub=np.concatenate([supply, demand]),
        bounds=(0, None),
        method="highs-ds",
    )
    if result.status != 0:  # cannot happen for a feasible, bounded transportation problem
        raise PlanError(f"allocation: the transportation LP failed: {result.message}")
    flow[i, j] = np.round(result.x)  # a simplex vertex of a bipartite LP is integral
    return flow


def _assign(flow: np.ndarray, device_class: np.ndarray, position_class: np.ndarray) -> list[int]:
    """Device index (into ``dst.device_ids``) per mesh position, following ``flow``: a device that
    already sits at a position its flow allows stays, the others take the first free positions of
    their target class in mesh order, and the rest fill the rest in order."""
    flow = flow.astype(np.int64)
    n = len(position_class)
    order, used = [-1] * n, [False] * n
    for p in range(n):  # stay where the flow allows it
        c, j = device_class[p], position_class[p]
        if c >= 0 and flow[c, j] > 0:
            flow[c, j] -= 1
            order[p], used[p] = p, True
    free: dict[int, list[int]] = collections.defaultdict(list)
    for p in range(n - 1, -1, -1):
        if not used[p] and device_class[p] >= 0:
            free[device_class[p]].append(p)  # popped from the end: lowest mesh index first
    for p in range(n):
        if order[p] >= 0:
            continue
        for c in np.nonzero(flow[:, position_class[p]] > 0)[0]:
            if free[c]:
                flow[c, position_class[p]] -= 1
                order[p] = free[c].pop()
                used[order[p]] = True
                break
    rest = iter(q for q in range(n) if not used[q])
    return [q if q >= 0 else next(rest) for q in order]


def _plan_leaf(
    s: LeafLayout,
    src_boxes: dict[int, Box],
    dst_boxes: dict[int, Box],
    host: dict[int, int],
    before: dict[int, int],
) -> tuple[tuple[ShardPlan, ...], dict[int, int], tuple[int, int, collections.Counter]]:
    """The shard plans of one leaf layout, the bytes each sender sends for it, and their totals
    (bytes moved, bytes kept, shards of each kind).

    Senders among replicas balance this leaf's own load first, then the load ``before`` it, so the
    result depends on the layout alone for the leaves that reuse it. Replicas share their box
    tuples (``PTC.boxes``), so what a pair of boxes decides is worked out once per pair.
    """
    # The distinct source boxes tile the array on a grid; index them by block coordinates so that a
    # target box finds the source boxes it intersects without scanning every device.
    block = [_block_size(src_boxes, dim) for dim in range(len(s.shape))]
    replicas: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
    coords: dict[int, tuple[int, ...]] = {}  # a box tuple's id -> its block coordinates
    for dev, box in src_boxes.items():
        coord = coords.get(id(box))
        if coord is None:
            coord = coords[id(box)] = tuple(lo // b for (lo, _), b in zip(box, block))
        replicas[coord].append(dev)
    senders = {coord: _Senders(devs, host, before) for coord, devs in replicas.items()}
    itemsize = s.itemsize
    geometry: dict[Box, list[tuple[tuple[int, ...], Box, Box, int]]] = {}
    held: dict[tuple[int, int], tuple[ShardKind, int] | None] = {}  # (own, box) ids -> kind
    shards, moved, kept = [], 0, 0
    kinds: collections.Counter = collections.Counter()
    for dev, box in dst_boxes.items():
        own = src_boxes.get(dev)
        if own is not None:
            pair = (id(own), id(box))
            if pair not in held:  # the same box (keep) or a larger one (split), or neither
                fits = boxes.contains(own, box)
                kind = ShardKind.KEEP if own == box else ShardKind.SPLIT
                held[pair] = (kind, boxes.nbytes(box, itemsize)) if fits else None
            if held[pair] is not None:
                kind, n = held[pair]
                pieces = (Piece(dev, own, box, n, True),)
                shards.append(ShardPlan(device=dev, box=box, kind=kind, pieces=pieces))
                kept += n
                kinds[kind] += 1
                continue
        if box not in geometry:  # replicas of a target box read the same source blocks
            ranges = [
                range(lo // b, (hi - 1) // b + 1) if hi > lo else range(1)
                for (lo, hi), b in zip(box, block)
            ]
            geometry[box] = [
                (coord, src_box, part, boxes.nbytes(part, itemsize))
                for coord in itertools.product(*ranges)
                for src_box in [src_boxes[replicas[coord][0]]]
                for part in [boxes.intersect(src_box, box)]
            ]
        pieces = []
        for coord, src_box, part, n in geometry[box]:
            if own == src_box:  # the target device holds a replica of this block itself
                pieces.append(Piece(dev, src_box, part, n, True))
                kept += n
            else:
                pieces.append(Piece(senders[coord].take(host.get(dev), n), src_box, part, n, False))
                moved += n
        kind = ShardKind.MERGE if len(pieces) > 1 else ShardKind.MOVE
        shards.append(ShardPlan(device=dev, box=box, kind=kind, pieces=tuple(pieces)))
        kinds[kind] += 1
    sends = {c: n for group in senders.values() for c, n in group.sent.items()}
    return tuple(shards), sends, (moved, kept, kinds)


class _Senders:
    """The replicas of one source block, handing out the closest sender for each piece read.

    Same host first, then the least bytes sent for this leaf, then the least sent ``before`` it,
    then the lowest id (for determinism). One heap per host, and a heap of the hosts' best (stale
    entries skipped), keep each choice logarithmic in the replicas and hosts.
    """

    def __init__(self, devices: list[int], host: dict[int, int], before: dict[int, int]):
        self.heaps: dict[int | None, list[tuple[int, int, int]]] = collections.defaultdict(list)
        for c in devices:
            self.heaps[host.get(c)].append((0, before.get(c, 0), c))
        for heap in self.heaps.values():
            heapq.heapify(heap)
        self.tops = [(heap[0], h) for h, heap in self.heaps.items()]  # (a host's best, host)
        heapq.heapify(self.tops)
        self.sent: dict[int, int] = {}

    def take(self, target_host: int | None, nbytes: int) -> int:
        if target_host not in self.heaps:  # the best sender of any host
            if len(self.heaps) == 1:
                target_host = next(iter(self.heaps))
            else:
                while self.heaps[self.tops[0][1]][0] != self.tops[0][0]:
                    heapq.heappop(self.tops)  # a host whose best has sent since
                target_host = self.tops[0][1]
        heap = self.heaps[target_host]
        sent, before, c = heap[0]
        heapq.heapreplace(heap, (sent + nbytes, before, c))
        if len(self.heaps) > 1:  # one host: its heap is the only choice, no tops to keep
            heapq.heappush(self.tops, (heap[0], target_host))
        self.sent[c] = sent + nbytes
        return c


def _block_size(held: dict[int, Box], dim: int) -> int:
    lo, hi = next(iter(held.values()))[dim]
    return max(hi - lo, 1)
