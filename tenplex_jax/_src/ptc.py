"""The parallelizable tensor collection (PTC): a train state's abstract layout.

A PTC records, for every leaf of a train state (params, optimizer moments, step counters, RNG
state),
its tree path, shape, dtype and ``PartitionSpec`` (the *slicing* and *partitioning* of the Tenplex
paper), plus the mesh (a :class:`ParallelConfig`: axis names, sizes, types) and its device ids in
mesh order (the *allocation*). It holds no arrays, so two PTCs can be built, compared and planned
between without touching device memory. A PTC comes from whatever the job has:

- ``PTC.of(state, rules, mesh)``: logical axis names and flax logical-axis rules, resolved by flax's
  own semantics (``tenplex_jax._src.rules``). The names are those Flax NNX stores on each variable
  (``nnx.with_partitioning(init, ("embed", "mlp"))``) or a Linen box holds
  (``nn.with_logical_partitioning``; an ``nn.Partitioned`` box names mesh axes, used as they are).
  Optimizer moments carry their param's names, so they get its layout; leaves without names (step
  counters, RNG keys and counts) are replicated.
- ``PTC.from_shardings(state)``: the ``NamedSharding`` each leaf already has: a live state of any
  pytree of ``jax.Array`` (plain dicts, equinox-style modules, NNX state), or a tree of
  ``ShapeDtypeStruct`` with shardings (an orbax restore target); ``from_shardings(abstract, tree)``
  takes them from a separate tree of shardings (a ``jit``'s ``out_shardings``).

The mesh is any mesh: ``ParallelConfig(data=2, tensor=4)`` for the four default axes, or the user's
own ``Mesh`` / ``jax.make_mesh`` / ``AbstractMesh`` with any axis names, order and types. Source and
target of a plan may come from different kinds and meshes with different axis names.

Example::

    state = nnx.state((model, optimizer))
    rules = (("embed", "fsdp"), ("mlp", "tensor"), ("vocab", "tensor"))
    ptc = PTC.of(state, rules, ParallelConfig(data=2, tensor=4), jax.devices())
    ptc.leaf("0/w1").spec   # PartitionSpec(None, 'fsdp', 'tensor')
    new = ptc.relayout(ParallelConfig(fsdp=4), jax.devices()[4:])   # the same state, laid out anew
    mesh = jax.make_mesh((2, 2), ("replica", "model"), devices=jax.devices()[:4])
    other = ptc.relayout(mesh, rules=(("embed", "replica"), ("mlp", "model")))   # the user's mesh

**A PTC describes the state as it is.** Built from a live state whose arrays already carry
``NamedSharding``s, ``PTC.of`` checks that the computed layout is the one on the devices and names
the leaf and both specs and meshes when it is not (planning from a layout that is not there would
move the wrong bytes); a new layout of a placed state comes from ``ptc.relayout`` or an abstract
state.

**Uneven dims** are refused (``LayoutError`` naming the leaf, dim, axes and sizes) unless
``allow_replicate=True`` replicates them along some of their axes (see ``tenplex_jax._src.rules``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from tenplex_jax._src import box as boxes
from tenplex_jax._src import rules as logical_rules
from tenplex_jax._src import tree
from tenplex_jax._src.box import Box, Shape
from tenplex_jax._src.errors import LayoutError, PlanError, where
from tenplex_jax._src.mesh import (
    MESH_AXES,
    ParallelConfig,
    ids_and_hosts,
    resolve,
    show_ids,
    show_mesh,
)
from tenplex_jax._src.rules import Rules
from tenplex_jax._src.tree import flatten_state

__all__ = ["MESH_AXES", "PTC", "Box", "LeafLayout", "ParallelConfig", "Rules", "Shape"]

MeshLike = ParallelConfig | Mesh | AbstractMesh
Devices = Sequence[jax.Device | int]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The layout of one leaf: path, shape, dtype, spec, and the axis names it came from.

    ``logical`` holds the leaf's logical names (``None`` for a leaf laid out by its sharding, or
    without names); with ``direct``, they are mesh axes (flax's ``nn.Partitioned``), not logical.
    Two layouts are equal when they lay the same leaf out the same way (path, shape, dtype,
    spec), however they were derived.
    """

    path: str
    shape: Shape
    dtype: Any
    spec: PartitionSpec
    logical: tuple | None = dataclasses.field(default=None, compare=False)
    # (dim, mesh axis) dropped because indivisible
    replicated: tuple[tuple[int, str], ...] = dataclasses.field(default=(), compare=False)
    direct: bool = dataclasses.field(default=False, compare=False)

    def __post_init__(self):
        # one spelling per layout: an entry per dim (None, an axis, or a tuple of axes)
        entries = logical_rules.spec_entries(self.spec, len(self.shape))
        if len(entries) == len(self.shape):
            object.__setattr__(self, "spec", logical_rules.as_spec(entries))

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

    ``device_ids`` lists the mesh's devices in row-major mesh order (``config.names``); ``hosts``
    gives the process index of each, used to prefer same-host sources when planning.
    """

    config: ParallelConfig
    device_ids: tuple[int, ...]
    hosts: tuple[int, ...]
    leaves: tuple[LeafLayout, ...]
    treedef: Any = dataclasses.field(compare=False)
    # how the specs were derived, for relayout (None for a PTC of shardings or read without them)
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

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def of(
        cls,
        state,
        rules: Rules,
        config: MeshLike,
        devices: Devices | None = None,
        *,
        hosts: Sequence[int] | None = None,
        allow_replicate: bool = False,
    ) -> PTC:
        """The PTC of ``state`` laid out by logical-axis ``rules`` over a mesh.

        ``state`` is an ``nnx.State`` (live or from ``nnx.eval_shape``), NNX graph nodes such as
        ``(model, optimizer)``, Flax Linen variables with ``nn.LogicallyPartitioned`` /
        ``nn.Partitioned`` boxes (and an optax state built from them), or any pytree of arrays /
        ``ShapeDtypeStruct``. ``config`` is a ``ParallelConfig``, an ``AbstractMesh`` (both with
        ``devices``: ``jax.Device`` objects or bare ids, in mesh order) or a ``Mesh`` (its own
        devices). Arrays that already carry ``NamedSharding``s must be laid out as computed (else
        ``LayoutError`` names the leaf, both specs and both meshes): for another layout,
        ``relayout``.
        """
        config, devices = resolve(config, devices)
        paths, leaves, treedef = flatten_state(state)
        names = [tree.names_of(leaf) for leaf in leaves]
        values = [tree.value_and_check(path, leaf) for path, leaf in zip(paths, leaves)]
        ptc = cls._build(
            paths, names, values, treedef, rules, config, devices, hosts, allow_replicate
        )
        for leaf, value in zip(ptc.leaves, values):
            ptc._check_placed(leaf, value)
        return ptc

    @classmethod
    def from_shardings(
        cls,
        state,
        shardings=None,
        *,
        devices: Devices | None = None,
        hosts: Sequence[int] | None = None,
    ) -> PTC:
        """The PTC of ``state`` as its leaves are laid out: each one's own ``NamedSharding``.

        ``state`` is any pytree of ``jax.Array`` (the ground truth of what is on the devices) or
        of ``ShapeDtypeStruct`` with shardings (an orbax restore target); NNX variables and Linen
        boxes are unwrapped. ``shardings`` instead gives them as a tree shaped like the state, a
        prefix of it, or one sharding for all (a ``jit``'s ``out_shardings``), for a state of any
        array-likes. Every leaf must have a ``NamedSharding`` on one mesh; an ``AbstractMesh``
        needs ``devices`` (ids in mesh order). Such a PTC knows no rules: the target of a plan
        from it is another PTC (``from_shardings`` of the target tree, or ``PTC.of``).

        >>> state = jax.jit(init, out_shardings=shardings)()
        >>> src = PTC.from_shardings(state)
        >>> dst = PTC.from_shardings(orbax_target)   # ShapeDtypeStructs with the new shardings
        >>> state, _ = reshard(state, make_plan(src, dst))
        """
        paths, leaves, treedef = flatten_state(state)
        values = [tree.value_and_check(path, leaf) for path, leaf in zip(paths, leaves)]
        if shardings is None:
            given = [getattr(value, "sharding", None) for value in values]
        else:
            given = tree.per_leaf(shardings, state, treedef, len(values))
        mesh, first = None, None
        for path, value, sharding in zip(paths, values, given):
            if not isinstance(sharding, NamedSharding):
                raise LayoutError(
                    f"a PTC from shardings needs a NamedSharding at every leaf, but leaf {path!r} "
                    f"(shape={tuple(value.shape)}) has {sharding!r}: place it on the mesh with "
                    f"jax.device_put(x, NamedSharding(mesh, P())) (P() replicates it), or give "
                    f"shardings="
                )
            if mesh is None:
                mesh, first = sharding.mesh, path
            elif sharding.mesh != mesh:
                raise LayoutError(
                    f"a PTC lays every leaf out on one mesh, but leaf {first!r} is on "
                    f"{show_mesh(mesh)} and leaf {path!r} (shape={tuple(value.shape)}, "
                    f"spec={sharding.spec}) on {show_mesh(sharding.mesh)}"
                )
        if mesh is None:
            raise LayoutError("a PTC needs at least one leaf; the state has none")
        if isinstance(mesh, Mesh):
            config, devices = resolve(mesh, devices)
        else:
            config, devices = resolve(ParallelConfig.of(mesh), devices)
        shown, sizes = config.describe(), config.shape
        layouts = []
        for path, value, sharding in zip(paths, values, given):
            shape = tuple(value.shape)
            entries = logical_rules.spec_entries(sharding.spec, len(shape))
            if len(entries) != len(shape) or any(a not in sizes for e in entries for a in e):
                raise LayoutError(
                    f"a sharding's spec names one mesh axis or None per dim of its array, got "
                    f"{sharding.spec} for {len(shape)} dims: "
                    + where(path, shape, sharding.spec, shown)
                )
            spec, _ = logical_rules.fit(tuple(entries), sizes, path, shape, mesh=shown)
            layouts.append(LeafLayout(path, shape, value.dtype, spec))
        ids, hosts = ids_and_hosts(devices, hosts)
        return cls(config, ids, hosts, tuple(layouts), treedef)

    def relayout(
        self,
        config: MeshLike,
        devices: Devices | None = None,
        *,
        hosts: Sequence[int] | None = None,
        rules: Rules | None = None,
        allow_replicate: bool | None = None,
    ) -> PTC:
        """The same state laid out over ``config`` (a ``ParallelConfig``, ``AbstractMesh`` or
        ``Mesh``, as in :meth:`of`), by the same rules (or ``rules``, e.g. for a mesh with other
        axis names).

        Pure, like ``of`` on an abstract state: the target of a plan from this PTC.
        """
        rules = self.rules if rules is None else rules
        if rules is None:
            raise LayoutError(
                f"this PTC ({self.config} on {list(self.device_ids)}) knows no logical-axis rules "
                "(it was built from shardings, or read back from a record without them): pass "
                "rules=, or build the target PTC itself (PTC.from_shardings of the target tree)"
            )
        config, devices = resolve(config, devices)
        names = [(leaf.logical, leaf.direct) for leaf in self.leaves]
        values = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.leaves]
        replicate = self.allow_replicate if allow_replicate is None else allow_replicate
        return self._build(
            [leaf.path for leaf in self.leaves],
            names,
            values,
            self.treedef,
            rules,
            config,
            devices,
            hosts,
            replicate,
            source=self,
        )

    @classmethod
    def _build(
        cls, paths, names, values, treedef, rules, config, devices, hosts, replicate, source=None
    ):
        ids, hosts = ids_and_hosts(devices, hosts)
        sizes, mesh = config.shape, config.describe()
        used = [
            (p, tuple(v.shape), n)
            for p, (n, direct), v in zip(paths, names, values)
            if n is not None and not direct
        ]
        path = None  # the leaf being laid out, for the message of a relayout that fails
        try:
            rules = logical_rules.normalize(rules, config.names, mesh=mesh, leaves=used)
            layouts = []
            for path, (logical, direct), value in zip(paths, names, values):
                shape, dtype = tuple(value.shape), value.dtype
                if logical is None:
                    layouts.append(LeafLayout(path, shape, dtype, PartitionSpec()))
                    continue
                if len(logical) != len(shape):
                    raise LayoutError(
                        f"{'mesh' if direct else 'logical'} axes {logical} name {len(logical)} "
                        f"dims but the leaf has {len(shape)}: " + where(path, shape, logical, mesh)
                    )
                if direct:  # flax's nn.Partitioned: mesh axes already
                    spec, dropped = logical_rules.direct(
                        logical, sizes, path, shape, allow_replicate=replicate, mesh=mesh
                    )
                else:
                    spec, dropped = logical_rules.spec(
                        logical, rules, sizes, path, shape, allow_replicate=replicate, mesh=mesh
                    )
                layouts.append(LeafLayout(path, shape, dtype, spec, logical, dropped, direct))
        except LayoutError as error:
            if source is None:
                raise
            # a relayout: say where the leaf comes from, so both layouts are in the message
            failing = error.path or path
            leaf = next((item for item in source.leaves if item.path == failing), None)
            came = (
                f"; it is laid out as {leaf.spec} on {source.config.describe()} now"
                if leaf is not None
                else ""
            )
            raise LayoutError(
                f"relayout from {source.config} on {show_ids(source.device_ids)}: {error}{came}"
            ) from None
        return cls(config, ids, hosts, tuple(layouts), treedef, rules, replicate)

    def _check_placed(self, leaf: LeafLayout, value) -> None:
        """A value placed with a ``NamedSharding`` must hold the boxes this PTC gives it."""
        # only arrays on devices: an abstract value's sharding (jax.eval_shape of a sharded
        # init) describes no bytes, and is what a new layout is computed from
        sharding = value.sharding if isinstance(value, jax.Array) else None
        if not isinstance(sharding, NamedSharding):
            return  # host data, a single device, or an abstract value: not laid out yet
        mesh = sharding.mesh
        if (
            mesh.axis_names == self.config.names
            and tuple(mesh.axis_sizes) == self.config.sizes
            and tuple(d.id for d in mesh.devices.flat) == self.device_ids
            and _entries(sharding.spec, leaf) == _entries(leaf.spec, leaf)
        ):
            return
        have = {
            d.id: boxes.of_index(index, leaf.shape)
            for d, index in sharding.devices_indices_map(leaf.shape).items()
        }
        if have == self.boxes(leaf):
            return  # the same boxes on the same devices, written another way
        on = sorted(have)
        raise LayoutError(
            f"a PTC of a placed state must describe the layout it has: the array is placed as "
            f"{sharding.spec} on mesh {dict(mesh.shape)} over devices "
            f"{on if len(on) <= 16 else f'{on[:16]}...'}, the rules give {leaf.spec} on "
            f"{self.config.describe()} over {show_ids(self.device_ids)}; for a new layout of this "
            f"state use ptc.relayout(config, devices), PTC.of on an abstract state "
            f"(jax.eval_shape), or PTC.from_shardings(state) for the layout it has: "
            + where(leaf.path, leaf.shape, leaf.spec, self.config.describe())
        )

    # -- records ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The PTC as JSON: config, devices, hosts, rules and each leaf's path, shape, dtype, spec,
        axis names and replicated dims (not the tree structure: ``from_json`` takes it from a
        PTC)."""
        rules = self.rules
        if rules is not None:
            rules = [[name, list(a) if isinstance(a, tuple) else a] for name, a in rules]
        return {
            "config": self.config.to_json(),
            "device_ids": [int(d) for d in self.device_ids],
            "hosts": [int(h) for h in self.hosts],
            "rules": rules,
            "allow_replicate": self.allow_replicate,
            "leaves": [
                {
                    "path": leaf.path,
                    "shape": list(leaf.shape),
                    "dtype": dtype_name(leaf.dtype),
                    "spec": [list(e) if isinstance(e, tuple) else e for e in leaf.spec],
                    "logical": None if leaf.logical is None else _json_names(leaf.logical),
                    "replicated": [[dim, axis] for dim, axis in leaf.replicated],
                    "direct": leaf.direct,
                }
                for leaf in self.leaves
            ],
        }

    @classmethod
    def from_json(cls, record: dict, like: PTC) -> PTC:
        """The PTC of ``to_json``'s record, with ``like``'s tree structure; ``PlanError`` unless
        the record's leaves (paths, shapes, dtypes) are ``like``'s."""
        got = [(r["path"], tuple(r["shape"]), r["dtype"]) for r in record["leaves"]]
        want = [(leaf.path, leaf.shape, dtype_name(leaf.dtype)) for leaf in like.leaves]
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
                None if r.get("logical") is None else _names(r["logical"]),
                tuple((int(dim), axis) for dim, axis in r.get("replicated", ())),
                bool(r.get("direct", False)),
            )
            for r, same in zip(record["leaves"], like.leaves)
        )
        rules = record.get("rules")
        if rules is not None:
            rules = tuple((n, tuple(a) if isinstance(a, list) else a) for n, a in rules)
        return cls(
            ParallelConfig.from_json(record["config"]),
            tuple(record["device_ids"]),
            tuple(record["hosts"]),
            leaves,
            like.treedef,
            rules,
            bool(record.get("allow_replicate", False)),
        )

    # -- reading it ---------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def leaf(self, path: str) -> LeafLayout:
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise KeyError(
            f"no leaf {path!r} in this PTC; leaves: {[item.path for item in self.leaves][:8]}..."
        )

    def intervals(self, leaf: LeafLayout) -> np.ndarray:
        """[dims, devices in mesh order, 2]: each device's (start, stop) along each dim of ``leaf``.

        Computed from the spec alone; a scalar gives shape ``[0, devices, 2]``.
        """
        names, sizes = self.config.names, self.config.shape
        coords = np.indices(self.config.sizes).reshape(len(names), -1).T  # [device, axes]
        per_dim = []
        for dim, entry in enumerate(logical_rules.spec_entries(leaf.spec, len(leaf.shape))):
            index = np.zeros(len(coords), dtype=np.int64)
            count = 1
            for axis in entry:  # major to minor
                index = index * sizes[axis] + coords[:, names.index(axis)]
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
        """The concrete mesh; devices are looked up by id among ``devices`` (default
        ``jax.devices()``). ``LayoutError`` names the devices this process does not have."""
        by_id = {d.id: d for d in (jax.devices() if devices is None else devices)}
        missing = [i for i in self.device_ids if i not in by_id]
        if missing:
            raise LayoutError(
                f"a mesh is built from devices this process has, but the PTC for "
                f"{self.config.describe()} over {show_ids(self.device_ids)} names devices "
                f"{missing} "
                f"that it does not have (it has {show_ids(sorted(by_id))})"
            )
        return self.config.make_mesh([by_id[i] for i in self.device_ids])

    def shardings(self, mesh: Mesh | None = None):
        """A tree shaped like the state with a ``NamedSharding`` at each leaf (for jit and
        device_put)."""
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


def _json_names(names: tuple) -> list:
    return [list(n) if isinstance(n, tuple) else n for n in names]


def _names(names: list) -> tuple:
    return tuple(tuple(n) if isinstance(n, list) else n for n in names)


def dtype_name(dtype) -> str:
    """A dtype's name: numpy's for array dtypes, JAX's (``key<fry>``) for PRNG keys."""
    return str(dtype) if _is_key(dtype) else np.dtype(dtype).name


def _entries(spec: PartitionSpec, leaf: LeafLayout) -> list[tuple[str, ...]]:
    return logical_rules.spec_entries(spec, len(leaf.shape))
