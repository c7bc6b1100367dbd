"""Asynchronous virtual workers with wave synchronous parallel (HetPipe), joining and leaving while
the others train (Hydrozoa)::

    with tj.wsp.ParameterServer(addresses) as ps:
        ps.create(initial_weights, total=minibatches)
        worker = tj.wsp.VirtualWorker("vw1", ps, rules, dataset, init, train_step,
                                      devices=jax.devices()[:2], config=tj.ParallelConfig(pipe=2),
                                      options=tj.wsp.WorkerOptions(minibatches=4, distance=1))
        worker.run()

The ``Ledger`` is the job's record in the stores (data cursor, leases, clocks, commits); a
``Coordinator`` starts and ends virtual workers as ``Threads`` or ``Processes`` and logs each
change as a ``VWEvent``; ``plan_workers`` groups a cluster's devices into virtual workers; a
``Scaler`` runs Hydrozoa's ``ScalingPolicy`` (grow while the throughput per dollar holds) on a
coordinator, and asks a ``ClusterManager`` (``LocalPool``) for devices while more would pay;
``search_minibatch`` searches the minibatch size under the devices' memory; a VW's
``MemoryMonitor`` reports its peak (XLA's ``MemoryUse`` of its program when built); a
coordinator with a planner (``planner_for``) re-plans its VWs when the devices change
(``Replanned``). A VW whose devices span processes runs in each of them; its ``Group``
(``Group.of_jax()``) lets its leader decide for all.
"""

from tenplex_jax._src.wsp.batches import BatchChoice, search_minibatch
from tenplex_jax._src.wsp.coordinator import Coordinator, Processes, Threads, VWEvent, VWEventKind
from tenplex_jax._src.wsp.group import Group
from tenplex_jax._src.wsp.hetpipe import StageModel, UnbrokenModel
from tenplex_jax._src.wsp.ledger import Ledger
from tenplex_jax._src.wsp.manager import ClusterManager, LocalPool
from tenplex_jax._src.wsp.memory import MemoryMonitor, MemoryUse
from tenplex_jax._src.wsp.options import WorkerOptions, weights_of
from tenplex_jax._src.wsp.planner import Grouping, WorkerPlan, WSPChoice, plan_workers
from tenplex_jax._src.wsp.policy import Action, Measured, ScalingDecision, ScalingPolicy
from tenplex_jax._src.wsp.ps import ParameterServer
from tenplex_jax._src.wsp.replan import Replanned, planner_for
from tenplex_jax._src.wsp.scaler import Scaler
from tenplex_jax._src.wsp.waves import WaveRecord
from tenplex_jax._src.wsp.worker import VirtualWorker

__all__ = [
    "Action",
    "BatchChoice",
    "ClusterManager",
    "Coordinator",
    "Group",
    "Grouping",
    "Ledger",
    "LocalPool",
    "Measured",
    "MemoryMonitor",
    "MemoryUse",
    "ParameterServer",
    "Processes",
    "Replanned",
    "Scaler",
    "ScalingDecision",
    "ScalingPolicy",
    "StageModel",
    "Threads",
    "UnbrokenModel",
    "VWEvent",
    "VWEventKind",
    "VirtualWorker",
    "WSPChoice",
    "WaveRecord",
    "WorkerOptions",
    "WorkerPlan",
    "plan_workers",
    "planner_for",
    "search_minibatch",
    "weights_of",
]
