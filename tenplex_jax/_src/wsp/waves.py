"""The arrays of a virtual worker's waves: HetPipe's pipelined wave programs, and the stacked
leaves of uneven pipeline stages padded on the VW and unpadded for everyone else.

A VW with a ``wave_step`` runs each wave as one program (:func:`program`): the ``Nm`` reads
stacked into weight versions, the minibatches into one batch, the wave step run on them; the
programs are compiled once per wave step and layout, so a VW that takes a dead one's devices
compiles nothing. A VW of uneven ``stages`` holds its stacked leaves padded
(:func:`stacked_leaves`, :func:`padded`, :func:`pad_rows`); the parameter server and the
optimizer shares hold them unpadded.

A wave in flight is a :class:`Wave` of :class:`Read` s (the weights each minibatch read); its
update lands on the weights as they are then (:func:`landed`), and its push is the change of the
weights over it (:func:`delta`); a pushed wave leaves a :class:`WaveRecord`.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping

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


@dataclasses.dataclass(frozen=True)
class WaveRecord:
    """One wave of one VW: what it trained and where its time went (seconds).

    Attributes:
      vw: the VW's name.
      wave: the wave.
      minibatches: the minibatches (global batches of the dataset PTC) it trained.
      samples: every real sample trained (the exactly-once proof, per sample).
      losses: each minibatch's loss.
      slowest: the slowest member's committed waves when the wave started.
      pulled: whether it pulled the global weights before the wave.
      wait_seconds: waiting (WSP's barrier) and pulling, before training.
      compute_seconds: training the minibatches.
      slowdown_seconds: the sleep that makes the VW ``slowdown`` times slower.
      push_seconds: pushing the wave's update (copied off the devices, staged, committed,
        applied), on a thread beside the next wave's compute.
      started: ``time.time()`` at the start of the wave's wait.
      ended: ``time.time()`` when the wave's push was in the weights.
      local_versions: per minibatch, how many of the VW's own updates the weights it read held
        (counted from its join).
      local_staleness: per minibatch, the VW's own earlier minibatches whose updates it missed
        (``Nm - 1`` once the pipeline is full).
      global_staleness: per minibatch, the VW's clock (its waves in the weights it read) minus
        the clock every VW's waves were there up to (its last pull): at most ``D``.
      idle_ticks: the ticks each pipeline stage waited in the wave, by its schedule: ``stages -
        1`` with ``wave_step`` (the pipeline fills and drains once per wave), ``stages - 1`` per
        minibatch without (each ``train_step`` fills and drains it); 0 without a ``pipe`` axis;
        with ``pipeline="unbroken"``, the most ``stage_idle`` over 2, rounded up (0 in steady
        state while ``Nm >= stages``).
      stage_idle: per stage, the tick table's idle ticks (a tick: one forward or one backward)
        in the wave's calls, with ``pipeline="unbroken"``; empty otherwise.
      push_wait_seconds: how long the VW waited, since the push before this wave's started, for
        that push to finish (before a pull or this push): the communication its compute did not
        hide.
    """

    vw: str
    wave: int
    minibatches: tuple[int, ...]
    samples: tuple[int, ...]  # every real sample trained (the exactly-once proof, per sample)
    losses: tuple[float, ...]
    slowest: int  # the slowest member's committed waves when the wave started
    pulled: bool
    wait_seconds: float
    compute_seconds: float
    slowdown_seconds: float
    push_seconds: float
    started: float  # time.time() at the start of the wave's wait
    ended: float
    local_versions: tuple[int, ...]
    local_staleness: tuple[int, ...]
    global_staleness: tuple[int, ...]
    idle_ticks: int = 0
    push_wait_seconds: float = 0.0
    stage_idle: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, record: Mapping) -> WaveRecord:
        """The record of ``record``, a JSON line's ``dataclasses.asdict`` (lists for tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})


@dataclasses.dataclass(frozen=True)
class Read:
    """The weights a minibatch read when it started, and what they held."""

    weights: tuple[jax.Array, ...]
    version: int  # the VW's own updates in them
    changes: int  # the VW's count of changes to its weights (updates and pulls) when read
    behind: int  # global staleness: the VW's clock minus the clock every VW's waves reached


@dataclasses.dataclass
class Wave:
    """A claimed wave in flight: its minibatches' reads, then their losses as they land."""

    wave: int
    minibatches: tuple[int, ...]
    reads: tuple[Read, ...]
    staleness: tuple[int, ...]  # local staleness: own earlier minibatches each read missed
    start: tuple[jax.Array, ...]  # the weights when it was claimed: its push is the change
    start_changes: int
    slowest: int
    pulled: bool
    started: float
    wait: float
    tic: float = 0.0
    losses: list = dataclasses.field(default_factory=list)
    samples: list = dataclasses.field(default_factory=list)
    after: object = None  # with wave_step: the state after the wave, and the weights after each
    landed: list = dataclasses.field(default_factory=list)  # landing but the last (leaves)
    # the unbroken pipeline's: its calls' idle ticks per stage (the tick table's), and in the
    # record's unit (None: the wave program's, by its schedule)
    stage_idle: tuple[int, ...] = ()
    idle_ticks: int | None = None


@jax.jit
def landed(current: list, after: list, read: list) -> list:
    """An update computed on ``read`` (the step made it ``after``), added to ``current``."""
    return [c + (a - r) for c, a, r in zip(current, after, read)]


@jax.jit
def delta(end: list, start: list) -> list:
    """A wave's update, as the parameter server takes it (float32)."""
    return [e.astype(np.float32) - s.astype(np.float32) for e, s in zip(end, start)]
