"""The parallelizable tensor collection (PTC): a train state's abstract layout.

A :class:`PTC` records every leaf's path, shape, dtype and ``PartitionSpec`` (a
:class:`LeafLayout`), the mesh and its devices in mesh order, and holds no arrays. It comes from
logical axis names and flax rules (``PTC.of``, resolved by ``tenplex_jax._src.rules``) or from the
shardings the leaves have (``PTC.from_shardings``), over any mesh. ``docs/concepts.md`` states the
contract.
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
from tenplex_jax._src.errors import LayoutError, LeafNotFoundError, PlanError, where
from tenplex_jax._src.mesh import (
    MESH_AXES,
    ParallelConfig,
    ids_and_hosts,
    resolve,
    show_ids,
    show_mesh,
)
from tenplex_jax._src.rules import Rules
from tenplex_jax._src.tree import dtype_name, flatten_state

__all__ = ["MESH_AXES", "PTC", "Box", "LeafLayout", "ParallelConfig", "Rules", "Shape"]

MeshLike = ParallelConfig | Mesh | AbstractMesh
Devices = Sequence[jax.Device | int]


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The layout of one leaf: path, shape, dtype, spec, and the axis names it came from.

    A :class:`PTC` holds one per leaf (``ptc.leaves``, ``ptc.leaf(path)``). Two layouts are equal
    when they lay the same leaf out the same way (path, shape, dtype, spec), however they were
    derived: ``logical``, ``replicated`` and ``direct`` are not compared.

    Attributes:
      path: the leaf's tree path, ``"/"``-separated (``"model/layers/0/w"``).
      shape: the leaf's global shape.
      dtype: its dtype (a NumPy dtype, or a JAX PRNG key dtype).
      spec: its ``PartitionSpec``, one entry per dim (None, a mesh axis, or a tuple of them).
      logical: the axis names the spec came from: logical names, or mesh axes with ``direct``;
        ``None`` for a leaf laid out by its sharding or without names (replicated).
      replicated: ``(dim, mesh axis)`` pairs dropped because the axis did not divide the dim
        (only with ``allow_replicate``).
      direct: ``logical`` names mesh axes (flax's ``nn.Partitioned``), used as they are.
    """

    path: str
    shape: Shape
    dtype: Any
    spec: PartitionSpec
    logical: tuple | None = dataclasses.field(default=None, compare=False)
    replicated: tuple[tuple[int, str], ...] = dataclasses.field(default=(), compare=False)
    direct: bool = dataclasses.field(default=False, compare=False)

    def __post_init__(self):
        # one spelling per layout: an entry per dim (None, an axis, or a tuple of axes)
        entries = logical_rules.spec_entries(self.spec, len(self.shape))
        if len(entries) == len(self.shape):
            object.__setattr__(self, "spec", logical_rules.as_spec(entries))

    @property
    def itemsize(self) -> int:
        """Bytes per element (a PRNG key's, for key dtypes)."""
        return self.dtype.itemsize if _is_key(self.dtype) else np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the whole leaf (not of one shard)."""
        return math.prod(self.shape) * self.itemsize


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class PTC:
    """Parallelizable tensor collection: the abstract layout of a whole train state.

    Every leaf's path, shape, dtype and ``PartitionSpec``, the mesh's config and its devices in
    mesh order (the *allocation*); no arrays, so PTCs are built, compared and planned between
    without touching device memory. Build one with :meth:`of` (logical axis names and rules) or
    :meth:`from_shardings` (the shardings the leaves have), a new layout of the same state with
    :meth:`relayout`; the constructor serves those and :meth:`from_json`.

    >>> from flax import linen as nn
    >>> w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "mlp"))
    >>> state = {"w": w, "step": jax.ShapeDtypeStruct((), jnp.int32)}
    >>> rules = (("embed", "fsdp"), ("mlp", "tensor"))
    >>> ptc = PTC.of(state, rules, ParallelConfig(fsdp=2, tensor=2), range(4))
    >>> ptc.leaf("w").spec, ptc.leaf("step").spec       # unnamed leaves are replicated
    (P('fsdp', 'tensor'), P())
    >>> ptc.boxes(ptc.leaf("w"))[3]                      # device 3: rows 4..7, columns 8..15
    ((4, 8), (8, 16))
    >>> ptc.relayout(ParallelConfig(data=2), range(4, 6)).device_ids
    (4, 5)

    Attributes:
      config: the mesh: axis names, sizes and types (a :class:`ParallelConfig`).
      device_ids: the mesh's device ids in row-major mesh order (``config.names``).
      hosts: the process index of each device, used to prefer same-host sources when planning.
      leaves: one :class:`LeafLayout` per leaf, in tree-flattening order.
      treedef: the state's tree structure (not compared: an ``nnx.State`` and the plain dict of an
        orbax target with the same leaves are the same layout).
      rules: the normalized logical-axis rules the specs came from, which :meth:`relayout` reuses;
        ``None`` for a PTC of shardings.
      allow_replicate: whether a dim its mesh axes do not divide was replicated along some of them
        rather than refused (kept for :meth:`relayout`).

    Raises:
      LayoutError: ``device_ids`` are not distinct or not ``config.num_devices`` many, or
        ``hosts`` does not have one entry per device.
    """

    config: ParallelConfig
    device_ids: tuple[int, ...]
    hosts: tuple[int, ...]
    leaves: tuple[LeafLayout, ...]
    treedef: Any = dataclasses.field(compare=False)
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

        Each leaf's logical names go through flax's ``logical_to_mesh_axes`` semantics; a leaf
        without names (step counters, RNG state) is replicated. See the class example.

        Args:
          state: an ``nnx.State`` (live or from ``nnx.eval_shape``), NNX graph nodes such as
            ``(model, optimizer)``, Flax Linen variables with ``nn.LogicallyPartitioned`` /
            ``nn.Partitioned`` boxes (and an optax state built from them), or any pytree of
            arrays / ``ShapeDtypeStruct``.
          rules: flax logical-axis rules, ``((logical name, mesh axes), ...)`` in precedence order.
          config: a ``ParallelConfig`` or ``AbstractMesh`` (both need ``devices``), or a concrete
            ``Mesh`` (it brings its own devices).
          devices: the mesh's devices in mesh order: ``jax.Device`` objects or bare ids.
          hosts: the process index of each device (default: each ``jax.Device``'s
            ``process_index``; 0 for bare ids).
          allow_replicate: replicate a dim along the mesh axes that do not divide it (innermost
            first) instead of refusing it; the dropped axes are in ``LeafLayout.replicated``.

        Returns:
          The state's PTC, which :meth:`relayout` can lay out anew with the same rules.

        Raises:
          LayoutError: a rule names an axis the mesh lacks, a dim does not divide by its mesh
            axes (without ``allow_replicate``), the devices do not fit the config, or a leaf
            already placed with a ``NamedSharding`` is not laid out as computed (for another
            layout of a placed state, :meth:`relayout`); the message names the leaf, its shape,
            both specs and the mesh.
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

        Such a PTC knows no rules: the target of a plan from it is another PTC (``from_shardings``
        of the target tree, or :meth:`of`), not its :meth:`relayout`.

        >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
        >>> sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        >>> PTC.from_shardings({"w": jax.device_put(jnp.zeros((8, 2)), sharding)}).leaf("w").spec
        P('data', None)

        Args:
          state: a pytree of ``jax.Array`` (the ground truth of what is on the devices) or of
            ``ShapeDtypeStruct`` with shardings (an orbax restore target); NNX variables and
            Linen boxes are unwrapped. With ``shardings``, a pytree of any array-likes.
          shardings: the shardings instead of the leaves' own: a tree shaped like the state, a
            prefix of it, or one sharding for all (what a ``jit``'s ``out_shardings`` may be).
          devices: the mesh's devices in mesh order (ids or ``jax.Device``), needed when the
            shardings are on an ``AbstractMesh``; a concrete mesh brings its own.
          hosts: the process index of each device (default: each device's ``process_index``).

        Returns:
          The PTC of the layout the leaves have, with ``rules=None``.

        Raises:
          LayoutError: a leaf has no ``NamedSharding``, the leaves are on different meshes, a
            spec does not fit its array, or the state has no leaves.
        """
        paths, leaves, treedef = flatten_state(state)
        values = [tree.value_and_check(path, leaf) for path, leaf in zip(paths, leaves)]
        if shardings is None:
            given = [getattr(value, "sharding", None) for value in values]
        else:
            given = tree.per_leaf(shardings, state, treedef, len(values))
        mesh = _one_mesh(paths, values, given)
        if isinstance(mesh, Mesh):
            config, devices = resolve(mesh, devices)
        else:
            config, devices = resolve(ParallelConfig.of(mesh), devices)
        layouts = [
            _sharded_layout(path, value, sharding, config)
            for path, value, sharding in zip(paths, values, given)
        ]
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
        """The same state laid out over another mesh, by the same rules: a plan's target.

        Pure, like :meth:`of` on an abstract state; see the class example.

        Args:
          config: a ``ParallelConfig``, ``AbstractMesh`` or ``Mesh``, as in :meth:`of`.
          devices: the new mesh's devices in mesh order (ids or ``jax.Device``); not with a
            ``Mesh``, which brings its own.
          hosts: the process index of each device (default: each device's ``process_index``).
          rules: other logical-axis rules (e.g. for a mesh with other axis names); default: this
            PTC's.
          allow_replicate: as in :meth:`of`; default: this PTC's.

        Returns:
          A PTC of the same leaves, tree and dtypes over the new mesh.

        Raises:
          LayoutError: this PTC knows no rules and none are given (a PTC of shardings), or the
            state cannot be laid out on the new mesh; the message shows the failing leaf's
            layout before and after.
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
            f"{sharding.spec} on {show_mesh(mesh, devices=False)} over devices "
            f"{on if len(on) <= 16 else f'{on[:16]}...'}, the rules give {leaf.spec} on "
            f"{self.config.describe()} over {show_ids(self.device_ids)}; for a new layout of this "
            f"state use ptc.relayout(config, devices), PTC.of on an abstract state "
            f"(jax.eval_shape), or PTC.from_shardings(state) for the layout it has: "
            + where(leaf.path, leaf.shape, leaf.spec, self.config.describe())
        )

    # -- records ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The PTC as a JSON-able record (what a checkpoint and a commit store beside the arrays).

        Returns:
          A dict of the config, device ids, hosts, rules and each leaf's path, shape, dtype, spec,
          axis names and replicated dims; not the tree structure, which :meth:`from_json` takes
          from a PTC of the same state.
        """
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
        """The PTC of a :meth:`to_json` record.

        Args:
          record: the dict :meth:`to_json` returned.
          like: a PTC of the same state (any layout): it supplies the tree structure and the
            dtypes, which a record cannot spell (PRNG key dtypes).

        Returns:
          The recorded layout of ``like``'s state.

        Raises:
          PlanError: the record's leaves (paths, shapes, dtypes) are not ``like``'s; the message
            names the first that differs.
        """
        got = [
            tree.Leaf(r["path"], tuple(r["shape"]), r["dtype"], _spec(r["spec"]))
            for r in record["leaves"]
        ]
        diff = tree.difference(got, like.leaves, ("the record", "the state asked for"))
        if diff:
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
                _spec(r["spec"]),
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
        """Bytes of the whole state, every leaf counted once (not per replica)."""
        return sum(leaf.nbytes for leaf in self.leaves)

    def leaf(self, path: str) -> LeafLayout:
        """The layout of one leaf.

        Args:
          path: the leaf's tree path, as in ``LeafLayout.path`` (``"model/layers/0/w"``).

        Returns:
          Its :class:`LeafLayout`.

        Raises:
          LeafNotFoundError: no leaf has that path (a ``KeyError`` too); the message lists the
            first few paths.
        """
        for leaf in self.leaves:
            if leaf.path == path:
                return leaf
        raise LeafNotFoundError(
            f"no leaf {path!r} in this PTC; leaves: {[item.path for item in self.leaves][:8]}...",
            path=path,
        )

    def intervals(self, leaf: LeafLayout) -> np.ndarray:
        """Each device's ``(start, stop)`` along each dim of a leaf, computed from the spec alone.

        Args:
          leaf: one of this PTC's :class:`LeafLayout`.

        Returns:
          int64 ``[dims, devices in mesh order, 2]``; a scalar gives ``[0, devices, 2]``.
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
        """The box of a leaf that each device holds.

        Equals ``NamedSharding(mesh, spec).devices_indices_map(shape)`` with slices as intervals;
        replicas share one box tuple. See the class example.

        Args:
          leaf: one of this PTC's :class:`LeafLayout`.

        Returns:
          Device id -> its box, ``((start, stop), ...)`` per dim (``tj.typing.Box``).
        """
        per_device = self.intervals(leaf).transpose(1, 0, 2).reshape(len(self.device_ids), -1)
        # replicas share a box: convert each distinct box once, and share the tuple (each row
        # seen as one opaque value, which sorts 6x faster than rows compared element-wise)
        if per_device.shape[1] == 0:  # a scalar: every device holds the whole of it
            return dict.fromkeys(self.device_ids, ())
        per_device = np.ascontiguousarray(per_device)
        rows = per_device.view(np.dtype((np.void, per_device.strides[0]))).ravel()
        distinct, which = np.unique(rows, return_inverse=True)
        distinct = distinct.view(per_device.dtype).reshape(len(distinct), per_device.shape[1])
        boxes = [tuple(zip(row[0::2], row[1::2])) for row in distinct.tolist()]
        return {dev: boxes[i] for dev, i in zip(self.device_ids, which.ravel().tolist())}

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The concrete ``Mesh`` of this PTC's config over its devices.

        Args:
          devices: where the PTC's device ids are looked up (default ``jax.devices()``).

        Returns:
          The mesh, its devices in this PTC's order, with the config's axis types.

        Raises:
          LayoutError: some of the PTC's devices are not among ``devices``; the message names
            them.
        """
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
        """The layout as shardings, for ``jit``'s ``out_shardings`` and ``jax.device_put``.

        Args:
          mesh: the mesh to shard over (default :meth:`mesh`).

        Returns:
          A tree shaped like the state with a ``NamedSharding`` at each leaf.

        Raises:
          LayoutError: without ``mesh``, as :meth:`mesh`.
        """
        mesh = self.mesh() if mesh is None else mesh
        return jax.tree_util.tree_unflatten(
            self.treedef, [NamedSharding(mesh, leaf.spec) for leaf in self.leaves]
        )

    def abstract(self, mesh: Mesh | None = None):
        """The state as abstract arrays with this layout: what orbax restores onto.

        Args:
          mesh: the mesh to shard over (default :meth:`mesh`).

        Returns:
          A tree shaped like the state with a sharded ``jax.ShapeDtypeStruct`` at each leaf.

        Raises:
          LayoutError: without ``mesh``, as :meth:`mesh`.
        """
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


