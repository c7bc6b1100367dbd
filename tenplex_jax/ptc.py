"""The parallelizable tensor collection (PTC): a train state's abstract layout.

A PTC records, for every leaf of a train state (params, optimizer moments, step counters, RNG state),
its tree path, shape, dtype and ``PartitionSpec`` (the *slicing* and *partitioning* of the Tenplex
paper), plus the mesh's device ids (the *allocation*). It holds no arrays, so two PTCs can be built,
compared and planned between without touching device memory.

Specs come from the logical axis names that Flax NNX stores on each variable
(``nnx.with_partitioning(init, ("embed", "mlp"))`` → ``out_sharding=("embed", "mlp")``) and from
logical-axis rules that map them to the mesh axes ``data``, ``fsdp``, ``tensor`` and ``pipe``.
Optimizer moments carry the metadata of the param they mirror, so they get its layout; leaves without
logical names (step counters, RNG keys and counts) are replicated.

Example::

    state = nnx.state((model, optimizer))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    ptc = PTC.of(state, rules, ParallelConfig(data=2, tensor=4), jax.devices())
    ptc.leaf("model/w1").spec   # PartitionSpec('fsdp', 'tensor')

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

from tenplex_jax.errors import LayoutError, where

Shape = tuple[int, ...]
Box = tuple[tuple[int, int], ...]  # one half-open (start, stop) interval per dim, in global indices
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]

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

    def __post_init__(self):
        if len(self.device_ids) != self.config.num_devices:
            raise LayoutError(
                f"config {self.config} needs {self.config.num_devices} devices, got {len(self.device_ids)}"
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
        """
        if len(devices) == 0:
            raise LayoutError(f"a PTC needs at least one device, got none (config {config})")
        ids = tuple(d if isinstance(d, (int, np.integer)) else d.id for d in devices)
        if hosts is None:
            hosts = tuple(
                0 if isinstance(d, (int, np.integer)) else d.process_index for d in devices
            )
        mesh = config.abstract_mesh()
        rule_map = _rule_map(rules, mesh)
        paths, leaves, treedef = flatten_state(state)
        layouts = tuple(
            _layout(path, leaf, rule_map, mesh, allow_replicate)
            for path, leaf in zip(paths, leaves)
        )
        return cls(config, ids, tuple(int(h) for h in hosts), layouts, treedef)

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
        for dim, entry in enumerate(_spec_entries(leaf.spec, len(leaf.shape))):
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


def _rule_map(rules: Rules, mesh: AbstractMesh) -> dict[str, list[tuple[str, ...]]]:
    """Logical name → candidate mesh-axis tuples, in rule order (flax's rule semantics)."""
    out: dict[str, list[tuple[str, ...]]] = {}
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise LayoutError(f"a logical-axis rule is (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown:
            raise LayoutError(
                f"rule {rule!r} maps logical axis {name!r} to mesh axes {unknown} that do not exist; "
                f"mesh axes are {mesh.axis_names} (mesh={_mesh_str(mesh)})"
            )
        out.setdefault(name, []).append(axes)
    return out


def _mesh_str(mesh: AbstractMesh) -> str:
    return "{" + ", ".join(f"{n}: {s}" for n, s in zip(mesh.axis_names, mesh.axis_sizes)) + "}"


def _layout(path: str, leaf, rule_map, mesh: AbstractMesh, allow_replicate: bool) -> LeafLayout:
    if isinstance(leaf, nnx.Variable):
        logical = leaf.get_metadata().get("out_sharding")
        value = leaf.get_value()
    else:
        logical, value = None, leaf
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise LayoutError(
            f"leaf {path!r} is {type(value).__name__}, not an array; every leaf of a "
            f"state must be an array or ShapeDtypeStruct"
        )
    shape, dtype = tuple(value.shape), value.dtype
    if logical is None:
        return LeafLayout(path, shape, dtype, PartitionSpec())
    logical = tuple(logical)
    if len(logical) != len(shape):
        raise LayoutError(
            f"logical axes {logical} name {len(logical)} dims but the leaf has "
            f"{len(shape)}: " + where(path, shape, logical, _mesh_str(mesh))
        )
    entries, used = [], set()
    for name in logical:
        if name is None:
            entries.append(())
            continue
        if name not in rule_map:
            raise LayoutError(
                f"logical axis {name!r} has no rule (known: {sorted(rule_map)}): "
                + where(path, shape, logical, _mesh_str(mesh))
            )
        # flax semantics: the first candidate whose mesh axes are still unused by this leaf wins.
        choice = next((axes for axes in rule_map[name] if not used & set(axes)), ())
        used |= set(choice)
        entries.append(choice)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    entries, replicated = _fit(path, shape, entries, sizes, allow_replicate, mesh)
    spec = PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in entries))
    return LeafLayout(path, shape, dtype, spec, logical, replicated)


def _fit(path, shape, entries, sizes, allow_replicate, mesh):
    """Drop mesh axes (innermost first) from dims they do not divide, or refuse."""
    fitted, replicated = [], []
    for dim, entry in enumerate(entries):
        entry = list(entry)
        while entry and shape[dim] % math.prod(sizes[a] for a in entry):
            if not allow_replicate:
                spec = PartitionSpec(*(None if not e else tuple(e) for e in entries))
                raise LayoutError(
                    f"dim {dim} of size {shape[dim]} is sharded over mesh axes {tuple(entry)} of total size "
                    f"{math.prod(sizes[a] for a in entry)}, which does not divide it; pass "
                    f"allow_replicate=True to replicate it along those axes, or choose another config: "
                    + where(path, shape, spec, _mesh_str(mesh))
                )
            replicated.append((dim, entry.pop()))
        fitted.append(tuple(entry))
    return fitted, tuple(replicated)


def _spec_entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
