"""The arrays of a virtual worker's waves: HetPipe's pipelined wave programs, and the stacked
leaves of uneven pipeline stages padded on the VW and unpadded for everyone else.

A VW with a ``wave_step`` runs each wave as one program (:func:`program`): the ``Nm`` reads
stacked into weight versions, the minibatches into one batch, the wave step run on them; the
programs are compiled once per wave step and layout, so a VW that takes a dead one's devices
compiles nothing. A VW of uneven ``stages`` holds its stacked leaves padded
(:func:`stacked_leaves`, :func:`padded`, :func:`pad_rows`); the parameter server and the
optimizer shares hold them unpadded.
"""

from __future__ import annotations

import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from tenplex_jax._src import tree
from tenplex_jax._src.batch import BATCH_AXES, Batch
from tenplex_jax._src.data import BatchLayout
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules


def replaced(state, indices: list[int], arrays) -> object:
    """``state`` with its leaves ``indices`` (in :func:`tree.arrays` order) set to ``arrays``."""
    _, leaves, treedef = tree.arrays(state)
    for i, x in zip(indices, arrays):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


# compiled wave programs, per wave_step function: VWs of one layout (a joiner on a dead VW's
# devices, the rounds of a test) share them, as they share a StepCache's train steps
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PROGRAMS_LOCK = threading.Lock()


def program(wave_step, n: int, ptc: PTC, layout: BatchLayout, part: str, weights, mesh):
    """``wave_step`` for waves of ``n`` minibatches on ``ptc``, compiled once: the reads
    stacked into versions and the minibatches into one batch inside it; the state keeps its
    layout."""
    with _PROGRAMS_LOCK:
        programs = _PROGRAMS.setdefault(wave_step, {})
        key = (n, ptc, layout, part, weights)
        if key not in programs:
            step = weakref.ref(wave_step)  # the program must not hold its key alive

            def run(state, reads, data, batch_weights):
                stacked = [jnp.stack([r[i] for r in reads]) for i in range(len(weights))]
                versions = replaced(state, list(weights), stacked)[part]
                stack = lambda *xs: jnp.stack(xs)
                batch = Batch(
                    jax.tree.map(stack, *data), stack(*batch_weights), layout, mesh, BATCH_AXES
                )
                return step()(state, versions, batch)

            programs[key] = jax.jit(run, out_shardings=(ptc.shardings(mesh), None, None))
        return programs[key]


def stacked_leaves(state, rules: Rules, name: str = "layers") -> frozenset[int]:
    """The leaves (in :func:`tree.arrays` order) whose first logical axis is ``name``."""
    layouts = PTC.of(state, rules, ParallelConfig(), jax.devices()[:1]).leaves
    return frozenset(i for i, leaf in enumerate(layouts) if (leaf.logical or (None,))[0] == name)


def padded(init, stacked: frozenset[int], stages: Stages):
    """``init`` (a state, or a function that builds one) with its ``stacked`` leaves padded."""

    def pad(state):
        _, leaves, _ = tree.arrays(state)
        return replaced(state, sorted(stacked), [stages.pad(leaves[i]) for i in sorted(stacked)])

    return (lambda: pad(init())) if callable(init) else pad(init)


def pad_rows(x: np.ndarray, stages: Stages) -> np.ndarray:
    """A host array of ``num_layers`` rows padded for ``stages`` (zeros in the padding rows)."""
    if x.shape[:1] != (stages.num_layers,):
        raise WSPError(
            f"a stacked leaf of {x.shape} cannot be padded for stages {stages.layers}: it needs "
            f"{stages.num_layers} rows",
            "invalid",
        )
    out = np.zeros((len(stages.index),) + x.shape[1:], x.dtype)
    out[stages.mask] = x
    return out
