"""``ParallelConfig``: the shape of a mesh (axis names, sizes, axis types), without devices.

A parallel configuration is what ``jax.sharding.AbstractMesh`` describes: the mesh axes, outermost
first, their sizes and their ``AxisType``. Together with the device ids in mesh order (a PTC's
*allocation*) it makes the concrete ``Mesh``. Two ways to write one:

- ``ParallelConfig(data=2, tensor=4)``: the four default axes ``pipe, data, fsdp, tensor`` (in that
  order, outermost first, so tensor-parallel groups are neighbouring devices), each of size 1
  unless given, all ``AxisType.Auto`` (what Flax NNX layers need);
- ``ParallelConfig.of(mesh)``: any mesh the job already has, as it is: a ``jax.make_mesh`` (Explicit
  axes by default in this JAX), a ``Mesh(devices, names, axis_types=...)``, an ``AbstractMesh``, or
  a mapping ``{"data": 2, "stage": 4, "fsdp": 4, "expert": 2, "tensor": 2}`` in mesh order (Auto
  axes unless ``axis_types=`` says otherwise).

>>> ParallelConfig(data=2, tensor=4).shape
{'pipe': 1, 'data': 2, 'fsdp': 1, 'tensor': 4}
>>> ParallelConfig.of({"data": 2, "expert": 4}).size("tensor")   # an absent axis has size 1
1

The sizes of the default axes read as attributes (``config.data``, ``config.pipe``, 1 when the mesh
lacks the axis), so code written for the default names (the planner, batch layouts) runs on any
mesh that has them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from tenplex_jax._src.errors import LayoutError

__all__ = ["MESH_AXES", "ParallelConfig", "resolve"]

# The default axes, outermost first: tensor-parallel groups are neighbouring devices, pipeline
# stages the farthest apart, as on real clusters where neighbours share the fastest links.
MESH_AXES = ("pipe", "data", "fsdp", "tensor")
_AUTO = (AxisType.Auto,) * len(MESH_AXES)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class ParallelConfig:
    """A parallel configuration: mesh axis names and sizes in mesh order, and their types.

    What a ``jax.sharding.AbstractMesh`` describes, without devices: a PTC adds the devices in
    mesh order. The constructor gives the default four-axis mesh ``(pipe, data, fsdp, tensor)``,
    outermost first, every axis ``AxisType.Auto`` (what Flax NNX layers need); any other mesh
    comes from :meth:`of` or :meth:`parse`. Any axis may have size 1.

    >>> ParallelConfig(data=2, tensor=4).shape
    {'pipe': 1, 'data': 2, 'fsdp': 1, 'tensor': 4}
    >>> ParallelConfig.parse("data=2,expert=4")
    ParallelConfig.of({'data': 2, 'expert': 4}, axis_types=AxisType.Auto)

    Args:
      data: the ``data`` axis size (data parallelism: replicas of the state).
      fsdp: the ``fsdp`` axis size (the state sharded, the batch split too).
      tensor: the ``tensor`` axis size (tensor parallelism; innermost: neighbouring devices).
      pipe: the ``pipe`` axis size (pipeline stages; outermost).

    Attributes:
      names: the axis names in mesh order.
      sizes: the axis sizes in mesh order.
      axis_types: each axis's ``jax.sharding.AxisType``.

    Raises:
      LayoutError: a size is not an integer >= 1.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    axis_types: tuple[AxisType, ...]

    def __init__(self, data: int = 1, fsdp: int = 1, tensor: int = 1, pipe: int = 1):
        self._set(MESH_AXES, (pipe, data, fsdp, tensor), _AUTO)

    def _set(self, names, sizes, types) -> None:
        names, sizes, types = tuple(names), tuple(sizes), tuple(types)
        shown = dict(zip(names, sizes))
        for name, size in zip(names, sizes):
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                raise LayoutError(
                    f"mesh axis sizes must be integers >= 1, got {name}={size!r} in mesh {shown}"
                )
        if not names or not all(isinstance(n, str) and n for n in names):
            raise LayoutError(f"mesh axes are named by non-empty strings, got {names!r}")
        if len(set(names)) != len(names) or len(sizes) != len(names) != len(types):
            raise LayoutError(
                f"a mesh names each axis once, with one size and one axis type each; got names "
                f"{names}, sizes {sizes}, axis types {types}"
            )
        if not all(isinstance(t, AxisType) for t in types):
            raise LayoutError(f"axis types are jax.sharding.AxisType values, got {types!r}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        object.__setattr__(self, "axis_types", types)

    @classmethod
    def of(
        cls,
        mesh: Mesh | AbstractMesh | Mapping[str, int] | ParallelConfig,
        *,
        axis_types: Sequence[AxisType] | AxisType | None = None,
    ) -> ParallelConfig:
        """The config of a mesh: its axis names, sizes and types, in its order.

        >>> ParallelConfig.of({"data": 2, "expert": 4}).size("tensor")   # absent axes have size 1
        1

        Args:
          mesh: a ``Mesh`` or ``AbstractMesh`` (its axis types as it has them), a
            ``{name: size}`` mapping in mesh order, or a ``ParallelConfig`` (returned as it is
            unless ``axis_types`` is given).
          axis_types: one ``AxisType`` for every axis or one per axis, replacing the mesh's
            (default: the mesh's own; ``AxisType.Auto`` for a mapping).

        Returns:
          The mesh's config.

        Raises:
          LayoutError: ``mesh`` is none of these, or its names, sizes or types break the rules
            (non-empty distinct names, integer sizes >= 1, one type per axis).
        """
        if isinstance(mesh, ParallelConfig) and axis_types is None:
            return mesh
        if isinstance(mesh, (Mesh, AbstractMesh)):
            names, sizes = mesh.axis_names, tuple(mesh.axis_sizes)
            types = mesh.axis_types if axis_types is None else axis_types
        elif isinstance(mesh, ParallelConfig):
            names, sizes, types = mesh.names, mesh.sizes, axis_types
        elif isinstance(mesh, Mapping):
            names, sizes = tuple(mesh), tuple(mesh.values())
            types = AxisType.Auto if axis_types is None else axis_types
        else:
            raise LayoutError(
                f"a parallel config comes from a Mesh, an AbstractMesh or a {{axis: size}} "
                f"mapping, got {type(mesh).__name__} {mesh!r}"
            )
        if isinstance(types, AxisType):
            types = (types,) * len(names)
        config = object.__new__(cls)
        config._set(names, sizes, types)
        return config

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """The config a command line writes: ``"data=2,tensor=4"``.

        >>> ParallelConfig.parse("data=2,tensor=4")         # only default axes: the default mesh
        ParallelConfig(data=2, fsdp=1, tensor=4, pipe=1)
        >>> ParallelConfig.parse("data=2,expert=4").names   # else exactly the axes written
        ('data', 'expert')

        Args:
          text: ``"axis=size,..."`` (commas or spaces between), each axis once, or ``"single"``
            for one device.

        Returns:
          ``ParallelConfig(**sizes)`` when every axis is one of the four defaults, else
          ``ParallelConfig.of(sizes)`` in the order written (``AxisType.Auto``).

        Raises:
          LayoutError: the text is not of that form.
        """
        if text.strip() == "single":
            return cls()
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
            name, _, value = part.partition("=")
            if not name.isidentifier() or not value.isdigit() or name in sizes:
                raise LayoutError(
                    f"a parallel config is 'axis=size,...' (each axis once; the default axes "
                    f"are {MESH_AXES}), got {text!r}"
                )
            sizes[name] = int(value)
        if not sizes:
            raise LayoutError(f"a parallel config is 'axis=size,...', got {text!r}")
        if set(sizes) <= set(MESH_AXES):
            return cls(**sizes)
        return cls.of(sizes)

    # -- reading it ---------------------------------------------------------------------------

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes in mesh order."""
        return dict(zip(self.names, self.sizes))

    def size(self, axis: str) -> int:
        """The size of one axis.

        Args:
          axis: a mesh axis name.

        Returns:
          Its size; 1 when the mesh has no such axis.
        """
        return self.shape.get(axis, 1)

    data = property(lambda self: self.size("data"), doc="size of the ``data`` axis (1 if none)")
    fsdp = property(lambda self: self.size("fsdp"), doc="size of the ``fsdp`` axis (1 if none)")
    tensor = property(
        lambda self: self.size("tensor"), doc="size of the ``tensor`` axis (1 if none)"
    )
    pipe = property(lambda self: self.size("pipe"), doc="size of the ``pipe`` axis (1 if none)")

    @property
    def num_devices(self) -> int:
        """Devices the mesh needs: the product of the axis sizes."""
        return math.prod(self.sizes)

    @property
    def is_default(self) -> bool:
        """Whether this is ``ParallelConfig(...)``'s four-axis mesh (names, order, Auto types)."""
        return self.names == MESH_AXES and self.axis_types == _AUTO

    def abstract_mesh(self) -> AbstractMesh:
        """The ``AbstractMesh`` of this config: its axes, sizes and types, no devices."""
        return AbstractMesh(self.sizes, self.names, axis_types=self.axis_types)

    def make_mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """The concrete mesh of this config over some devices.

        Args:
          devices: ``num_devices`` devices in row-major mesh order.

        Returns:
          A ``Mesh`` with this config's axis names and types.

        Raises:
          LayoutError: ``devices`` has not ``num_devices`` entries.
        """
        if len(devices) != self.num_devices:
            raise LayoutError(f"config {self} needs {self.num_devices} devices, got {len(devices)}")
        grid = np.array(list(devices), dtype=object).reshape(self.sizes)
        return Mesh(grid, self.names, axis_types=self.axis_types)

    # -- records ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The config as a JSON-able record: ``{"axes": [[name, size], ...], "axis_types": [...]}``
        (type names, ``"Auto"``, ``"Explicit"``, ...)."""
        return {
            "axes": [[name, size] for name, size in zip(self.names, self.sizes)],
            "axis_types": [t.name for t in self.axis_types],
        }

    @classmethod
    def from_json(cls, record: Mapping) -> ParallelConfig:
        """The config of a :meth:`to_json` record.

        Args:
          record: what :meth:`to_json` returned, or the older ``{"data": 2, "fsdp": 1, ...}``
            form of the default mesh.

        Returns:
          The recorded config.

        Raises:
          LayoutError: the sizes break the rules of :meth:`of`. A record of neither form raises
            what reading it raises (``KeyError``, ``TypeError``): records are written by
            :meth:`to_json`, not by hand.
        """
        if "axes" not in record:
            return cls(**record)
        types = tuple(AxisType[name] for name in record["axis_types"])
        return cls.of({name: int(size) for name, size in record["axes"]}, axis_types=types)

    def __str__(self) -> str:
        """The axes larger than 1 (``data=2,expert=4``, or ``single``), and the axis types
        unless all Auto; :meth:`describe` names every axis."""
        text = ",".join(f"{a}={s}" for a, s in self.shape.items() if s > 1) or "single"
        auto = all(t == AxisType.Auto for t in self.axis_types)
        return text if auto else f"{text} [{_types(self.axis_types)}]"

    def __repr__(self) -> str:
        if self.is_default:
            return (
                "ParallelConfig("
                + ", ".join(f"{a}={self.size(a)}" for a in ("data", "fsdp", "tensor", "pipe"))
                + ")"
            )
        types = {t.name for t in self.axis_types}
        shown = (
            f"AxisType.{types.pop()}"
            if len(types) == 1
            else "(" + ", ".join(f"AxisType.{t.name}" for t in self.axis_types) + ")"
        )
        return f"ParallelConfig.of({self.shape}, axis_types={shown})"

    def describe(self) -> str:
        """``Mesh('data': 2, 'tensor': 4; Auto)``: every axis, its size and its type, as error
        messages show a mesh (:func:`show_axes`)."""
        return show_axes(self.names, self.sizes, self.axis_types)


def _types(types: tuple[AxisType, ...]) -> str:
    names = {t.name for t in types}
    return names.pop() if len(names) == 1 else "/".join(t.name for t in types)


# -- a mesh and its devices, as PTCs take them -----------------------------------------------


def resolve(
    config: ParallelConfig | Mesh | AbstractMesh, devices: Sequence | None
) -> tuple[ParallelConfig, list]:
    """(config, devices in mesh order) of a ParallelConfig or AbstractMesh with devices, or of a
    Mesh (its own devices)."""
    if isinstance(config, Mesh):
        own = list(config.devices.flat)
        if devices is not None and [device_id(d) for d in devices] != [d.id for d in own]:
            raise LayoutError(
                f"a Mesh brings its own devices: {show_mesh(config)} was given devices "
                f"{show_ids([device_id(d) for d in devices])}"
            )
        return ParallelConfig.of(config), own
    if not isinstance(config, (ParallelConfig, AbstractMesh)):
        raise LayoutError(
            f"a PTC is laid out over a ParallelConfig, an AbstractMesh or a Mesh, got "
            f"{type(config).__name__} {config!r}"
        )
    config = ParallelConfig.of(config)
    if devices is None:
        raise LayoutError(
            f"a PTC over {config.describe()} needs its devices (jax.Device objects or ids, in "
            f"mesh order); a concrete Mesh brings its own"
        )
    return config, list(devices)


def ids_and_hosts(devices, hosts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if len(devices) == 0:
        raise LayoutError("a PTC needs at least one device, got none")
    ids = tuple(device_id(d) for d in devices)
    if hosts is None:
        hosts = tuple(0 if isinstance(d, (int, np.integer)) else d.process_index for d in devices)
    return ids, tuple(int(h) for h in hosts)


def device_id(device) -> int:
    return int(device) if isinstance(device, (int, np.integer)) else device.id


def show_ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"devices {ids[0]}..{ids[-1]}"
    return f"devices {ids if len(ids) <= 16 else f'{ids[:16]}...'}"


def show_axes(
    names: Sequence[str], sizes: Sequence[int], types: Sequence[AxisType], *, kind: str = "Mesh"
) -> str:
    """The one way a message shows a mesh: ``Mesh('data': 2, 'tensor': 4; Explicit)``, its axes
    written as JAX writes them, then their ``AxisType``: once when every axis has it, else per
    axis (``Mesh('data': 2 Explicit, 'tensor': 4 Auto)``)."""
    kinds = [getattr(t, "name", str(t)) for t in types]
    if len(set(kinds)) == 1:
        axes = ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes))
        return f"{kind}({axes}; {kinds[0]})"
    return f"{kind}(" + ", ".join(f"{n!r}: {s} {t}" for n, s, t in zip(names, sizes, kinds)) + ")"


def show_mesh(mesh, *, devices: bool = True) -> str:
    """A ``Mesh`` (with its devices unless ``devices=False``), an ``AbstractMesh`` or a
    ``ParallelConfig``, for a message (:func:`show_axes`)."""
    if isinstance(mesh, ParallelConfig):
        return mesh.describe()
    kind = "Mesh" if isinstance(mesh, Mesh) else type(mesh).__name__
    text = show_axes(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, kind=kind)
    if devices and isinstance(mesh, Mesh):
        return f"{text} over {show_ids([d.id for d in mesh.devices.flat])}"
    return text
