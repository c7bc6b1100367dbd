"""The parallelizable tensor collection (PTC): a train state's abstract layout.

A PTC records, for every leaf of a train state (params, optimizer moments, step counters, RNG state),
its tree path, shape, dtype and ``PartitionSpec`` (the *slicing* and *partitioning* of the Tenplex
paper), plus the mesh's device ids (the *allocation*). It holds no arrays, so two PTCs can be built,
compared and planned between without touching device memory.

Specs come from the logical axis names that Flax NNX stores on each variable
(``nnx.with_partitioning(init, ("embed", "mlp"))`` → ``out_sharding=("embed", "mlp")``) and from
logical-axis rules that map them to the mesh axes ``data``, ``fsdp``, ``tensor`` and ``pipe``, with
flax's own rule semantics (``tenplex_jax.rules``). Optimizer moments carry the metadata of the
param they mirror, so they get its layout; leaves without logical names (step counters, RNG keys
and counts) are replicated.

Example::

    state = nnx.state((model, optimizer))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    ptc = PTC.of(state, rules, ParallelConfig(data=2, tensor=4), jax.devices())
    ptc.leaf("model/w1").spec   # PartitionSpec('fsdp', 'tensor')
    new = ptc.relayout(ParallelConfig(fsdp=4), jax.devices()[4:])   # the same state, laid out anew

**A PTC describes the state as it is.** Built from a live state whose arrays already carry
``NamedSharding``s, ``PTC.of`` checks that the computed layout is the one on the devices and names
the leaf and both specs when it is not (planning from a layout that is not there would move the
wrong bytes); a new layout of a placed state comes from ``ptc.relayout`` or an abstract state.

**Uneven dims.** A dim of size ``n`` sharded over mesh axes of total size ``k`` needs ``n % k == 0``.
When it does not divide, ``PTC.of`` refuses the config with a ``LayoutError`` naming the leaf, dim,
axis and sizes — unless ``allow_replicate=True``: then the mesh axes of that dim are dropped, innermost
first, until the rest divides; the dropped axes replicate the dim and are recorded in
``LeafLayout.replicated`` so the plan summary shows them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from tenplex_jax import box as boxes
from tenplex_jax import rules as logical_rules
from tenplex_jax.box import Box, Shape
from tenplex_jax.errors import LayoutError, PlanError, where
from tenplex_jax.rules import Rules

__all__ = ["MESH_AXES", "PTC", "Box", "LeafLayout", "ParallelConfig", "Rules", "Shape"]

# Mesh axis order, outermost first: tensor parallel groups are neighbouring devices, pipeline stages
# the farthest apart, as on real clusters where neighbours share the fastest links.
MESH_AXES = ("pipe", "data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """A parallel configuration: the size of each mesh axis. Any axis may be 1."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    pipe: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if not isinstance(size, (int, np.integer)) or size < 1:
                raise LayoutError(
                    f"mesh axis sizes must be integers >= 1, got {axis}={size!r} in {self!r}"
                )

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes in mesh order (``MESH_AXES``)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape.values())

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """``"data=2,tensor=4"`` → ``ParallelConfig(data=2, tensor=4)``."""
        sizes = {}
        if text.strip() == "single":
            return cls()
        for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.isdigit():
                raise LayoutError(
                    f"a parallel config is 'axis=size,...' with axes {MESH_AXES}, got {text!r}"
                )
            sizes[name] = int(value)
        return cls(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in self.shape.items() if s > 1) or "single"

    def abstract_mesh(self) -> AbstractMesh:
        return AbstractMesh(tuple(self.shape.values()), MESH_AXES, axis_types=(AxisType.Auto,) * 4)

    def make_mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """A mesh of Auto axes (what Flax NNX layers expect) over ``devices`` in the given order."""
        if len(devices) != self.num_devices:
            raise LayoutError(f"config {self} needs {self.num_devices} devices, got {len(devices)}")
        grid = np.array(list(devices), dtype=object).reshape(tuple(self.shape.values()))
        return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 4)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The layout of one leaf: path, shape, dtype, spec, and the logical names it came from."""

    path: str
    shape: Shape
    dtype: Any
    spec: PartitionSpec
    logical: tuple[str | None, ...] | None = None
    replicated: tuple[tuple[int, str], ...] = ()  # (dim, mesh axis) dropped because indivisible

    @property
    def itemsize(self) -> int:
        # PRNG key dtypes are not numpy dtypes but carry their own itemsize.
        return self.dtype.itemsize if _is_key(self.dtype) else np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class PTC:
    """Parallelizable tensor collection: the abstract layout of a whole train state.

    ``device_ids`` lists the mesh's devices in row-major mesh order (``MESH_AXES``); ``hosts`` gives the
    process index of each, used to prefer same-host sources when planning.
    """

    config: ParallelConfig
    device_ids: tuple[int, ...]
    hosts: tuple[int, ...]
    leaves: tuple[LeafLayout, ...]
    treedef: Any = dataclasses.field(compare=False)
    # how the specs were derived, for relayout (None for a PTC read back without them)
    rules: tuple | None = dataclasses.field(default=None, compare=False)
    allow_replicate: bool = dataclasses.field(default=False, compare=False)

    def __post_init__(self):
        if len(self.device_ids) != self.config.num_devices:
            raise LayoutError(
                f"config {self.config} needs {self.config.num_devices} devices, got "
                f"{len(self.device_ids)}"
            )
        if len(set(self.device_ids)) != len(self.device_ids):
            raise LayoutError(f"device ids must be distinct, got {self.device_ids}")
        if len(self.hosts) != len(self.device_ids):
            raise LayoutError(
                f"need one host per device, got {len(self.hosts)} for {len(self.device_ids)}"
            )

    @classmethod
    def of(
        cls,
        state,
        rules: Rules,
        config: ParallelConfig,
        devices: Sequence[jax.Device | int],
        *,
        hosts: Sequence[int] | None = None,
        allow_replicate: bool = False,
    ) -> PTC:
        """The PTC of ``state`` laid out by ``rules`` over ``config`` on ``devices``.

        ``state`` is an ``nnx.State`` (live or from ``nnx.eval_shape``), NNX graph nodes such as
        ``(model, optimizer)``, or any pytree of arrays / ``ShapeDtypeStruct``. ``devices`` are
        ``jax.Device`` objects or bare device ids (for planning without devices); in mesh order.
        Arrays that already carry ``NamedSharding``s must be laid out as computed (else
        ``LayoutError`` names the leaf and both specs): for another layout, ``relayout``.
        """
        paths, leaves, treedef = flatten_state(state)
        pairs = [_logical_and_value(path, leaf) for path, leaf in zip(paths, leaves)]
        logical, values = [p[0] for p in pairs], [p[1] for p in pairs]
        ptc = cls._build(paths, logical, values, treedef, rules, config, devices, hosts,
                         allow_replicate)  # fmt: skip
        for leaf, value in zip(ptc.leaves, values):
            ptc._check_placed(leaf, value)
        return ptc

    def relayout(
        self,
        config: ParallelConfig,
        devices: Sequence[jax.Device | int],
        *,
        hosts: Sequence[int] | None = None,
        rules: Rules | None = None,
        allow_replicate: bool | None = None,
    ) -> PTC:
        """The same state laid out over ``config`` on ``devices``, by the same rules (or ``rules``).

        Pure, like ``of`` on an abstract state: the target of a plan from this PTC.
        """
        rules = self.rules if rules is None else rules
        if rules is None:
            raise LayoutError(
                f"this PTC ({self.config} on {list(self.device_ids)}) does not know the rules it "
                "was laid out by (it was read back from a record without them): pass rules="
            )
        values = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.leaves]
        replicate = self.allow_replicate if allow_replicate is None else allow_replicate
        return self._build([leaf.path for leaf in self.leaves],
                           [leaf.logical for leaf in self.leaves], values, self.treedef, rules,
                           config, devices, hosts, replicate)  # fmt: skip

    @classmethod
    def _build(cls, paths, logical, values, treedef, rules, config, devices, hosts, replicate):
        if len(devices) == 0:
            raise LayoutError(f"a PTC needs at least one device, got none (config {config})")
        ids = tuple(d if isinstance(d, (int, np.integer)) else d.id for d in devices)
        if hosts is None:
            hosts = tuple(
                0 if isinstance(d, (int, np.integer)) else d.process_index for d in devices
            )
        rules = logical_rules.normalize(rules, MESH_AXES)
        sizes, mesh = config.shape, _mesh_str(config)
        layouts = []
        for path, names, value in zip(paths, logical, values):
            shape, dtype = tuple(value.shape), value.dtype
            if names is None:
                layouts.append(LeafLayout(path, shape, dtype, PartitionSpec()))
                continue
            if len(names) != len(shape):
                raise LayoutError(
                    f"logical axes {names} name {len(names)} dims but the leaf has "
                    f"{len(shape)}: " + where(path, shape, names, mesh)
                )
            spec, dropped = logical_rules.spec(names, rules, sizes, path, shape,
                                               allow_replicate=replicate, mesh=mesh)  # fmt: skip
            layouts.append(LeafLayout(path, shape, dtype, spec, names, dropped))
        return cls(config, ids, tuple(int(h) for h in hosts), tuple(layouts), treedef, rules,
                   replicate)  # fmt: skip

    def _check_placed(self, leaf: LeafLayout, value) -> None:
        """A value placed with a ``NamedSharding`` must hold the boxes this PTC gives it."""
        # only arrays on devices: an abstract value's sharding (jax.eval_shape of a sharded
        # init) describes no bytes, and is what a new layout is computed from
        sharding = value.sharding if isinstance(value, jax.Array) else None
        if not isinstance(sharding, NamedSharding):
            return  # host data, a single device, or an abstract value: not laid out yet
        mesh = sharding.mesh
        if (
            mesh.axis_names == MESH_AXES
            and tuple(mesh.axis_sizes) == tuple(self.config.shape.values())
            and tuple(d.id for d in mesh.devices.flat) == self.device_ids
            and _entries(sharding.spec, leaf) == _entries(leaf.spec, leaf)
        ):
            return
        have = {d.id: boxes.of_index(index, leaf.shape)
                for d, index in sharding.devices_indices_map(leaf.shape).items()}  # fmt: skip
        if have == self.boxes(leaf):
            return  # the same boxes on the same devices, written another way
        on = sorted(have)
        raise LayoutError(
            f"a PTC of a placed state must describe the layout it has: the array is placed as "
            f"{sharding.spec} on mesh {dict(mesh.shape)} over devices "
            f"{on if len(on) <= 16 else f'{on[:16]}...'}, the rules give {leaf.spec} on "
            f"{_mesh_str(self.config)} over {list(self.device_ids)}; for a new layout of this "
            f"state use ptc.relayout(config, devices), or PTC.of on an abstract state "
            f"(jax.eval_shape): " + where(leaf.path, leaf.shape, leaf.spec, _mesh_str(self.config))
        )

    # -- records ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The PTC as JSON: config, devices, hosts, rules and each leaf's path, shape, dtype, spec,
        logical names and replicated dims (not the tree structure: ``from_json`` takes it from a
        PTC)."""
        rules = self.rules
        if rules is not None:
            rules = [[name, list(a) if isinstance(a, tuple) else a] for name, a in rules]
        return {
            "config": {axis: int(size) for axis, size in dataclasses.asdict(self.config).items()},
            "device_ids": [int(d) for d in self.device_ids],
            "hosts": [int(h) for h in self.hosts],
            "rules": rules,
            "allow_replicate": self.allow_replicate,
            "leaves": [
                {
                    "path": leaf.path,
                    "shape": list(leaf.shape),
                    "dtype": _dtype_str(leaf.dtype),
                    "spec": [list(e) if isinstance(e, tuple) else e for e in leaf.spec],
                    "logical": None if leaf.logical is None else list(leaf.logical),
                    "replicated": [[dim, axis] for dim, axis in leaf.replicated],
                }
                for leaf in self.leaves
            ],
        }

    @classmethod
    def from_json(cls, record: dict, like: PTC) -> PTC:
        """The PTC of ``to_json``'s record, with ``like``'s tree structure; ``PlanError`` unless
        the record's leaves (paths, shapes, dtypes) are ``like``'s."""
        got = [(r["path"], tuple(r["shape"]), r["dtype"]) for r in record["leaves"]]
        want = [(leaf.path, leaf.shape, _dtype_str(leaf.dtype)) for leaf in like.leaves]
        if got != want:
            show = lambda leaf: f"{leaf[0]!r} {leaf[2]}{list(leaf[1])}"
            diff = next(
                (
                    f"recorded leaf {show(a)} vs asked {show(b)}"
                    for a, b in zip(got, want)
                    if a != b
                ),
                f"{len(got)} recorded leaves vs {len(want)} asked",
            )
            raise PlanError(
                f"the record holds another state than the one asked for: {diff}; use the state "
                "it was recorded from (same model, optimizer and tree)"
            )
        # dtypes come from ``like`` (they were checked equal by name): a PRNG key dtype
        # ("key<fry>") has no numpy spelling to parse
        leaves = tuple(
            LeafLayout(
                r["path"],
                tuple(r["shape"]),
                same.dtype,
                PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in r["spec"])),
                None if r.get("logical") is None else tuple(r["logical"]),
                tuple((int(dim), axis) for dim, axis in r.get("replicated", ())),
            )
            for r, same in zip(record["leaves"], like.leaves)
        )
        rules = record.get("rules")
        if rules is not None:
            rules = tuple((n, tuple(a) if isinstance(a, list) else a) for n, a in rules)
        return cls(
            ParallelConfig(**record["config"]),
            tuple(record["device_ids"]),
            tuple(record["hosts"]),
            leaves,
            like.treedef,
            rules,
            bool(record.get("allow_replicate", False)),
        )

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def leaf(self, path: str) -> LeafLayout:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise KeyError(
            f"no leaf {path!r} in this PTC; leaves: {[l.path for l in self.leaves][:8]}..."
        )

    def intervals(self, leaf: LeafLayout) -> np.ndarray:
        """[dims, devices in mesh order, 2]: each device's (start, stop) along each dim of ``leaf``.

        Computed from the spec alone; a scalar gives shape ``[0, devices, 2]``.
        """
        coords = np.indices(tuple(self.config.shape.values())).reshape(4, -1).T  # [device, 4]
        sizes = self.config.shape
        per_dim = []
        for dim, entry in enumerate(logical_rules.spec_entries(leaf.spec, len(leaf.shape))):
            index = np.zeros(len(coords), dtype=np.int64)
            count = 1
            for axis in entry:  # major to minor
                index = index * sizes[axis] + coords[:, MESH_AXES.index(axis)]
                count *= sizes[axis]
            block = leaf.shape[dim] // count
            per_dim.append(np.stack([index * block, (index + 1) * block], axis=1))
        return np.stack(per_dim) if per_dim else np.zeros((0, len(coords), 2), dtype=np.int64)

    def boxes(self, leaf: LeafLayout) -> dict[int, Box]:
        """Device id → the box of ``leaf`` that device holds.

        Equals ``NamedSharding(mesh, spec).devices_indices_map(shape)`` with slices as intervals.
        """
        per_device = self.intervals(leaf).transpose(1, 0, 2).reshape(len(self.device_ids), -1)
        # replicas share a box: convert each distinct box once, and share the tuple
        distinct, which = np.unique(per_device, axis=0, return_inverse=True)
        boxes = [tuple(zip(row[0::2], row[1::2])) for row in distinct.tolist()]
        return {dev: boxes[i] for dev, i in zip(self.device_ids, which.ravel().tolist())}

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The concrete mesh; devices are looked up by id among ``devices`` (default ``jax.devices()``)."""
        by_id = {d.id: d for d in (jax.devices() if devices is None else devices)}
        missing = [i for i in self.device_ids if i not in by_id]
        if missing:
            raise LayoutError(
                f"PTC for {self.config} names devices {missing} that this process does not have"
            )
        return self.config.make_mesh([by_id[i] for i in self.device_ids])

    def shardings(self, mesh: Mesh | None = None):
        """A tree shaped like the state with a ``NamedSharding`` at each leaf (for jit and device_put)."""
        mesh = self.mesh() if mesh is None else mesh
        return jax.tree_util.tree_unflatten(
            self.treedef, [NamedSharding(mesh, leaf.spec) for leaf in self.leaves]
        )

    def abstract(self, mesh: Mesh | None = None):
        """A tree of ``ShapeDtypeStruct`` with shardings (what orbax restores onto)."""
        mesh = self.mesh() if mesh is None else mesh
        return jax.tree_util.tree_unflatten(
            self.treedef,
            [
                jax.ShapeDtypeStruct(
                    leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, leaf.spec)
                )
                for leaf in self.leaves
            ],
        )

    def __str__(self) -> str:
        lines = [
            (
                f"PTC {self.config} on devices {list(self.device_ids)}: {len(self.leaves)} leaves, "
                f"{self.nbytes / 2**20:.2f} MiB"
            )
        ]
        for leaf in self.leaves:
            note = f"  (replicated {leaf.replicated})" if leaf.replicated else ""
            lines.append(f"  {leaf.path:48s} {leaf.shape!s:20s} {leaf.spec!s}{note}")
        return "\n".join(lines)


def flatten_state(state) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) of a state; leaves are NNX variables or array-likes.

    ``treedef`` is the array-level treedef: ``tree_unflatten(treedef, arrays)`` rebuilds the state.
    """
    if _is_graph_nodes(state):
        state = nnx.state(state)
    is_var = lambda x: isinstance(x, nnx.Variable)
    with_paths, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)
    arrays, treedef = jax.tree_util.tree_flatten(state)
    if len(arrays) != len(with_paths):
        raise LayoutError("every NNX variable in the state must hold exactly one array")
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in with_paths]
    return paths, [leaf for _, leaf in with_paths], treedef


