"""Cluster descriptions: which devices a job may use, how fast they are, and what they cost.

A cluster is read from a TOML file (see ``meshes/``)::

    name = "8xH100"
    network_gbps = 50            # GB/s per device between nodes

    [types.h100]
    memory_gib = 80              # device memory
    tflops = 400                 # sustained training throughput, not the datasheet peak
    link_gbps = 450              # GB/s between devices of one node (NVLink)
    usd_per_hour = 4.0           # optional; needed for the throughput-per-dollar objective
    host_link_gbps = 25          # optional: GB/s each way between a device and host memory (PCIe)
    memory_gbps = 2000           # optional: GB/s of a copy within a device's memory (HBM)
    host_memory = false          # optional: the device's memory is host memory (CPU devices)

    [[nodes]]
    type = "h100"
    count = 8                    # devices of this node
    repeat = 1                   # optional: that many identical nodes

Optional cluster-wide fields, used by the reconfiguration simulator (``tenplex_jax.simulator``)::

    node_network_gbps = 400      # GB/s of one node's NICs together (default: its devices' sum)
    host_memory_gbps = 200       # GB/s of one node's host memory for copies (default: unlimited)
    storage_gbps = 5             # GB/s one node reads or writes remote checkpoint storage
    storage_total_gbps = 500     # GB/s of the storage system for all nodes together (default:
    unlimited)

Devices are numbered in file order, node after node. Units are plain SI in the dataclasses (bytes,
FLOP/s, bytes/s); the file uses GiB, TFLOP/s and GB/s because that is how datasheets speak.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib
from collections.abc import Mapping, Sequence

from tenplex_jax._src.errors import PlanError

GIB = 2**30
"""Bytes in a GiB: ``DeviceType.memory`` is in bytes, cluster files give ``memory_gib``."""
_TYPE_FIELDS = {
    "memory_gib",
    "tflops",
    "link_gbps",
    "usd_per_hour",
    "description",
    "host_link_gbps",
    "memory_gbps",
    "host_memory",
}
_CLUSTER_FIELDS = {
    "name",
    "description",
    "network_gbps",
    "types",
    "nodes",
    "node_network_gbps",
    "host_memory_gbps",
    "storage_gbps",
    "storage_total_gbps",
}


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator, in plain SI units (a cluster file's ``[types.NAME]`` table).

    >>> h100 = DeviceType("h100", memory=80 * GIB, flops=400e12, link_bandwidth=450e9)

    Attributes:
      name: the type's name (``"h100"``).
      memory: device memory, bytes.
      flops: sustained training FLOP/s (not the datasheet peak).
      link_bandwidth: bytes/s between devices of one node (NVLink).
      usd_per_hour: the price of one device (0: unknown; the cost objective needs it).
      host_bandwidth: bytes/s each way between the device and host memory (PCIe); for the
        simulator.
      memory_bandwidth: bytes/s of a copy within the device's memory (HBM); for the simulator.
      host_memory: the device's memory is the host's (a CPU device: its copies load the node's
        host memory).

    Raises:
      PlanError: a bandwidth, ``memory`` or ``flops`` is not positive, or the price is negative.
    """

    name: str
    memory: int
    flops: float
    link_bandwidth: float
    usd_per_hour: float = 0.0
    host_bandwidth: float = 25e9
    memory_bandwidth: float = 1e12
    host_memory: bool = False

    def __post_init__(self):
        for field in ("memory", "flops", "link_bandwidth", "host_bandwidth", "memory_bandwidth"):
            if not getattr(self, field) > 0:
                raise PlanError(
                    f"device type {self.name!r} needs {field} > 0, got {getattr(self, field)!r}"
                )
        if self.usd_per_hour < 0:
            raise PlanError(f"device type {self.name!r} has a negative price {self.usd_per_hour}")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The devices a job may use, in order, with their types and nodes (a cluster file).

    Devices are numbered in file order, node after node. Devices of one node talk at their
    type's ``link_bandwidth``, across nodes at ``network_bandwidth``. Usually read with
    :meth:`load` or made with :meth:`uniform`:

    >>> h100 = DeviceType("h100", memory=80 * GIB, flops=400e12, link_bandwidth=450e9)
    >>> cluster = Cluster.uniform(16, h100, per_node=8)
    >>> cluster.num_devices, cluster.counts(), str(cluster.take(4))
    (16, {'h100': 16}, '16xh100 (4xh100; 1 nodes)')

    Attributes:
      name: the cluster's name (a file's ``name``, else its stem).
      types: the device types.
      kinds: each device's type, an index into ``types``.
      nodes: each device's node id.
      network_bandwidth: bytes/s per device between nodes.
      node_network_bandwidth: bytes/s of one node's NICs together (None: the sum over its
        devices).
      host_memory_bandwidth: bytes/s of one node's host memory for copies (None: not a limit);
        for the simulator.
      storage_bandwidth: bytes/s one node reads or writes remote checkpoint storage; for the
        simulator.
      storage_total_bandwidth: bytes/s of the storage system for all nodes together (None: not
        a limit); for the simulator.

    Raises:
      PlanError: no devices, ``nodes`` and ``kinds`` of different lengths, a type index out of
        range, or a bandwidth that is not positive.
    """

    name: str
    types: tuple[DeviceType, ...]
    kinds: tuple[int, ...]
    nodes: tuple[int, ...]
    network_bandwidth: float
    node_network_bandwidth: float | None = None
    host_memory_bandwidth: float | None = None
    storage_bandwidth: float = 2e9
    storage_total_bandwidth: float | None = None

    def __post_init__(self):
        if not self.kinds:
            raise PlanError(f"cluster {self.name!r} has no devices")
        if len(self.nodes) != len(self.kinds):
            raise PlanError(f"cluster {self.name!r}: one node id per device is needed")
        if any(not 0 <= k < len(self.types) for k in self.kinds):
            raise PlanError(f"cluster {self.name!r} names a device type index out of range")
        for field, key in (
            ("network_bandwidth", "network_gbps"),
            ("node_network_bandwidth", "node_network_gbps"),
            ("host_memory_bandwidth", "host_memory_gbps"),
            ("storage_bandwidth", "storage_gbps"),
            ("storage_total_bandwidth", "storage_total_gbps"),
        ):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise PlanError(f"cluster {self.name!r} needs {key} > 0, got {value}")

    @property
    def num_devices(self) -> int:
        """Devices in the cluster."""
        return len(self.kinds)

    def device_type(self, device: int) -> DeviceType:
        """The type of one device.

        Args:
          device: a device index (file order).

        Returns:
          Its :class:`DeviceType`.
        """
        return self.types[self.kinds[device]]

    @property
    def usd_per_hour(self) -> float:
        """The price of every device together, $/hour."""
        return sum(self.types[k].usd_per_hour for k in self.kinds)

    def counts(self) -> dict[str, int]:
        """Device count per type name, in type order."""
        return {t.name: self.kinds.count(i) for i, t in enumerate(self.types) if i in self.kinds}

    def take(self, n: int) -> Cluster:
        """The first devices in file order: what a job that was given ``n`` devices holds.

        Args:
          n: how many, ``1 <= n <= num_devices``.

        Returns:
          The cluster of those devices (same name, types and bandwidths).

        Raises:
          PlanError: ``n`` is out of range.
        """
        if not 1 <= n <= self.num_devices:
            raise PlanError(
                f"cluster {self.name!r} has {self.num_devices} devices ({self.counts()}); cannot "
                f"take {n}"
            )
        return self.subset(range(n))

    def subset(self, devices: Sequence[int]) -> Cluster:
        """Some of the devices, as a cluster of their own.

        Args:
          devices: device indices, in the order the new cluster numbers them.

        Returns:
          The cluster of those devices (same name, types and bandwidths; they keep their
          nodes).
        """
        devices = list(devices)
        return dataclasses.replace(
            self,
            kinds=tuple(self.kinds[d] for d in devices),
            nodes=tuple(self.nodes[d] for d in devices),
        )

    @classmethod
    def uniform(
        cls, n: int, device: DeviceType, *, per_node: int = 8, network_bandwidth: float = 25e9
    ) -> Cluster:
        """A cluster of one device type (see the class example).

        Args:
          n: devices.
          device: their :class:`DeviceType`.
          per_node: devices per node (the last node may hold fewer).
          network_bandwidth: bytes/s per device between nodes.

        Returns:
          The cluster, named ``"<n>x<type name>"``.
        """
        return cls(
            f"{n}x{device.name}",
            (device,),
            (0,) * n,
            tuple(i // per_node for i in range(n)),
            network_bandwidth,
        )

    @classmethod
    def load(cls, path: str | pathlib.Path) -> Cluster:
        """Read a cluster description from a TOML file (``meshes/*.toml``).

        Args:
          path: the file: a ``[types.NAME]`` table per device type (``memory_gib``, ``tflops``,
            ``link_gbps``, optionally ``usd_per_hour``, ``host_link_gbps``, ``memory_gbps``,
            ``host_memory``), ``[[nodes]]`` entries (``type``, ``count``, ``repeat``), and
            cluster-wide ``name``, ``network_gbps``, ``node_network_gbps``,
            ``host_memory_gbps``, ``storage_gbps``, ``storage_total_gbps``.

        Returns:
          The cluster (named by the file's ``name``, else its stem).

        Raises:
          PlanError: the file cannot be read or parsed, or breaks a rule of :meth:`from_dict`.
        """
        path = pathlib.Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise PlanError(f"cannot read cluster description {str(path)!r}: {error}") from None
        return cls.from_dict(data, default_name=path.stem)

    @classmethod
    def from_dict(cls, data: Mapping, default_name: str = "cluster") -> Cluster:
        """A cluster from a parsed description, in the units of the file (GiB, TFLOP/s, GB/s).

        Args:
          data: the description, as :meth:`load` reads it from TOML.
          default_name: the name when ``data`` has none.

        Returns:
          The cluster, in SI units.

        Raises:
          PlanError: an unknown field, a device type lacking ``memory_gib``, ``tflops`` or
            ``link_gbps``, a node of an unknown type or with a bad count, or no devices.
        """
        name = str(data.get("name", default_name))
        unknown = set(data) - _CLUSTER_FIELDS
        if unknown:
            raise PlanError(
                f"cluster {name!r} has unknown fields {sorted(unknown)}; known: "
                f"{sorted(_CLUSTER_FIELDS)}"
            )
        types = _types_from(name, data.get("types"))
        kinds, nodes = _nodes_from(name, data.get("nodes", ()), [t.name for t in types])
        gbps = lambda key: None if key not in data else float(data[key]) * 1e9
        return cls(
            name=name,
            types=types,
            kinds=kinds,
            nodes=nodes,
            network_bandwidth=float(data.get("network_gbps", 25)) * 1e9,
            node_network_bandwidth=gbps("node_network_gbps"),
            host_memory_bandwidth=gbps("host_memory_gbps"),
            storage_bandwidth=float(data.get("storage_gbps", 2)) * 1e9,
            storage_total_bandwidth=gbps("storage_total_gbps"),
        )

    def __str__(self) -> str:
        parts = ", ".join(f"{n}x{t}" for t, n in self.counts().items())
        return f"{self.name} ({parts}; {len(set(self.nodes))} nodes)"


def _types_from(name: str, types_in) -> tuple[DeviceType, ...]:
    """The device types of a cluster description's ``[types.NAME]`` tables, in SI units."""
    if not isinstance(types_in, Mapping) or not types_in:
        raise PlanError(f"cluster {name!r}: a [types.NAME] table per device type is needed")
    types = []
    for type_name, spec in types_in.items():
        unknown = set(spec) - _TYPE_FIELDS
        if unknown:
            raise PlanError(
                f"cluster {name!r}: device type {type_name!r} has unknown fields "
                f"{sorted(unknown)}; known: {sorted(_TYPE_FIELDS)}"
            )
        missing = {"memory_gib", "tflops", "link_gbps"} - set(spec)
        if missing:
            raise PlanError(f"cluster {name!r}: device type {type_name!r} lacks {sorted(missing)}")
        types.append(
            DeviceType(
                name=type_name,
                memory=int(float(spec["memory_gib"]) * GIB),
                flops=float(spec["tflops"]) * 1e12,
                link_bandwidth=float(spec["link_gbps"]) * 1e9,
                usd_per_hour=float(spec.get("usd_per_hour", 0.0)),
                host_bandwidth=float(spec.get("host_link_gbps", 25)) * 1e9,
                memory_bandwidth=float(spec.get("memory_gbps", 1000)) * 1e9,
                host_memory=bool(spec.get("host_memory", False)),
            )
        )
    return tuple(types)


def _nodes_from(name: str, nodes_in, type_names: list[str]) -> tuple[tuple, tuple]:
    """(each device's type index, each device's node) from the ``[[nodes]]`` tables."""
    index = {type_name: i for i, type_name in enumerate(type_names)}
    kinds, nodes = [], []
    for number, node in enumerate(nodes_in):
        kind = node.get("type")
        if kind not in index:
            raise PlanError(
                f"cluster {name!r}: node {number} has unknown device type {kind!r}; the "
                f"[types] table defines {sorted(index)}"
            )
        count, repeat = node.get("count", 0), node.get("repeat", 1)
        if not (isinstance(count, int) and count >= 1 and isinstance(repeat, int) and repeat >= 1):
            raise PlanError(
                f"cluster {name!r}: node {number} needs integer count >= 1 and repeat >= 1, "
                f"got count={count!r}, repeat={repeat!r}"
            )
        for _ in range(repeat):
            node_id = (nodes[-1] + 1) if nodes else 0
            kinds += [index[kind]] * count
            nodes += [node_id] * count
    if not kinds:
        raise PlanError(f"cluster {name!r}: no [[nodes]] with devices")
    return tuple(kinds), tuple(nodes)
