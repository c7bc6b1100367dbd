"""What the launcher and its processes share: the job's description and the launch's options.

:class:`JobSpec` is what each worker process is told (one JSON environment variable); the
:class:`LaunchOptions` are what ``tenplex-jax launch`` reads from its command line; the names are
the run directory's control files and the environment variables both sides read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import sys
from collections.abc import Mapping

from tenplex_jax._src.errors import LaunchError
from tenplex_jax._src.multihost.rundir import Source

__all__ = ["JobSpec", "LaunchOptions"]

ENV = "TENPLEX_JOB"  # the launcher passes the whole job description as one JSON variable
CONTROL = "control.json"  # in the run dir: the launcher's Request to end the generation
CHECKPOINT = "checkpoint.json"  # in the run dir: the script's own checkpoint dir, for fallbacks


class Action(enum.StrEnum):
    """Why a generation ends at a step boundary: the launcher asked (``RESIZE``, ``STOP``), or
    JAX's preemption notice reached its sync point (``PREEMPTED``)."""

    RESIZE = "resize"
    STOP = "stop"
    PREEMPTED = "preempted"


@dataclasses.dataclass(frozen=True)
class Request:
    """The launcher's request to end a generation (``RUN_DIR/control.json``, or from
    ``RUN_DIR/resize`` and SIGTERM): ``action`` at a step boundary, for ``processes`` next."""

    action: Action
    processes: int


@dataclasses.dataclass(frozen=True)
class Restore:
    """Where a generation restores from (``JobSpec.restore``).

    Attributes:
      source: the stores, the orbax checkpoint or the script's ``init``.
      step: the version's or the checkpoint's step (0 for ``init``).
    """

    source: Source
    step: int = 0


