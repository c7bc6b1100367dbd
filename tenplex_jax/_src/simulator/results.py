"""What the simulator returns: typed, frozen records; ``to_json()`` is the JSON the command writes
(``dataclasses.asdict``, the enums as their strings)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import NamedTuple

from tenplex_jax._src.elastic.events import EventKind
from tenplex_jax._src.planner.growth import Growth
from tenplex_jax._src.simulator.costs import CheckpointInterval, Costs, Policy


class Outcome(enum.StrEnum):
    """What the simulated job did at an event (:attr:`EventResult.decision`)."""

    CHANGE = "change"  # a new layout on the devices it holds now
    GROW = "grow"  # an offer taken: the growth rule says the gain outweighs the cost
    STAY = "stay"  # an offer declined: its devices stay with the job, idle
    KEEP = "keep"  # nothing new, or only idle devices went: the layout stays
    WAIT = "wait"  # no device left: the job trains nothing until some come back
    RESUME = "resume"  # devices back after a wait: from the stores or the checkpoint


class _Record:
    def to_json(self, indent: int | None = 1) -> str:
        """The record as JSON text (``dataclasses.asdict``, NumPy scalars as numbers), indented
        by ``indent`` spaces a level (None: on one line)."""
        plain = lambda x: x.item() if hasattr(x, "item") else str(x)
        return json.dumps(dataclasses.asdict(self), indent=indent, default=plain)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyCost(_Record):
    """One policy's seconds at one event or change, and their parts (0 where one does not apply).

    Attributes:
      seconds: the stall: the sum of the parts from ``detect`` to ``compile``, plus ``wait``.
      detect: from a failure to its notice (``Costs.detect_seconds``); 0 with notice.
      commit: tenplex and central: the last step committed to the stores first (with notice).
      save: checkpoint-restart: a checkpoint saved first (with notice).
      transfer: tenplex and central: the new generation's pulls from the stores.
      restore: an orbax restore onto the new layout: checkpoint-restart's, or a fallback's.
      restart: new processes up to their first collective (``Costs.restart``).
      compile: the new layout's step compiled on demand (0 when ``compiled_ahead``).
      compiled_ahead: whether the step was compiled before the change.
      latency: the requests' latency, a part of the transfer, restore, commit or save.
      bottleneck: the busiest resource of the transfer or restore (``"none"``: no traffic).
      network_bytes: bytes that crossed between nodes (tenplex, central; None otherwise).
      fallback: some box was in no live store, so the checkpoint served (the orbax fallback).
      lost_leaves: the paths of the leaves with such boxes.
      wait: while the job holds no device: the seconds until an event gives it one.
      lost_seconds: the training a failure lost (since the last commit or checkpoint).
    """

    seconds: float = dataclasses.field(init=False)
    detect: float = 0.0
    commit: float = 0.0
    save: float = 0.0
    transfer: float = 0.0
    restore: float = 0.0
    restart: float = 0.0
    compile: float = 0.0
    compiled_ahead: bool = False
    latency: float = 0.0
    bottleneck: str = "none"
    network_bytes: float | None = None
    fallback: bool = False
    lost_leaves: tuple[str, ...] = ()
    wait: float = 0.0
    lost_seconds: float = 0.0

    def __post_init__(self):
        parts = (self.detect, self.commit, self.save, self.transfer, self.restore, self.restart)
        object.__setattr__(self, "seconds", sum(parts) + self.compile + self.wait)

    @property
    def window(self) -> float:
        """The state transformation alone: the pulls (or a fallback's restore), after the commit
        or save and before the restart; no detection, restart or compile. The span the Tenplex
        artifact times ("State transformation took"); ``tj.simulator.transformation`` prices
        it on the artifact's own route."""
        return self.transfer + self.restore


NO_CHANGE = PolicyCost()  # an event that changes nothing costs nothing


@dataclasses.dataclass(frozen=True, kw_only=True)
class EventResult(_Record):
    """One event of a replay: the job's devices and layout, its decision, each policy's cost.

    Attributes:
      event: its index in the trace.
      minute: when it came.
      kind: the trace event's ``EventKind``.
      devices_before: the devices the job held (some may be idle).
      devices_after: the devices it holds after.
      used_before: the devices its layout used.
      used_after: the devices its new layout uses.
      config_before: the layout's label (``"(no device)"`` while the job holds none).
      config_after: the new layout's label.
      step_seconds_before: the planner's seconds per step (None: no device).
      step_seconds_after: the new layout's.
      state_bytes: the train state's bytes.
      bytes_moved: what the plan moves (0 where nothing was planned).
      bytes_kept: what the plan keeps in place.
      plan_seconds: how long planning the change took.
      decision: the :class:`Outcome`.
      policies: each :class:`Policy`'s :class:`PolicyCost`.
      growth: at an offer, the growth rule's ``Growth`` (None at other events).
      simulate_seconds: how long simulating the event took.
    """

    event: int
    minute: float
    kind: EventKind
    devices_before: int
    devices_after: int
    used_before: int
    used_after: int
    config_before: str
    config_after: str
    step_seconds_before: float | None
    step_seconds_after: float | None
    state_bytes: int
    bytes_moved: int = 0
    bytes_kept: int = 0
    plan_seconds: float = 0.0
    decision: Outcome
    policies: Mapping[Policy, PolicyCost]
    growth: Growth | None = None
    simulate_seconds: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySummary(_Record):
    """One policy over a whole replay.

    Attributes:
      goodput: ``productive_seconds / wall_seconds``.
      useful_samples: the samples of the training kept (each layout's throughput).
      stall_seconds: the seconds its changes and waits stopped training.
      lost_seconds: the training failures lost.
      productive_seconds: the training kept, less what periodic commits and checkpoints stop.
      wall_seconds: the trace's length.
    """

    goodput: float
    useful_samples: float
    stall_seconds: float
    lost_seconds: float
    productive_seconds: float
    wall_seconds: float


class TimelinePoint(NamedTuple):
    """A point of a policy's timeline (a JSON array of three numbers)."""

    minute: float
    devices: int  # the devices its layout uses from then on
    productive_seconds: float  # the training kept so far


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulationResult(_Record):
    """What ``simulate`` returns: the replay's rows and each policy's outcome.

    Attributes:
      cluster: the cluster, in words.
      model: the model profile's name.
      global_batch: samples per step.
      trace: the trace's name.
      minutes: the trace's wall-clock length.
      checkpoint: the periodic checkpoints' :class:`CheckpointInterval`.
      costs: the :class:`Costs` it ran with.
      initial_config: the first layout's label.
      assumptions: per policy, what it was charged, in sentences.
      events: an :class:`EventResult` per trace event.
      policies: each :class:`Policy`'s :class:`PolicySummary`.
      timeline: each policy's :class:`TimelinePoint` list, at the start, each change, the end.
      seconds: how long the replay took.
    """

    cluster: str
    model: str
    global_batch: int
    trace: str
    minutes: float
    checkpoint: CheckpointInterval
    costs: Costs
    initial_config: str
    assumptions: Mapping[Policy, tuple[str, ...]]
    events: tuple[EventResult, ...]
    policies: Mapping[Policy, PolicySummary]
    timeline: Mapping[Policy, tuple[TimelinePoint, ...]]
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChangeResult(_Record):
    """What ``fixed_change`` returns: one change between two given configs, each policy's cost.

    Attributes:
      cluster: the cluster, in words.
      model: the model profile's name.
      global_batch: samples per step.
      kind: the change's ``EventKind``.
      source: the config before (``ParallelConfig`` as text).
      target: the config after.
      config_before: the layout's label (the planner's microbatches).
      config_after: the new layout's label.
      devices_before: the devices of the layout before.
      devices_after: the devices of the layout after.
      state_bytes: the train state's bytes.
      bytes_moved: what the plan moves.
      bytes_kept: what it keeps in place.
      plan_seconds: how long planning took.
      step_seconds_before: the planner's seconds per step before.
      step_seconds_after: after.
      fits_before: whether the layout before fits the devices' memory.
      fits_after: whether the layout after does.
      policies: each :class:`Policy`'s :class:`PolicyCost`.
      assumptions: per policy, what it was charged, in sentences.
    """

    cluster: str
    model: str
    global_batch: int
    kind: EventKind
    source: str
    target: str
    config_before: str
    config_after: str
    devices_before: int
    devices_after: int
    state_bytes: int
    bytes_moved: int
    bytes_kept: int
    plan_seconds: float
    step_seconds_before: float
    step_seconds_after: float
    fits_before: bool
    fits_after: bool
    policies: Mapping[Policy, PolicyCost]
    assumptions: Mapping[Policy, tuple[str, ...]]
