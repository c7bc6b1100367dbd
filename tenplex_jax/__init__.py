"""tenplex_jax: device-independent JAX/Flax training.

When a job's devices change (preemption, failure, growth, redeployment), tenplex_jax moves the
job's whole state (model, optimizer, step, dataset position) onto the new devices, copying only
the bytes that must move, and training goes on with the same global batch and data order::

    import tenplex_jax as tj

    ptc = tj.PTC.of(state, rules, tj.ParallelConfig(data=8), jax.devices())
    state = tj.place(state, ptc)                      # lay the state out as `ptc`
    new = tj.allocate(ptc, ptc.relayout(tj.ParallelConfig(data=2, tensor=2), jax.devices()[:4]))
    state, report = tj.reshard(state, tj.make_plan(ptc, new))   # bit-identical, minimal moves

or, for the whole loop, :class:`ElasticJob`. The rest is one import deeper: ``tj.data`` (batches
and their gradients), ``tj.pipelining``, ``tj.elastic``, ``tj.planner``, ``tj.multihost``,
``tj.wsp``, ``tj.simulator``, ``tj.errors`` and ``tj.typing``.

Names load on first use, so that ``import tenplex_jax`` (the launcher, the store server, the
command line's ``--help``) does not wait for JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the private module that defines it
_EXPORTS = {
    "PTC": "ptc",
    "ParallelConfig": "mesh",
    "make_plan": "plan",
    "allocate": "plan",
    "reshard": "executor",
    "place": "executor",
    "DatasetPTC": "data",
    "Batch": "batch",
    "ElasticJob": "elastic.job",
    "save_checkpoint": "checkpoint",
    "restore_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
}
_SUBMODULES = frozenset(
    {
        "data",
        "elastic",
        "errors",
        "multihost",
        "pipelining",
        "planner",
        "simulator",
        "typing",
        "wsp",
    }
)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}._src.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)


if TYPE_CHECKING:  # what the names above resolve to, for type checkers and editors
    from tenplex_jax._src.batch import Batch as Batch
    from tenplex_jax._src.checkpoint import latest_checkpoint as latest_checkpoint
    from tenplex_jax._src.checkpoint import restore_checkpoint as restore_checkpoint
    from tenplex_jax._src.checkpoint import save_checkpoint as save_checkpoint
    from tenplex_jax._src.data import DatasetPTC as DatasetPTC
    from tenplex_jax._src.elastic.job import ElasticJob as ElasticJob
    from tenplex_jax._src.executor import place as place
    from tenplex_jax._src.executor import reshard as reshard
    from tenplex_jax._src.mesh import ParallelConfig as ParallelConfig
    from tenplex_jax._src.plan import allocate as allocate
    from tenplex_jax._src.plan import make_plan as make_plan
    from tenplex_jax._src.ptc import PTC as PTC
