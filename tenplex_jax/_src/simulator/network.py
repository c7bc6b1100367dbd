"""The network model: how long a reconfiguration's bytes take on a described cluster.

Each piece of a plan loads the resources on its route by its size; the time is the busiest
resource's bytes over its bandwidth (the bottleneck bound), plus the fixed costs :class:`Network`
is given (``docs/simulator.md`` has the table of resources). A route is a function returning a
:class:`Traffic`: :func:`device_traffic` (as ``tj.reshard`` runs a plan), :func:`store_traffic`
(a new generation pulls from the tensor stores), :func:`commit_traffic`, :func:`save_traffic`
and :func:`restore_traffic` (an orbax save and restore). Pure: it reads plans, PTCs and the
cluster, never device memory.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src.plan import Plan
from tenplex_jax._src.planner.cluster import Cluster
from tenplex_jax._src.ptc import PTC

DEVICE_RESOURCES = ("copy", "link_out", "link_in", "nic_out", "nic_in", "h2d", "d2h")
NODE_RESOURCES = (
    "node_out",
    "node_in",
    "host_memory",
    "storage_read",
    "storage_write",
    "store_get",
    "store_put",
)


@dataclasses.dataclass
class Traffic:
    """Bytes per resource of one transfer, made by the route functions (:func:`device_traffic`,
    ...); :meth:`Network.seconds` turns one into seconds.

    Attributes:
      device: resource (``DEVICE_RESOURCES``) -> float ``[devices]`` bytes, by cluster device id.
      node: resource (``NODE_RESOURCES``) -> float ``[nodes]`` bytes.
      pieces: int ``[devices]``: the copies each device receives (for a per-piece cost).
      lost: ``(leaf path, box)`` of what no live store holds (a pull that cannot happen).
      messages: int ``[nodes]``: the requests or messages each node's process issues (for a
        per-message latency); None: none counted.
      shards: int ``[devices]``: the new shards built on each device.
      leaves: int ``[nodes]``: the leaves each node's process rebuilds (one with a new shard there).
      runs: int ``[devices]``: the contiguous runs each device's pieces are copied as, read or
        written, whichever is more (counted on CPU devices only, where they cost).
    """

    device: dict[str, np.ndarray]
    node: dict[str, np.ndarray]
    pieces: np.ndarray
    lost: list[tuple[str, boxes.Box]] = dataclasses.field(default_factory=list)
    messages: np.ndarray | None = None
    shards: np.ndarray | None = None
    leaves: np.ndarray | None = None
    runs: np.ndarray | None = None

    def __post_init__(self):
        n, m = len(self.pieces), len(next(iter(self.node.values())))
        for name, size in (("shards", n), ("leaves", m), ("runs", n)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(size, dtype=np.int64))

    @classmethod
    def empty(cls, cluster: Cluster) -> Traffic:
        """No traffic on ``cluster`` (a ``tj.planner.Cluster``): zeros for every resource."""
        n, m = cluster.num_devices, max(cluster.nodes) + 1
        return cls(
            device={r: np.zeros(n) for r in DEVICE_RESOURCES},
            node={r: np.zeros(m) for r in NODE_RESOURCES},
            pieces=np.zeros(n, dtype=np.int64),
            messages=np.zeros(m, dtype=np.int64),
        )

    @property
    def network_bytes(self) -> float:
        """Bytes that cross between nodes (what leaves the nodes' NICs)."""
        return float(self.node["node_out"].sum())


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds of a transfer, what :meth:`Network.seconds` returns (``str(estimate)`` is
    ``"1.234 s (nic_in device 5)"``).

    Attributes:
      seconds: the busiest resource's bytes over its bandwidth, plus ``latency``, ``host_work``.
      bottleneck: ``"<resource> <device|node> <id>"`` of that resource (``"none"``: no traffic).
      resources: resource -> the seconds of its busiest device or node.
      latency: the busiest node's requests in sequence (``latency_seconds`` each), in seconds.
      host_work: the busiest CPU node's host work in seconds, which adds to its copies' time (an
        accelerator node's overlaps them: the ``host_work`` resource).
    """

    seconds: float
    bottleneck: str
    resources: Mapping[str, float]
    latency: float = 0.0
    host_work: float = 0.0

    def __str__(self) -> str:
        return f"{self.seconds:.3f} s ({self.bottleneck})"


@dataclasses.dataclass(frozen=True)
class Network:
    """A cluster's bandwidths, and the seconds a :class:`Traffic` takes on them.

    >>> h100 = tj.planner.DeviceType("h100", 80 * 2**30, flops=400e12, link_bandwidth=450e9)
    >>> network = Network(tj.planner.Cluster.uniform(16, h100, network_bandwidth=25e9))
    >>> traffic = Traffic.empty(network.cluster)
    >>> traffic.device["nic_in"][8] = 50e9                  # 50 GB into device 8 over its NIC
    >>> str(network.seconds(traffic))
    '2.000 s (nic_in device 8)'

    Attributes:
      cluster: the :class:`tenplex_jax.planner.Cluster` and its bandwidths.
      piece_seconds: host work per piece a node's devices receive (a slice, a kernel launch,
        a buffer). A node's process does its host work in sequence: on CPU devices it adds to
        the copies' time (the same cores copy), on accelerators it overlaps them (a resource,
        ``host_work``).
      shard_seconds: host work per new shard a node builds (a device buffer assembled).
      leaf_seconds: host work per leaf a node's process rebuilds (an array put together).
      run_seconds: host work per contiguous run a piece is copied as, on CPU devices only
        (an accelerator copies a strided box at its bandwidth).
      latency_seconds: a round trip per request or message a node's process issues (a store
        get or put, a storage read or write, a send across nodes), paid in sequence on top of
        the bytes' time (the busiest node's requests).
      store_get_bandwidth: bytes per second one node's store serves (None: not a limit).
      store_put_bandwidth: bytes per second one node's store takes in (None: not a limit).
    """

    cluster: Cluster
    piece_seconds: float = 0.0
    latency_seconds: float = 0.0
    shard_seconds: float = 0.0
    leaf_seconds: float = 0.0
    run_seconds: float = 0.0
    store_get_bandwidth: float | None = None
    store_put_bandwidth: float | None = None

    def __post_init__(self):
        c, put = self.cluster, lambda name, value: object.__setattr__(self, name, value)
        node_of = np.asarray(c.nodes)
        types = [c.device_type(d) for d in range(c.num_devices)]
        per_node, nic = np.bincount(node_of), c.node_network_bandwidth or None
        put("_node_of", node_of)
        put("_host_memory", np.array([t.host_memory for t in types]))
        put("_cpu_node", np.bincount(node_of, self._host_memory, minlength=len(per_node)) > 0)
        link, host, copy = (
            np.array([getattr(t, f) for t in types])
            for f in ("link_bandwidth", "host_bandwidth", "memory_bandwidth")
        )
        nics, m = np.full(c.num_devices, c.network_bandwidth), len(per_node)
        bw = {"copy": copy, "link_out": link, "link_in": link, "nic_out": nics, "nic_in": nics}
        put("_device_bw", bw | {"h2d": host, "d2h": host})
        nic = np.full(m, nic) if nic else per_node * c.network_bandwidth
        memory = np.full(m, c.host_memory_bandwidth or np.inf)
        storage = np.full(m, c.storage_bandwidth)
        bw = {"node_out": nic, "node_in": nic, "host_memory": memory, "storage_read": storage}
        put("_node_bw", bw | {"storage_write": storage})

    def node_of(self, device: int) -> int:
        """The node id of a cluster device id."""
        return int(self._node_of[device])

    def seconds(self, traffic: Traffic) -> Estimate:
        """How long a transfer takes: the busiest resource's bytes over its bandwidth (the
        bottleneck bound; see the module docstring).

        Args:
          traffic: the transfer's bytes per resource.

        Returns:
          The :class:`Estimate`: seconds, bottleneck, and every resource's seconds.
        """
        loads: dict[str, tuple[float, str]] = {}
        node_traffic = dict(traffic.node)
        # host-side copies: what crosses between a node's host memory and its devices or NICs,
        # and every copy a device whose memory is the host's makes
        cpu = self._host_memory
        host = np.bincount(
            self._node_of,
            traffic.device["h2d"]
            + traffic.device["d2h"]
            + cpu * (traffic.device["copy"] + traffic.device["link_in"] + traffic.device["nic_in"]),
            minlength=len(node_traffic["host_memory"]),
        )
        node_traffic["host_memory"] = node_traffic["host_memory"] + host
        for r in DEVICE_RESOURCES:
            t = traffic.device[r] / self._device_bw[r]
            i = int(np.argmax(t))
            loads[r] = (float(t[i]), f"device {i}")
        for r in self._node_bw:  # the store's gets and puts: one resource, "store", below
            t = node_traffic[r] / self._node_bw[r]
            i = int(np.argmax(t))
            loads[r] = (float(t[i]), f"node {i}")
        total = self.cluster.storage_total_bandwidth
        storage = float(traffic.node["storage_read"].sum() + traffic.node["storage_write"].sum())
        loads["storage_total"] = (storage / total if total else 0.0, "all nodes")
        gets = traffic.node["store_get"] / (self.store_get_bandwidth or np.inf)
        store = gets + traffic.node["store_put"] / (self.store_put_bandwidth or np.inf)
        i = int(np.argmax(store))
        loads["store"] = (float(store[i]), f"node {i}")
        work = self.host_work(traffic)
        i = int(np.argmax(np.where(self._cpu_node, 0.0, work)))
        loads["host_work"] = (0.0 if self._cpu_node[i] else float(work[i]), f"node {i}")
        host_work = float(work[self._cpu_node].max(initial=0.0))
        name, (seconds, where) = max(loads.items(), key=lambda kv: kv[1][0])
        latency = 0.0
        if self.latency_seconds and traffic.messages is not None and traffic.messages.size:
            latency = float(traffic.messages.max()) * self.latency_seconds
        if seconds:
            bottleneck = f"{name} {where}"
        else:
            bottleneck = "latency" if latency else ("host_work" if host_work else "none")
        added = {"latency": latency, "host_work_added": host_work}
        return Estimate(
            seconds=seconds + latency + host_work,
            bottleneck=bottleneck,
            resources={r: s for r, (s, _) in loads.items()} | {k: v for k, v in added.items() if v},
            latency=latency,
            host_work=host_work,
        )

    def host_work(self, traffic: Traffic) -> np.ndarray:
        """Each node's host work for ``traffic``, float ``[nodes]`` seconds: its devices' pieces,
        new shards and, on CPU devices, runs copied, and the leaves it rebuilds."""
        per_device = (
            traffic.pieces * self.piece_seconds
            + traffic.shards * self.shard_seconds
            + traffic.runs * self._host_memory * self.run_seconds
        )
        m = len(self._cpu_node)
        return (
            np.bincount(self._node_of, per_device, minlength=m) + traffic.leaves * self.leaf_seconds
        )


def device_traffic(plan: Plan, network: Network) -> Traffic:
    """The traffic of ``plan`` run device to device in one process, as ``tj.reshard`` runs it.

    A local piece is a copy on its device (none for a ``keep``), another is a send over the
    node's links or, across nodes, over the network.

    Args:
      plan: a :class:`tenplex_jax.typing.Plan` between PTCs over cluster device ids.
      network: the cluster's :class:`Network`; ``network.seconds(traffic)`` is the time.
    """
    traffic = Traffic.empty(network.cluster)
    d, nodes = traffic.device, network._node_of
    runs = bool(network._host_memory.any())  # they cost only on CPU devices: count them there
    per_layout: dict[int, Traffic] = {}
    counts = collections.Counter(id(leaf.shards) for leaf in plan.leaves)
    for leaf in plan.leaves:  # leaves of one layout share their shard plans: count them once
        key = id(leaf.shards)
        if key in per_layout:
            continue
        t = Traffic.empty(network.cluster)
        for shard in leaf.shards:
            if shard.kind == "keep":
                continue
            t.shards[shard.device] += 1
            t.leaves[nodes[shard.device]] = 1
            for p in shard.pieces:
                t.pieces[shard.device] += 1
                if runs:  # read from its source shard and written into its target's
                    t.runs[shard.device] += max(_runs(p.box, p.src_box), _runs(p.box, shard.box))
                if p.local:
                    t.device["copy"][shard.device] += p.nbytes
                elif nodes[p.src_device] == nodes[shard.device]:
                    t.device["link_out"][p.src_device] += p.nbytes
                    t.device["link_in"][shard.device] += p.nbytes
                else:
                    t.device["nic_out"][p.src_device] += p.nbytes
                    t.device["nic_in"][shard.device] += p.nbytes
                    t.node["node_out"][nodes[p.src_device]] += p.nbytes
                    t.node["node_in"][nodes[shard.device]] += p.nbytes
                    t.messages[nodes[shard.device]] += 1
        per_layout[key] = t
    for leaf_key, t in per_layout.items():
        k = counts[leaf_key]
        for r in DEVICE_RESOURCES:
            d[r] += k * t.device[r]
        for r in NODE_RESOURCES:
            traffic.node[r] += k * t.node[r]
        for name in ("pieces", "messages", "shards", "leaves", "runs"):
            setattr(traffic, name, getattr(traffic, name) + k * getattr(t, name))
    return traffic


def _runs(box: boxes.Box, outer: boxes.Box) -> int:
    """The contiguous runs ``box`` is inside a row-major array covering ``outer``: the product of
    its extents before the last dim it does not span whole (1 when it spans every dim after
    the first)."""
    cut = [i for i, (b, o) in enumerate(zip(box, outer)) if b[1] - b[0] < o[1] - o[0]]
    return int(np.prod([b[1] - b[0] for b in box[: cut[-1]]], dtype=np.int64)) if cut else 1


def stored(ptc: PTC, replicas: int) -> list:
    """The objects a commit of a state laid out as ``ptc`` writes (``ptc.hosts`` are node ids, one
    process per node), each with its writer device and the nodes whose stores hold a copy: the
    writer's, then ``replicas`` more, round robin, as ``tenplex_jax._src.multihost.commit``
    writes."""
    from tenplex_jax._src.multihost.commit import stored_objects

    nodes = sorted(set(ptc.hosts))
    index = {n: i for i, n in enumerate(nodes)}
    as_processes = dataclasses.replace(ptc, hosts=tuple(index[h] for h in ptc.hosts))
    return stored_objects(as_processes, nodes, replicas)


def holders(objects: Sequence) -> dict[tuple[str, boxes.Box], tuple[int, ...]]:
    """(leaf path, box) -> the nodes holding a copy, writer's first, of :func:`stored` objects."""
    return {(o.path, o.box): o.slots for o in objects}


