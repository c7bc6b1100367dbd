"""tenplex_jax: device-independent JAX/Flax training state.

The public face, in the order a user meets it::

    import tenplex_jax as tj

    state = nnx.state({"model": model, "optimizer": optimizer})   # any NNX model + optax state
    ptc = tj.PTC.of(state, rules, tj.ParallelConfig(data=8), jax.devices())
    state = tj.place(state, ptc)                                  # lay the state out as `ptc`
    new = ptc.relayout(tj.ParallelConfig(data=2, tensor=2), jax.devices()[2:6])
    new = tj.allocate(ptc, new)                                   # device order that keeps most bytes
    plan = tj.make_plan(ptc, new)                                 # pure: no device memory touched
    print(plan)                                                   # bytes kept / moved per group
    state, report = tj.reshard(state, plan)                       # bit-identical, old buffers freed

    dataset = tj.DatasetPTC(samples, global_batch=64, seed=0)     # the dataset PTC: a fixed order
    with tj.ElasticJob(rules, dataset, workers=8) as job:         # one process, or launched
        state = job.start(init)                                   # built, or restored
        step = job.jit(train_step)                                # train_step(state, batch)
        while job.step < 1000:
            state, batch = job.next(state)                        # events applied between steps
            state, metrics = step(state, batch)
        job.finish(state)

The rest is one import deeper: ``tj.errors`` (every error class), ``tj.planner`` (cluster
descriptions, model profiles, the search and the config policy), ``tj.elastic`` (the elastic loop,
compiled steps, resource traces), ``tj.multihost`` (the launcher, the commit protocol and the
tensor store), ``tj.simulator`` (reconfigurations on thousands of described devices), ``tj.wsp``
(asynchronous virtual workers, a parameter server, wave synchronous parallel), and the core modules ``tj.ptc``, ``tj.mesh``, ``tj.rules``, ``tj.tree``,
``tj.plan``, ``tj.executor``, ``tj.data``, ``tj.batch``, ``tj.pipelining``, ``tj.checkpoint`` and
``tj.box``.

A PTC comes from whatever the job has: ``tj.PTC.of(state, rules, mesh)`` for logical names (Flax
NNX variables, Linen boxes) and rules on any mesh (``tj.ParallelConfig(...)``, or the user's own
``Mesh`` / ``jax.make_mesh`` / ``AbstractMesh``), ``tj.PTC.from_shardings(state)`` for any pytree
of arrays, or ShapeDtypeStructs, as their shardings lay them out.

Names are imported on first use, so that ``import tenplex_jax`` (and ``tenplex-jax --help``) does
not wait for JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "PTC": "ptc",
    "ParallelConfig": "ptc",
    "make_plan": "plan",
    "allocate": "plan",
    "reshard": "executor",
    "place": "executor",
    "DatasetPTC": "data",
    "DataState": "data",
    "BatchLayout": "data",
    "Batch": "batch",
    "batch_value_and_grad": "batch",
    "device_batch": "batch",
    "pipeline": "pipelining",
    "Stages": "pipelining",
    "save_checkpoint": "checkpoint",
    "restore_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "ElasticJob": "elastic",
}
_SUBMODULES = frozenset(
    {"box", "batch", "checkpoint", "data", "errors", "executor", "mesh", "pipelining", "plan"}
    | {"ptc", "rules", "tree"}
    | {"elastic", "multihost", "planner", "simulator", "wsp"}
)

__all__ = [  # the same names as _EXPORTS, spelled out for tools that read __all__ statically
    "PTC",
    "Batch",
    "BatchLayout",
    "DataState",
    "DatasetPTC",
    "ElasticJob",
    "ParallelConfig",
    "Stages",
    "allocate",
    "batch_value_and_grad",
    "device_batch",
    "latest_checkpoint",
    "make_plan",
    "pipeline",
    "place",
    "reshard",
    "restore_checkpoint",
    "save_checkpoint",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


if TYPE_CHECKING:  # what the names above resolve to, for type checkers and editors
    from tenplex_jax.batch import (
        Batch as Batch,
        batch_value_and_grad as batch_value_and_grad,
        device_batch as device_batch,
    )
    from tenplex_jax.checkpoint import (
        latest_checkpoint as latest_checkpoint,
        restore_checkpoint as restore_checkpoint,
        save_checkpoint as save_checkpoint,
    )
    from tenplex_jax.data import (
        BatchLayout as BatchLayout,
        DatasetPTC as DatasetPTC,
        DataState as DataState,
    )
    from tenplex_jax.elastic import (
        ElasticJob as ElasticJob,
    )
    from tenplex_jax.executor import (
        place as place,
        reshard as reshard,
    )
    from tenplex_jax.pipelining import (
        Stages as Stages,
        pipeline as pipeline,
    )
    from tenplex_jax.plan import (
        allocate as allocate,
        make_plan as make_plan,
    )
    from tenplex_jax.ptc import (
        PTC as PTC,
        ParallelConfig as ParallelConfig,
    )
