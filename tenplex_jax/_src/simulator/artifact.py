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

Two rules come from the artifact's Megatron-LM job rather than this library's layout:

- **The pipeline's edges** (:class:`PipelineEdges`). Megatron-LM keeps the input embedding on the
  first pipeline stage only and the output layer and final norm on the last only (the artifact's
  ``state_transformer/megatronlm/keymap.go``, ``inferSourcePPRankByKey``), where this library's
  GPT runs them on every stage. A transformer gets only its own stage's tensors, and the save
  keeps each edge leaf from its stage alone.
- **The store's work is the bytes it copies**. A store keeps each saved
  tensor (one layer of one device's shard: Megatron-LM saves layer by layer) as one buffer. A get
  copies that buffer whole out of its tree, then writes what it serves onto the connection; a
  get of a part of it (a tensor-parallel degree changed: ``range=a:b`` or ``:,a:b``) copies the
  part into a new tensor first (``mlfs/mlfs/web.go`` ``queryTensor``, ``mlfs/vfs/utils.go``
  ``ReadFile``, ``tensor/tensor.go`` ``Range``). A put reads the body into a new buffer and keeps
  it (``uploadTensor``, ``TouchTensor``). So a whole get of ``b`` bytes is ``2b``, a get of ``b``
  cut from a tensor of ``B`` is ``B + 2b``, a put of ``b`` is ``b`` (with replicas, the target
  node's store forwards every upload: see ``_traffic``). The stores' rate is these bytes a
  second.

:func:`transformation` prices that span with the simulator's :class:`Network`: the same plan and
the same resources as :class:`~tenplex_jax._src.simulator.replay.Simulation`, on the artifact's
route. Restart and detection are not in it; the caller reports them apart.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.plan import Plan, allocate, make_plan
from tenplex_jax._src.ptc import PTC, ParallelConfig
from tenplex_jax._src.simulator import network as net
from tenplex_jax._src.simulator.fixed import _layout
from tenplex_jax._src.simulator.replay import Simulation


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineEdges:
    """Which leaves sit on one pipeline stage alone, by the last name of their path (a leaf's
    optimizer moments with it): ``first`` on stage 0, ``last`` on the last stage. Every other
    leaf is where its layout puts it (a leaf with a ``layers`` axis on its layers' stage, any
    other on every stage). The default is Megatron-LM's GPT for this project's GPT: the token and
    position embeddings first, the output layer (Megatron-LM's ``word_embeddings_for_head``) and
    the final norm last.
    """

    first: tuple[str, ...] = ("tok_embed", "pos_embed")
    last: tuple[str, ...] = ("unembed", "final_norm_scale")

    def stage(self, path: str, stages: int) -> int | None:
        """The one stage of ``stages`` that holds the leaf at ``path``; None: not an edge leaf."""
        name = path.rsplit("/", 1)[-1]
        return 0 if name in self.first else stages - 1 if name in self.last else None


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
      store_bytes: float ``[nodes]``: the bytes each node's store copies for its gets and puts
        (``_store_work``).
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
    edges: PipelineEdges = PipelineEdges(),
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
      edges: the leaves on the first or last pipeline stage alone (default Megatron-LM's);
        ``PipelineEdges(first=(), last=())`` keeps every leaf where its layout puts it.

    Returns:
      The :class:`Window`.

    Raises:
      PlanError: a config the cluster or the model's shapes do not allow, or a failure that
        leaves some piece in no store.
    """
    network = sim.network
    old, new = _layout(sim, source), _layout(sim, target)
    plan = _on_stages(make_plan(old.ptc, allocate(old.ptc, new.ptc)), edges)
    nodes = max(sim.cluster.nodes) + 1
    held = _saved(old.ptc, edges, network, nodes, central, failed_devices, replicas)
    reads = net.pulls(plan, network, held)
    if reads.lost:
        path, box = reads.lost[0]
        raise PlanError(
            f"{failed_devices} failed devices leave {len(reads.lost)} boxes in no store, the "
            f"first {path} {box}: the artifact's window needs every piece in some store"
        )
    traffic = _traffic(reads, _store_work(plan), network, nodes, central, replicas)
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


def _stage_of(ptc: PTC) -> dict[int, int]:
    """Device id -> its pipeline stage in ``ptc`` (0 for every device of a mesh without one)."""
    names = ptc.config.names
    if "pipe" not in names:
        return dict.fromkeys(ptc.device_ids, 0)
    coords = np.indices(ptc.config.sizes).reshape(len(names), -1)[names.index("pipe")]
    return dict(zip(ptc.device_ids, coords.tolist()))


def _on_stages(plan: Plan, edges: PipelineEdges) -> Plan:
    """``plan`` with each edge leaf's target shards on its own stage of ``plan.dst`` alone
    (leaves that shared their shard plans share the kept ones)."""
    stage, stages = _stage_of(plan.dst), plan.dst.config.shape.get("pipe", 1)
    kept: dict[tuple[int, int], tuple] = {}
    leaves = []
    for leaf in plan.leaves:
        at = edges.stage(leaf.path, stages)
        if at is not None:
            key = (id(leaf.shards), at)
            if key not in kept:
                kept[key] = tuple(s for s in leaf.shards if stage[s.device] == at)
            leaf = dataclasses.replace(leaf, shards=kept[key], totals=None)
        leaves.append(leaf)
    return dataclasses.replace(plan, leaves=tuple(leaves))


def _store_work(plan: Plan) -> np.ndarray:
    """The bytes the serving store copies for each piece's get, in :func:`net.pulls`'s order
    (leaf, shard, piece): float ``[pieces]``. The saved tensor a piece is read from is its source
    box over the piece's own layers (Megatron-LM saves a tensor a layer); the get copies it
    whole, then the piece onto the connection, and the piece once more first when the piece is
    a part of that tensor (module docstring)."""
    gets = []
    for leaf in plan.leaves:
        logical = leaf.src.logical or ()
        layers = logical.index("layers") if "layers" in logical else None
        for shard in leaf.shards:
            for p in shard.pieces:
                saved = p.src_box
                if layers is not None:
                    saved = saved[:layers] + (p.box[layers],) + saved[layers + 1 :]
                cut = p.nbytes if saved != p.box else 0
                gets.append(boxes.nbytes(saved, leaf.src.itemsize) + p.nbytes + cut)
    return np.array(gets, dtype=float)


def _saved(
    ptc: PTC, edges: PipelineEdges, network, nodes: int, central: bool, failed: int, replicas: int
) -> dict:
    """(leaf path, box) -> the nodes whose stores hold it after the save: the node of the first
    device holding the box (Megatron-LM saves from data-parallel rank 0 only; an edge leaf from
    its own stage only) and the next ``replicas`` nodes, the saver's copy -1 (gone) when that
    device failed; node 0 alone when ``central``."""
    stage, stages = _stage_of(ptc), ptc.config.shape.get("pipe", 1)
    held = {}
    for leaf in ptc.leaves:
        at = edges.stage(leaf.path, stages)
        savers: dict = {}
        for device, box in ptc.boxes(leaf).items():
            if at is None or stage[device] == at:
                savers[box] = min(device, savers.get(box, device))
        for box, device in savers.items():
            first = network.node_of(device)
            copies = (0,) if central else tuple((first + r) % nodes for r in range(replicas + 1))
            held[(leaf.path, box)] = ((-1,) + copies[1:]) if device < failed else copies
    return held


def _traffic(
    reads: net.Pulls, gets: np.ndarray, network, nodes: int, central: bool, replicas: int
) -> net.Traffic:
    """The window's bytes: a get at the serving store, a send to the target's node when they
    differ, a put into each store that keeps the new shard (sent from the target's node), a
    request per leg by the target's node; nothing host to device. The stores' loads are the
    bytes they copy: ``gets`` (:func:`_store_work`) and, for a put of ``b``, ``b`` at each
    store keeping it, and with ``replicas`` (the artifact's store then replicates each upload
    itself: ``mlfs/mlfs/replicate.go``) ``(replicas + 3) b`` at the target's node's store: the
    body read, written to each holder, itself included, and read back as its own copy."""
    traffic = net.Traffic.empty(network.cluster)
    target = network._node_of[reads.device]
    puts = (
        [np.zeros_like(target)] if central else [(target + r) % nodes for r in range(replicas + 1)]
    )
    node = traffic.node
    node["store_get"] += np.bincount(reads.source, gets, minlength=nodes)
    for src, dst in [(reads.source, target)] + [(target, p) for p in puts]:
        cross = np.where(src != dst, reads.nbytes, 0)
        for name, where in (("node_out", src), ("node_in", dst)):
            node[name] += np.bincount(where, cross, minlength=nodes)
        node["host_memory"] += np.bincount(src, cross, minlength=nodes)
        node["host_memory"] += np.bincount(dst, cross, minlength=nodes)
        traffic.messages += np.bincount(target, minlength=nodes)
    for r, p in enumerate(puts):
        copies = replicas + 3 if replicas and not r else 1
        node["store_put"] += np.bincount(p, copies * reads.nbytes, minlength=nodes)
    return traffic
