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
coordinator. A VW whose devices span processes runs in each of them; its ``Group``
(``Group.of_jax()``) lets its leader decide for all.
"""

from tenplex_jax._src.wsp.coordinator import Coordinator, Processes, Threads, VWEvent, VWEventKind
from tenplex_jax._src.wsp.group import Group
from tenplex_jax._src.wsp.ledger import Ledger
from tenplex_jax._src.wsp.planner import Grouping, WorkerPlan, WSPChoice, plan_workers
from tenplex_jax._src.wsp.policy import Action, Measured, ScalingDecision, ScalingPolicy
from tenplex_jax._src.wsp.ps import ParameterServer
from tenplex_jax._src.wsp.scaler import Scaler
from tenplex_jax._src.wsp.waves import WaveRecord
from tenplex_jax._src.wsp.worker import VirtualWorker, WorkerOptions, weights_of

__all__ = [
    "Action",
    "Coordinator",
    "Group",
    "Grouping",
    "Ledger",
    "Measured",
    "ParameterServer",
    "Processes",
    "Scaler",
    "ScalingDecision",
    "ScalingPolicy",
    "Threads",
    "VWEvent",
    "VWEventKind",
    "VirtualWorker",
    "WSPChoice",
    "WaveRecord",
    "WorkerOptions",
    "WorkerPlan",
    "plan_workers",
    "weights_of",
]