@dataclasses.dataclass(frozen=True)
class Pulls:
    """What a new generation reads from the stores, piece by piece: the target device, the node
    whose store serves the piece, its bytes; the (leaf path, box) no live store holds; the
    shards built on each device and the leaves each node rebuilds (every one it holds a shard
    of: a new generation has none)."""

    device: np.ndarray
    source: np.ndarray
    nbytes: np.ndarray
    lost: tuple[tuple[str, boxes.Box], ...]
    shards: np.ndarray
    leaves: np.ndarray


def pulls(
    plan: Plan,
    network: Network,
    held: Mapping[tuple[str, boxes.Box], Sequence[int]],
    failed_nodes: Iterable[int] = (),
) -> Pulls:
    """Where each piece of ``plan`` is read from in the stores: the target's own node when its
    store holds a copy, else the first live holder (the writer, then its replicas)."""
    failed = set(failed_nodes)
    nodes = network._node_of
    n, m = network.cluster.num_devices, len(network._cpu_node)
    shards, leaves = np.zeros(n, dtype=np.int64), np.zeros(m, dtype=np.int64)
    layouts: dict[int, tuple] = {}  # leaves of one layout share their pieces' geometry
    parts, lost = [], set()
    for leaf in plan.leaves:
        key = id(leaf.shards)
        if key not in layouts:
            index: dict[boxes.Box, int] = {}
            rows = [
                (shard.device, index.setdefault(p.src_box, len(index)), p.nbytes)
                for shard in leaf.shards
                for p in shard.pieces
            ]
            device, box, nbytes = (np.array(c, dtype=np.int64).reshape(-1) for c in zip(*rows))
            built = np.array([shard.device for shard in leaf.shards], dtype=np.int64)
            counts = (np.bincount(built, minlength=n), np.bincount(nodes[built], minlength=m) > 0)
            layouts[key] = (list(index), device, nodes[device], box, nbytes, counts)
        distinct, device, target, box, nbytes, (built, rebuilt) = layouts[key]
        shards += built
        leaves += rebuilt
        holding = [[h if h not in failed else -1 for h in held[(leaf.path, b)]] for b in distinct]
        width = max(len(h) for h in holding)
        table = np.array([h + [-1] * (width - len(h)) for h in holding])  # [boxes, holders]
        alive = table >= 0
        first = np.where(alive.any(1), table[np.arange(len(table)), alive.argmax(1)], -1)
        gone = first[box] < 0
        if gone.any():
            lost |= {(leaf.path, distinct[b]) for b in np.unique(box[gone])}
        own = (table[box] == target[:, None]).any(1)
        keep = ~gone
        parts.append((device[keep], np.where(own, target, first[box])[keep], nbytes[keep]))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Pulls(empty, empty, empty, (), shards, leaves)
    device, source, nbytes = (np.concatenate(c) for c in zip(*parts))
    return Pulls(device, source, nbytes, tuple(sorted(lost)), shards, leaves)