def _is_graph_nodes(state) -> bool:
    """NNX objects, or a tuple / list / dict of them, such as ``{"model": m, "optimizer": o}``."""
    if isinstance(state, dict):
        nodes = list(state.values())
    else:
        nodes = list(state) if isinstance(state, (tuple, list)) else [state]
    return len(nodes) > 0 and all(nnx.graph.is_graph_node(n) for n in nodes)


def _logical_and_value(path: str, leaf) -> tuple[tuple[str | None, ...] | None, Any]:
    """(logical names or None, the array-like value) of one leaf of a state."""
    if isinstance(leaf, nnx.Variable):
        logical, value = leaf.get_metadata().get("out_sharding"), leaf.get_value()
    else:
        logical, value = None, leaf
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise LayoutError(
            f"leaf {path!r} is {type(value).__name__}, not an array; every leaf of a "
            f"state must be an array or ShapeDtypeStruct"
        )
    return (None if logical is None else tuple(logical)), value


def _dtype_str(dtype) -> str:
    """A dtype's name: numpy's for array dtypes, JAX's (``key<fry>``) for PRNG keys."""
    return str(dtype) if _is_key(dtype) else np.dtype(dtype).name


def _mesh_str(config: ParallelConfig) -> str:
    return "{" + ", ".join(f"{n}: {s}" for n, s in config.shape.items()) + "}"


def _entries(spec: PartitionSpec, leaf: LeafLayout) -> list[tuple[str, ...]]:
    return logical_rules.spec_entries(spec, len(leaf.shape))
