"""The Tenplex artifact's state transformation, priced like for like: the span its figures time.

The artifact (github.com/kungfu-team/tenplex) times a change in ``tenplex-run``'s
``repartition()`` ("State transformation took"): the clock starts after the job has saved its
state into the tensor stores and stops before the workers restart. Inside it, one transformer
process per target device gets the pieces of its new shards from the stores and puts the shards
into its own node's store:

- a piece is read from the store of the node of the source device that saved it (only the first
  data-parallel replica saves), else from the next node holding a replica of it;
- a put goes to the target's node and, with ``replicas``, the next nodes (round robin);
- Tenplex-Central keeps every tensor in one node's store (node 0): every get and every put is
  served there, from and to every node;
- nothing reaches a device inside the window (the restarted workers load after it), and no
  failure is detected: the artifact emulates one by deleting the failed workers' own copies.

:func:`transformation` prices that span with the simulator's :class:`Network`: the same plan and
the same resources as :class:`~tenplex_jax._src.simulator.replay.Simulation`, on the artifact's
route. Restart and detection are not in it; the caller reports them apart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.plan import allocate, make_plan
from tenplex_jax._src.ptc import PTC, ParallelConfig
from tenplex_jax._src.simulator import network as net
from tenplex_jax._src.simulator.fixed import _layout
from tenplex_jax._src.simulator.replay import Simulation


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    """The artifact's window for one change: what :func:`transformation` returns.

    Attributes:
      seconds: ``start + transfer``; no save, restart or detection is in it.
      start: the fixed seconds before the first byte (the transformer processes launched, the
        checkpoint's structure read), as given.
      transfer: the network model's seconds for the window's gets, sends and puts.
      bottleneck: the busiest resource of the transfer (``"store node 0"``, ...).
      state_bytes: the state's bytes (every distinct box once).
      store_bytes: float ``[nodes]``: each node's store's gets plus puts, in bytes.
      network_bytes: the bytes that crossed between nodes.
    """

    seconds: float = dataclasses.field(init=False)
    start: float
    transfer: float
    bottleneck: str
    state_bytes: int
    store_bytes: tuple[float, ...]
    network_bytes: float

    def __post_init__(self):
        object.__setattr__(self, "seconds", self.start + self.transfer)


def transformation(
    sim: Simulation,
    source: ParallelConfig,
    target: ParallelConfig,
    *,
    central: bool = False,
    failed_devices: int = 0,
    replicas: int = 0,
    start_seconds: float = 0.0,
) -> Window:
    """The artifact's state transformation from ``source`` to ``target`` (module docstring).

    Args:
      sim: the :class:`Simulation`: the model's state, the cluster, its :class:`Network` (the
        stores' rates are ``Costs.store_get_bandwidth`` and ``store_put_bandwidth``).
      source: the config before, on the cluster's first devices (as :func:`fixed_change`).
      target: the config after, re-allocated by ``tj.allocate`` to keep the most bytes in place.
      central: Tenplex-Central: every tensor in node 0's store.
      failed_devices: the devices ``0 .. failed_devices - 1`` whose own saved copies are gone
        (their replicas, on other nodes, stay).
      replicas: store copies beyond the saver's node (the artifact sets 1 for its failure
        runs, none for its reconfiguration runs), for the save and for the window's puts.
      start_seconds: the fixed seconds before the first byte (:attr:`Window.start`).

    Returns:
      The :class:`Window`.

    Raises:
      PlanError: a config the cluster or the model's shapes do not allow, or a failure that
        leaves some piece in no store.
    """
    network = sim.network
    old, new = _layout(sim, source), _layout(sim, target)
    plan = make_plan(old.ptc, allocate(old.ptc, new.ptc))
    nodes = max(sim.cluster.nodes) + 1
    held = _saved(old.ptc, network, nodes, central, failed_devices, replicas)
    reads = net.pulls(plan, network, held)
    if reads.lost:
        path, box = reads.lost[0]
        raise PlanError(
            f"{failed_devices} failed devices leave {len(reads.lost)} boxes in no store, the "
            f"first {path} {box}: the artifact's window needs every piece in some store"
        )
    traffic = _traffic(reads, network, nodes, central, replicas)
    estimate = network.seconds(traffic)
    store = traffic.node["store_get"] + traffic.node["store_put"]
    return Window(
        start=start_seconds,
        transfer=estimate.seconds,
        bottleneck=estimate.bottleneck,
        state_bytes=old.ptc.nbytes,
        store_bytes=tuple(float(b) for b in store),
        network_bytes=traffic.network_bytes,
    )


def _saved(ptc: PTC, network, nodes: int, central: bool, failed: int, replicas: int) -> dict:
    """(leaf path, box) -> the nodes whose stores hold it after the save: the node of the first
    device holding the box (Megatron-LM saves from data-parallel rank 0 only) and the next
    ``replicas`` nodes, the saver's copy -1 (gone) when that device failed; node 0 alone when
    ``central``."""
    held = {}
    for leaf in ptc.leaves:
        savers: dict = {}
        for device, box in ptc.boxes(leaf).items():
            savers[box] = min(device, savers.get(box, device))
        for box, device in savers.items():
            first = network.node_of(device)
            copies = (0,) if central else tuple((first + r) % nodes for r in range(replicas + 1))
            held[(leaf.path, box)] = ((-1,) + copies[1:]) if device < failed else copies
    return held


def _traffic(reads: net.Pulls, network, nodes: int, central: bool, replicas: int) -> net.Traffic:
    """The window's bytes: a get at the serving store, a send to the target's node when they
    differ, a put into each store that keeps the new shard (sent from the target's node), a
    request per leg by the target's node; nothing host to device."""
    traffic = net.Traffic.empty(network.cluster)
    target = network._node_of[reads.device]
    puts = (
        [np.zeros_like(target)] if central else [(target + r) % nodes for r in range(replicas + 1)]
    )
    node = traffic.node
    node["store_get"] += np.bincount(reads.source, reads.nbytes, minlength=nodes)
    for src, dst in [(reads.source, target)] + [(target, p) for p in puts]:
        cross = np.where(src != dst, reads.nbytes, 0)
        for name, where in (("node_out", src), ("node_in", dst)):
            node[name] += np.bincount(where, cross, minlength=nodes)
        node["host_memory"] += np.bincount(src, cross, minlength=nodes)
        node["host_memory"] += np.bincount(dst, cross, minlength=nodes)
        traffic.messages += np.bincount(target, minlength=nodes)
    for p in puts:
        node["store_put"] += np.bincount(p, reads.nbytes, minlength=nodes)
    return traffic