def store_traffic(reads: Pulls, network: Network, *, via: int | None = None) -> Traffic:
    """A new generation pulls its shards from the stores (:func:`pulls`), then host to device.
    ``via`` routes every byte through that node's host memory (Tenplex-Central). Each pull is a
    request by the target's node (with ``via``: by that node, then again by the target's) and a
    get from the store it reads; ``via``'s store takes a put of every byte from elsewhere and
    serves it again."""
    traffic = Traffic.empty(network.cluster)
    target = network._node_of[reads.device]
    n, m = network.cluster.num_devices, len(traffic.node["node_out"])
    traffic.node["store_get"] += np.bincount(reads.source, reads.nbytes, minlength=m)
    if via is not None:
        relayed = float(reads.nbytes[reads.source != via].sum())
        traffic.node["store_put"][via] += relayed
        traffic.node["store_get"][via] += relayed
    legs = [(reads.source, target)] if via is None else [(reads.source, via), (via, target)]
    for src, dst in legs:
        src, dst = (np.broadcast_to(x, reads.nbytes.shape) for x in (src, dst))
        cross = np.where(src != dst, reads.nbytes, 0)
        for name, where in (("node_out", src), ("node_in", dst)):
            traffic.node[name] += np.bincount(where, cross, minlength=m)
        traffic.node["host_memory"] += np.bincount(src, cross, minlength=m)
        traffic.node["host_memory"] += np.bincount(dst, cross, minlength=m)
        traffic.messages += np.bincount(dst, minlength=m)
    traffic.device["h2d"] += np.bincount(reads.device, reads.nbytes, minlength=n)
    traffic.pieces += np.bincount(reads.device, minlength=n)
    traffic.shards += reads.shards
    traffic.leaves += reads.leaves
    traffic.lost = list(reads.lost)
    return traffic


