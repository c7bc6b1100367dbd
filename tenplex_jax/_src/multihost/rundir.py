"""The run directory: what the launcher and its processes write there, as typed records, and
:class:`RunDir`, which reads them back (docs/multihost.md, "The run directory").

Every record is a frozen dataclass written as ``dataclasses.asdict`` JSON, atomically (a reader
sees all of it or nothing), to ``RUN_DIR/<FILE>-g<generation>-p<process>.json``. Importing this
needs no JAX: the launcher reads the records too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
from typing import ClassVar

__all__ = [
    "Ahead",
    "FirstStep",
    "LiveReport",
    "Progress",
    "PullReport",
    "RestoreReport",
    "RunDir",
    "RunEvent",
    "Source",
]


class RunEvent(enum.StrEnum):
    """The kinds of the launcher's events (``RUN_DIR/events.jsonl``; a generation ends with
    ``FINISHED``, ``FAILURE``, ``RESIZE`` or ``STOP``)."""

    STORES = "stores"  # stores up: per slot its pid and address
    GENERATION = "generation"  # a generation started: processes, slots, pids, restore, step, ...
    FINISHED = "finished"  # the workers finished the job
    FAILURE = "failure"  # a worker or store failed: lost_slots, detail
    RESIZE = "resize"  # a planned resize ended the generation
    STOP = "stop"  # SIGTERM: a planned stop ended it
    REQUEST = "request"  # a planned end asked for: action, processes
    IGNORED = "ignored"  # RUN_DIR/resize held no count
    GROWING = "growing"  # a planned growth's stores started early
    STANDBY = "standby"  # warm standby processes started
    STANDBY_LOST = "standby_lost"  # a standby died before it was needed
    REPLICAS_LOST = "replicas_lost"  # no copy of some shards survives: step, leaves
    REWIND = "rewind"  # the survivors' memory cannot serve the state: why, leaves, step
    FALLBACK = "fallback"  # restoring the orbax checkpoint instead
    OFFER = "offer"  # on Ray, nodes joined: the growth rule's numbers and decision
    ERROR = "error"  # the launcher gave up
    INTERRUPTED = "interrupted"  # Ctrl-C


class Source(enum.StrEnum):
    """Where a generation's state comes from."""

    INIT = "init"  # the script's init(): nothing was committed yet
    LIVE = "live"  # the survivors' memory at their last completed step, through the stores
    STORE = "store"  # the latest complete version in the tensor stores
    CHECKPOINT = "checkpoint"  # the orbax checkpoint


@dataclasses.dataclass(frozen=True)
class PullReport:
    """Bytes one process read from the stores for its shards, by where they came from."""

    step: int
    nbytes: dict[str, int]  # "local" / "remote" slot; "writer" / "replica" copy
    by_slot: dict[int, int]
    skipped: tuple[str, ...]  # stores that could not serve a piece, and why
    replica_for_lost_writer: int  # bytes read from a replica because the writer's store failed
    seconds: float
    # the version's bytes each slot's store holds (its objects' copies): what the commit, or the
    # survivors' live writes, sent there
    held_by_slot: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """How a process got its generation's state at ``job.start`` (``job.restored``):
    ``RUN_DIR/restore-g<gen>-p<id>.json``. The times are wall-clock (``time.time()``).

    Attributes:
      source: where from.
      step: the step restored (0 from init).
      config: the generation's parallel config.
      process: the process's index in the generation.
      warm: a standby or a survivor took this rank (no process start or import).
      kept: a process of an earlier generation took it.
      state_bytes: the whole state's bytes.
      seconds: how long the restore took.
      started: when the process started, or a waiting process got its rank.
      joined: when it had joined ``jax.distributed``.
      restoring: when ``job.start`` began restoring (the script's set-up is before).
      restored: when the state was on the devices.
      pull: with ``source`` the stores, the bytes read and where from.
    """

    FILE: ClassVar[str] = "restore"
    source: Source
    step: int
    config: str
    process: int
    warm: bool
    kept: bool
    state_bytes: int
    seconds: float
    started: float
    joined: float | None
    restoring: float
    restored: float
    pull: PullReport | None = None

    @classmethod
    def from_json(cls, record: dict) -> RestoreReport:
        """The record from its JSON (``dataclasses.asdict``)."""
        pull = record.get("pull")
        if pull is not None:
            slots = {  # JSON's keys are strings
                key: {int(k): v for k, v in pull.get(key, {}).items()}
                for key in ("by_slot", "held_by_slot")
            }
            pull = PullReport(**pull | slots | {"skipped": tuple(pull["skipped"])})
        return cls(**record | {"source": Source(record["source"]), "pull": pull})


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """How a process got its generation's step (``RUN_DIR/step-g<gen>-p<id>.json``), written
    after its first step.

    Attributes:
      loaded: loaded from the executable cache (``RUN_DIR/executables``), not compiled.
      traced: traced the step (False: a survivor loaded a program it had lowered before).
      seconds: compiling or loading it.
      compiles: the job's compiles so far.
      loads: its loads from the cache.
    """

    FILE: ClassVar[str] = "step"
    loaded: bool
    traced: bool
    seconds: float
    compiles: int
    loads: int


