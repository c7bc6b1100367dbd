"""Asynchronous virtual workers with wave synchronous parallel (HetPipe), joining and leaving while
the others train (Hydrozoa).

``ledger.py`` is the job's record in the stores (the data cursor, leases, clocks, commits: pure,
changed by compare-and-swap), ``ps.py`` the parameter server over the tensor stores (staged
updates, commits, atomic accumulates, pulls), ``worker.py`` a virtual worker's WSP loop,
``coordinator.py`` the coordinator that starts and ends VWs (threads or processes, by hand or
from a resource trace), ``planner.py`` the grouping of a cluster's devices into VWs with their
stages, ``Nm`` and ``D``::

    with tj.wsp.ParameterServer(addresses) as ps:
        ps.create(initial_weights, total=minibatches)
        worker = tj.wsp.VirtualWorker("vw1", ps, rules, dataset, init, train_step,
                                      devices=jax.devices()[:4], config=tj.ParallelConfig(pipe=2, data=2),
                                      minibatches=4, distance=1)
        worker.run()

Names load on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Ledger": "ledger",
    "ParameterServer": "ps",
    "VirtualWorker": "worker",
    "WaveRecord": "worker",
    "Coordinator": "coordinator",
    "Threads": "coordinator",
    "Processes": "coordinator",
    "weights_of": "worker",
    "plan_workers": "planner",
    "WorkerPlan": "planner",
    "WSPChoice": "planner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