def commit_traffic(objects: Sequence, network: Network) -> Traffic:
    """A commit of :func:`stored` objects into the stores: device to host at each writer, then to
    the other holders' stores (a put per copy, by the writer's node, into each holder's store)."""
    traffic = Traffic.empty(network.cluster)
    for o in objects:
        traffic.device["d2h"][o.device] += o.nbytes
        traffic.messages[o.slots[0]] += len(o.slots)
        for node in o.slots:
            traffic.node["store_put"][node] += o.nbytes
        for node in o.slots[1:]:  # host memory to host memory, out of one NIC into the other
            if node != o.slots[0]:
                traffic.node["node_out"][o.slots[0]] += o.nbytes
                traffic.node["node_in"][node] += o.nbytes
                traffic.node["host_memory"][[o.slots[0], node]] += o.nbytes
    return traffic


def save_traffic(objects: Sequence, network: Network) -> Traffic:
    """An orbax save: each distinct box device to host at its writer, then written to storage
    (a write request each)."""
    traffic = Traffic.empty(network.cluster)
    for o in objects:
        traffic.device["d2h"][o.device] += o.nbytes
        traffic.node["storage_write"][o.slots[0]] += o.nbytes
        traffic.messages[o.slots[0]] += 1
    return traffic


def restore_traffic(ptc: PTC, network: Network) -> Traffic:
    """An orbax restore onto ``ptc``: every node reads each distinct box its devices need once,
    then copies it to each of those devices (a read request per box and node)."""
    traffic = Traffic.empty(network.cluster)
    n, m = network.cluster.num_devices, len(traffic.node["node_out"])
    devices = np.asarray(ptc.device_ids)
    node = network._node_of[devices]
    alike: dict[tuple, list] = {}  # leaves laid out alike are read alike: each layout once
    for leaf in ptc.leaves:
        alike.setdefault((leaf.shape, leaf.spec, leaf.itemsize), []).append(leaf)
    for k, leaf in ((len(leaves), leaves[0]) for leaves in alike.values()):
        intervals = ptc.intervals(leaf)  # [dims, devices, 2]
        size = np.prod(intervals[:, :, 1] - intervals[:, :, 0], axis=0) * leaf.itemsize
        traffic.device["h2d"] += k * np.bincount(devices, size, minlength=n)
        traffic.pieces += k * np.bincount(devices, minlength=n)
        rows = np.concatenate(
            [node[:, None], intervals.transpose(1, 0, 2).reshape(len(devices), -1)], axis=1
        )
        _, first = np.unique(rows, axis=0, return_index=True)  # a node reads each box once
        traffic.node["storage_read"] += k * np.bincount(node[first], size[first], minlength=m)
        traffic.messages += k * np.bincount(node[first], minlength=m)
    return traffic