@dataclasses.dataclass(frozen=True)
class Ahead:
    """The step of the generation after the loss of any one process is ready in this process
    before the loss (``RUN_DIR/ahead-g<gen>-p<id>.json``): process 0 compiled it (or loaded it),
    another process lowered and remembered it.

    Attributes:
      processes: that generation's processes (this one's less one).
      compiled: process 0's record (else a lowering).
    """

    FILE: ClassVar[str] = "ahead"
    processes: int
    compiled: bool


@dataclasses.dataclass(frozen=True)
class Grown:
    """Whether a process lowered an announced growth's step ahead, or why not
    (``RUN_DIR/grown-g<gen>-p<id>.json``): the launcher waits for every process's."""

    FILE: ClassVar[str] = "grown"
    processes: int
    remembered: bool
    why: str | None = None


@dataclasses.dataclass(frozen=True)
class LiveReport:
    """What a survivor of a failure kept of its generation's state
    (``RUN_DIR/live-g<gen>-p<id>.json``), written before it leaves the generation: the live
    version of its last completed step that it wrote to its store, or why there is none.

    Attributes:
      step: the step of the state it kept (None: no completed state was left).
      newest: its newest completed step (the steps beyond ``step`` the next generation loses).
      objects: the boxes it wrote to its store (those no survivor before it in order holds).
      nbytes: their bytes.
      seconds: the copy to host and the writes.
      orphans: leaves some box of which no survivor holds (they force a rewind to a commit).
      why: why nothing was kept, or None.
    """

    FILE: ClassVar[str] = "live"
    step: int | None
    newest: int | None
    objects: int
    nbytes: int
    seconds: float
    orphans: tuple[str, ...] = ()
    why: str | None = None

    @classmethod
    def from_json(cls, record: dict) -> LiveReport:
        """The record from its JSON (``dataclasses.asdict``)."""
        return cls(**record | {"orphans": tuple(record.get("orphans", ()))})


@dataclasses.dataclass(frozen=True)
class Progress:
    """Process 0's progress (``RUN_DIR/progress.json``), after every step: the launcher's lost
    steps, and on Ray the step time and the steps left that its growth rule weighs.

    Attributes:
      generation: the generation.
      step: steps done.
      steps: the job's planned steps, if known.
      time: when (wall clock).
      first_time: the generation's first record's time.
      first_step: its step (one read gives a step time, whatever polls missed).
    """

    FILE: ClassVar[str] = "progress"
    generation: int
    step: int
    steps: int | None
    time: float
    first_time: float
    first_step: int


def write(path: pathlib.Path, record) -> None:
    """Write ``record`` (a dataclass, or a dict) as JSON at ``path`` atomically."""
    if dataclasses.is_dataclass(record):
        record = dataclasses.asdict(record)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def record_path(run_dir, cls, generation: int | None = None, process: int | None = None):
    """Where a record of class ``cls`` lives: ``RUN_DIR/<FILE>[-g<gen>][-p<id>].json``."""
    parts = [cls.FILE] + [
        f"{k}{v}" for k, v in (("g", generation), ("p", process)) if v is not None
    ]
    return pathlib.Path(run_dir) / ("-".join(parts) + ".json")


class RunDir:
    """A launcher's run directory, read: its events and the records above.

    Example::

        run = tj.multihost.RunDir("out/run")
        [e["restore"] for e in run.events(RunEvent.GENERATION)]     # ["init", "store", ...]
        run.restored(generation=1, process=0).seconds            # process 0's restore, in s

    Args:
      path: the directory (``--run-dir``).
    """

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def read(self, cls, generation: int | None = None, process: int | None = None):
        """A record, or None while there is none (or it is not whole yet).

        Args:
          cls: its class (:class:`RestoreReport`, :class:`FirstStep`, :class:`Progress`, ...).
          generation: its generation (None for a record of the run: :class:`Progress`).
          process: its process in the generation.
        """
        try:
            record = json.loads(record_path(self.path, cls, generation, process).read_text())
        except (OSError, ValueError):
            return None
        return cls.from_json(record) if hasattr(cls, "from_json") else cls(**record)

    def events(self, kind: RunEvent | None = None) -> list[dict]:
        """The launcher's events so far, oldest first (those of ``kind`` only, if given)."""
        try:
            lines = (self.path / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if kind is None or e["event"] == kind]

    def restored(self, generation: int, process: int = 0) -> RestoreReport | None:
        """How ``process`` of ``generation`` got its state, once it has."""
        return self.read(RestoreReport, generation, process)

    def first_steps(self, generation: int) -> list[FirstStep]:
        """How each process of ``generation`` got its step, by process, as far as they have."""
        steps = []
        while (step := self.read(FirstStep, generation, len(steps))) is not None:
            steps.append(step)
        return steps

    def ahead(self, generation: int, processes: int) -> bool:
        """Whether every one of the first ``processes`` processes of ``generation`` has the
        step of the generation after a loss ready (:class:`Ahead`)."""
        return all(record_path(self.path, Ahead, generation, p).exists() for p in range(processes))