# set for a standby process: it imports, then waits for its rank; the launcher's run dir, where
# it says when it has imported (``warm-<pid>``), or "1"
STANDBY = "TENPLEX_STANDBY"


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the launcher tells each worker process of a generation.

    Passed as one JSON environment variable (``TENPLEX_JOB``): :meth:`to_env` writes it,
    :meth:`from_env` reads it back (``LaunchedJob`` refuses to start without it).

    Attributes:
      coordinator: ``"host:port"`` of the ``jax.distributed`` coordination service (the
        launcher's when ``hosted``, else process 0's).
      process_id: this process's index in the generation.
      num_processes: processes in the generation.
      devices_per_process: devices each process uses.
      generation: the generation's number, from 0.
      slots: each process's host slot (its tensor store), by process index.
      stores: slot -> address, for every store that is up.
      replicas: store copies of every shard beyond the writer's.
      commit_every: steps between commits to the stores.
      restore: where the state comes from (a :class:`Restore`).
      run_dir: the launcher's run directory (control files, progress, logs).
      checkpoint_dir: the orbax checkpoint directory, if any.
      checkpoint_every: steps between orbax checkpoints, if any.
      token_file: a file holding the stores' secret (readable by this job's user only), if
        the stores need one.
      executables: whether the processes share their compiled steps through
        ``RUN_DIR/executables`` (one compiles a layout, the others and later generations load
        it; process 0 compiles ahead for the loss of any one process).
      hosted: the launcher runs the coordination service, and a process that survives the
        generation stays for the next one (see ``LaunchOptions.keep``); else process 0 runs it.
      central: every object of a commit or a live version goes to one store, the first
        process's (see ``LaunchOptions.central``).
    """

    coordinator: str
    process_id: int
    num_processes: int
    devices_per_process: int
    generation: int
    slots: tuple[int, ...]
    stores: dict[int, str]
    replicas: int
    commit_every: int
    restore: Restore
    run_dir: str
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    token_file: str | None = None
    executables: bool = True
    hosted: bool = False
    central: bool = False

    def to_env(self) -> dict[str, str]:
        """The environment a worker is started with: ``{"TENPLEX_JOB": <this record as JSON>}``."""
        record = dataclasses.asdict(self)
        record["stores"] = {str(k): v for k, v in self.stores.items()}
        return {ENV: json.dumps(record, sort_keys=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> JobSpec | None:
        """The spec a launcher passed to this process.

        Args:
          environ: the environment (``os.environ``).

        Returns:
          The spec, or ``None`` when the process was not started by a launcher.

        Raises:
          ValueError: the variable is not JSON (``json.JSONDecodeError``); ``KeyError`` or
            ``TypeError`` when it lacks a field: only a launcher writes it.
        """
        text = environ.get(ENV)
        if not text:
            return None
        record = json.loads(text)
        record["slots"] = tuple(record["slots"])
        record["stores"] = {int(k): v for k, v in record["stores"].items()}
        restore = record["restore"]
        record["restore"] = Restore(source=Source(restore["source"]), step=restore["step"])
        return cls(**record)

    @property
    def slot(self) -> int:
        """This process's host slot: the index of its own tensor store."""
        return self.slots[self.process_id]

    def token(self) -> str | None:
        """The stores' token, read from ``token_file``; ``None`` when the stores need none.

        Raises:
          OSError: the token file cannot be read.
        """
        if self.token_file is None:
            return None
        return pathlib.Path(self.token_file).read_text().strip()


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How to launch a job: what ``tenplex-jax launch`` reads from its command line.

    Example::

        options = LaunchOptions(script="train.py", args=("--steps", "1000"), nprocs=4)
        status = tj.multihost.launch(options)      # 0: done or stopped

    Attributes:
      script: the training script, run as ``__main__`` in every worker.
      args: its command-line arguments.
      nprocs: processes (host slots) of generation 0.
      devices_per_proc: devices each process uses.
      replicas: store copies of every shard beyond the writer's (0: none survive a failure).
      commit_every: steps between commits of the state to the stores.
      max_restarts: failures survived before the launcher gives up.
      min_procs: the fewest slots a generation may run on.
      run_dir: the run directory (logs, events, control files; default: a fresh temporary one).
      checkpoint_dir: the orbax checkpoint directory, the fallback when no replica survives.
      checkpoint_every: steps between orbax checkpoints (with ``checkpoint_dir``).
      store_dir: the stores' disk tier (default ``RUN_DIR/stores``).
      compile_cache: JAX's persistent compilation cache directory, shared by the generations.
      token: the stores refuse clients without the job's secret (always on Ray).
      executables: share compiled steps through ``RUN_DIR/executables`` (see
        :class:`JobSpec`); False compiles every layout in every process, as a plain restart.
      standby: keep one warm standby process per host slot, and a spare for a new slot (JAX
        and the script's imports loaded, waiting for a rank), for the next generation, so that
        a restart costs no process start or import.
      keep: the processes that stay in the next generation keep running: at a failure or a
        planned change they leave the generation's ``jax.distributed`` job and join the next
        one in the same process (the coordination service runs in the launcher, so no
        process's death takes another with it). False ends every process with its generation,
        as a plain restart does.
      live: at a failure, the survivors (with ``keep``) write the state of their last
        completed step from memory (a live version), which the next generation restores when
        every shard has a holder among them; False restores the last commit, losing the steps
        since.
      central: Tenplex-Central, the paper's baseline: one process gathers the state and sends
        each new process its shards. Every object of a commit (and of a failure's live version)
        goes to the first process's store alone, which then serves every process's pull; no
        replicas. For comparisons: that store and its host carry every byte, and a lost first
        slot loses the commit.
      grace: seconds the survivors of a failure get before SIGKILL (without ``keep``; on CPU
        they hang in gloo collectives with the dead peer, which never time out).
      stop_timeout: seconds the workers get to commit and exit on a planned end.
      start_timeout: seconds a store gets to listen.
      python: the interpreter of the stores and workers.

    Raises:
      LaunchError: a count or ``grace`` is out of range (the message names the field).
    """

    script: str
    args: tuple[str, ...] = ()
    nprocs: int = 2
    devices_per_proc: int = 2
    replicas: int = 1
    commit_every: int = 10
    max_restarts: int = 3
    min_procs: int = 1
    run_dir: pathlib.Path | None = None
    checkpoint_dir: pathlib.Path | None = None
    checkpoint_every: int | None = None
    store_dir: pathlib.Path | None = None
    compile_cache: pathlib.Path | None = None
    token: bool = False
    executables: bool = True
    standby: bool = True
    keep: bool = True
    live: bool = True
    central: bool = False
    grace: float = 0.0
    stop_timeout: float = 300.0
    start_timeout: float = 60.0
    python: str = sys.executable

    def __post_init__(self):
        least = dict.fromkeys(("nprocs", "devices_per_proc", "commit_every", "min_procs"), 1)
        least |= dict.fromkeys(("replicas", "max_restarts", "grace"), 0)
        for name, low in least.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
                raise LaunchError(f"LaunchOptions.{name} is a number >= {low:g}, got {value!r}")