def _spec(entries: list) -> PartitionSpec:
    """A spec as ``to_json`` records it: an axis, a list of axes or None per dim."""
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))


def _entries(spec: PartitionSpec, leaf: LeafLayout) -> list[tuple[str, ...]]:
    return logical_rules.spec_entries(spec, len(leaf.shape))


def _one_mesh(paths, values, shardings):
    """The one mesh every leaf's ``NamedSharding`` is on; ``LayoutError`` naming the leaf
    without one, or two leaves on different meshes, or a state without leaves."""
    mesh, first = None, None
    for path, value, sharding in zip(paths, values, shardings):
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
    return mesh


def _sharded_layout(path: str, value, sharding: NamedSharding, config) -> LeafLayout:
    """A leaf's layout as its sharding lays it out on ``config``'s mesh; ``LayoutError`` unless
    the spec names one mesh axis or None per dim and fits the array."""
    shape, shown, sizes = tuple(value.shape), config.describe(), config.shape
    entries = logical_rules.spec_entries(sharding.spec, len(shape))
    if len(entries) != len(shape) or any(a not in sizes for e in entries for a in e):
        raise LayoutError(
            f"a sharding's spec names one mesh axis or None per dim of its array, got "
            f"{sharding.spec} for {len(shape)} dims: " + where(path, shape, sharding.spec, shown)
        )
    spec, _ = logical_rules.fit(tuple(entries), sizes, path, shape, mesh=shown)
    return LeafLayout(path, shape, value.dtype, spec)
