"""What a virtual worker is told (:class:`WorkerOptions`: how it trains, one frozen record,
checked when made) and what it pushes (:func:`weights_of`: a train state's weights as the
parameter server holds them)."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import jax
import numpy as np

from tenplex_jax._src import tree
from tenplex_jax._src.elastic.executables import ExecutableCache
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.wsp.group import Group
from tenplex_jax._src.wsp.hetpipe import UnbrokenModel
from tenplex_jax._src.wsp.waves import WaveRecord


def weights_of(state, part: str = "model") -> dict[str, np.ndarray]:
    """The weights of a train state, as the parameter server holds them.

    >>> weights_of({"model": {"w": np.ones(2, np.float16)}, "optimizer": {"mu": np.zeros(2)}})
    {'model/w': array([1., 1.], dtype=float32)}

    Args:
      state: the train state (an ``nnx.State``, graph nodes, or a pytree of arrays).
      part: the top-level key of the weights.

    Returns:
      Leaf path -> float32 host array, for the leaves under ``part`` (what
      ``ParameterServer.create`` and ``push`` take).
    """
    paths, leaves, _ = tree.arrays(state)
    chosen = [(p, x) for p, x in zip(paths, leaves) if p.startswith(part + "/")]
    host = jax.device_get([x for _, x in chosen])
    return {p: np.asarray(x, np.float32) for (p, _), x in zip(chosen, host)}


PIPELINES = ("wave", "unbroken")  # WorkerOptions.pipeline: the wave program, or HetPipe's


def _at_least(low, kinds=(numbers.Integral,)) -> Callable[[object], bool]:
    """Whether a value is a number of ``kinds`` (not a bool) of at least ``low``."""
    return lambda v: isinstance(v, kinds) and not isinstance(v, bool) and v >= low


def _none_or(holds) -> Callable[[object], bool]:
    return lambda v: v is None or holds(v)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """How a virtual worker trains, beyond what it is (its name, job, devices): one frozen record.

    Every field has a default; pass only what differs (``dataclasses.replace`` for variants)::

        options = tj.wsp.WorkerOptions(minibatches=4, distance=1)

    Attributes:
      minibatches: ``Nm``, the minibatches of a wave.
      distance: WSP's ``D``: the waves it may run ahead of the slowest member.
      grad_units: the batch layout's gradient units (None: one per sample).
      slowdown: ``s >= 1``: after each wave, sleep ``s - 1`` times its compute time, as a device
        ``s`` times slower would take (heterogeneity on one machine).
      timeout: seconds of unchanged heartbeats after which a waiting VW drops a member; it
        heartbeats, and reads the others' heartbeats, every ``timeout / 4``.
      part: the top-level key of the weights the parameter server holds.
      optimizer_every: share the optimizer state through the stores every this many waves (and
        when leaving), for VWs that join later; 0: never.
      stages: uneven pipeline stages (``WorkerPlan.candidate.stages``): the VW holds every leaf
        whose first logical axis is ``layers`` padded for them and pushes, pulls and shares them
        unpadded, so VWs of different stages train one job (``train_step`` runs its pipeline
        with them). None: the stacked leaves as they are.
      wave_step: HetPipe's pipelined wave, where ``config`` has a ``pipe`` axis (else one
        ``train_step`` per minibatch): ``wave_step(state, reads, batch) -> (state, landed,
        metrics)`` runs a wave's minibatches in one program, all in flight; ``reads`` is the
        ``part`` subtree with each weight leaf's versions stacked (minibatch ``j`` read version
        ``j``), ``batch`` leads with the wave's minibatches; it returns the state after the
        wave's updates landed, ``landed`` (the ``part`` subtree after each landing but the last)
        and ``metrics["loss"]`` per minibatch (``tenplex_jax_models.train.wave_step``).
      steps: a ``StepCache`` of ``train_step`` shared by the VWs of one process (``donate=False``),
        so a VW that replaces another compiles nothing (None: its own).
      executables: an ``ExecutableCache`` the VW's programs are loaded from (compiled and stored
        when missing; the wave program before it joins). None: compiled in memory.
      group: the VW's processes, when its ``devices`` span processes (:meth:`Group.of_jax`); its
        leader alone talks to the parameter server. None: one process.
      on_wave: ``on_wave(name, wave, minibatches)``, called when a wave is claimed.
      on_record: ``on_record(record)``, called with each :class:`WaveRecord` once pushed.
      on_ready: ``on_ready(name, wave)``, called when the VW is ready for ``wave`` (the wave
        before it has landed and its push has started), before WSP's wait and the claim; again
        for the same wave when none was left to claim. The VW holds there until it returns: an
        observer of wave boundaries, or a scheduler's gate (the tests drive VWs through a fixed
        interleaving with it).
      memory_limit: bytes per device the VW may use (None: the devices' own where the backend
        reports it, else none): a VW whose compiled program's peak (XLA's buffer assignment)
        exceeds it is refused when built, and its :attr:`VirtualWorker.memory` monitor (read at
        each wave's first minibatch) raises when the bytes in use exceed it while it trains
        (``WSPError "memory"``).
      pipeline: how a VW with a ``pipe`` axis runs its minibatches: ``"wave"``, each wave as
        one program (``wave_step``; its pipeline fills and drains every wave), or
        ``"unbroken"``, HetPipe's pipeline carried across waves (``unbroken``:
        :mod:`~tenplex_jax._src.wsp.unbroken`), only the minibatch the clock distance blocks
        waiting; the same pushes, pulls and records.
      unbroken: the train state as the unbroken pipeline's stages run it
        (``tenplex_jax_models.unbroken_model`` for the reference GPT); needed by
        ``pipeline="unbroken"``.
      prefetch: claim the next wave ahead and read and place its minibatches on a thread of
        its own, beside the compute and the push (:mod:`~tenplex_jax._src.wsp.prefetch`; a VW
        of one process).

    Raises:
      WSPError: a field has the wrong type or lies outside its range (``"invalid"``); the
        message names the field, the rule and the value.
    """

    minibatches: int = 1
    distance: int = 0
    grad_units: int | None = None
    slowdown: float = 1.0
    timeout: float = 10.0
    part: str = "model"
    optimizer_every: int = 4
    stages: Stages | None = None
    wave_step: Callable | None = None
    steps: StepCache | None = None
    executables: ExecutableCache | None = None
    group: Group | None = None
    on_wave: Callable[[str, int, tuple[int, ...]], None] | None = None
    on_record: Callable[[WaveRecord], None] | None = None
    on_ready: Callable[[str, int], None] | None = None
    memory_limit: int | None = None
    prefetch: bool = False
    pipeline: str = "wave"
    unbroken: UnbrokenModel | None = None

    def __post_init__(self):
        kind = lambda *kinds: _none_or(lambda v: isinstance(v, kinds))
        rules = {  # field: (the rule, whether a value keeps it)
            "minibatches": ("an int >= 1", _at_least(1)),
            "distance": ("an int >= 0", _at_least(0)),
            "grad_units": ("an int >= 1 or None", _none_or(_at_least(1))),
            "slowdown": ("a number >= 1", _at_least(1, numbers.Real)),
            "timeout": ("seconds > 0", lambda v: _at_least(0, numbers.Real)(v) and v > 0),
            "part": ("a non-empty str", lambda v: isinstance(v, str) and v != ""),
            "optimizer_every": ("an int >= 0", _at_least(0)),
            "stages": ("a tj.pipelining.Stages or None", kind(Stages)),
            "steps": ("a StepCache or None", kind(StepCache)),
            "executables": ("an ExecutableCache or None", kind(ExecutableCache)),
            "group": ("a tj.wsp.Group or None", kind(Group)),
            "memory_limit": ("bytes >= 1 or None", _none_or(_at_least(1))),
            "prefetch": ("a bool", lambda v: isinstance(v, bool)),
            "pipeline": ("'wave' or 'unbroken'", lambda v: v in PIPELINES),
            "unbroken": (
                "a tj.wsp.UnbrokenModel or None",
                kind(UnbrokenModel),
            ),
            **dict.fromkeys(
                ("wave_step", "on_wave", "on_record", "on_ready"),
                ("a callable or None", _none_or(callable)),
            ),
        }
        for field, (rule, holds) in rules.items():
            value = getattr(self, field)
            if not holds(value):
                raise WSPError(f"WorkerOptions.{field} is {rule}, got {value!r}", "invalid")
        if self.pipeline == "unbroken" and self.unbroken is None:
            raise WSPError(
                "WorkerOptions.pipeline='unbroken' needs WorkerOptions.unbroken (the state as "
                "the stages run it), got None",
                "invalid",
            )
