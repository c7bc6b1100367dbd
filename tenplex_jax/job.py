"""The worker side of a launched job: ``job = tj.launch.join()``.

A script started by ``tenplex-jax launch`` calls :func:`join` before it touches JAX. ``join`` reads
the launcher's environment, configures the CPU backend (``jax_num_cpu_devices``, gloo collectives)
and initializes ``jax.distributed`` with the coordinator on 127.0.0.1. The :class:`Job` it returns
restores the train state — pulling exactly this process's shards from the tensor stores, or from
the orbax checkpoint when the stores lost a shard, or building it on the first start — commits it
back asynchronously, and tells the loop when the launcher wants the generation to end::

    job = tj.launch.join()
    state, ptc, step = job.restore(abstract_state, rules, dataset, init=init_state)
    train_step = make_train_step(graphdef, ptc, layout)      # the config depends on the processes
    while step < steps:
        batch, weights, _ = tj.device_batch(dataset, step, layout, ptc.mesh())
        dataset.step = step = step + 1
        state, loss = train_step(state, batch, weights)
        if job.after_step(state, ptc, step, dataset):       # commit every K steps; planned stop
            break
    job.finish(state, ptc, step, dataset)

Run without the launcher, ``join`` gives a one-process job that trains on the local devices and
commits nothing, so the same script runs alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from tenplex_jax.data import DatasetPTC, DataState
from tenplex_jax.errors import DataError, LayoutError, StoreError
from tenplex_jax.ptc import PTC, ParallelConfig, Rules

ENV = "TENPLEX_JOB"  # the launcher passes the whole job description as one JSON variable
CONTROL = "control.json"  # in the run dir: the launcher's request to end the generation
ACTIONS = ("resize", "stop")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the launcher tells each worker process of a generation."""

    coordinator: str  # "127.0.0.1:port" of the jax.distributed coordinator (process 0)
    process_id: int
    num_processes: int
    devices_per_process: int
    generation: int
    slots: tuple[int, ...]  # process -> host slot (its tensor store)
    stores: dict[int, str]  # slot -> address, for every store that is up
    replicas: int
    commit_every: int
    restore: str  # "init", "store:<step>" or "checkpoint:<step>"
    run_dir: str
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None

    def to_env(self) -> dict[str, str]:
        record = dataclasses.asdict(self)
        record["stores"] = {str(k): v for k, v in self.stores.items()}
        return {ENV: json.dumps(record, sort_keys=True)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> JobSpec | None:
        text = environ.get(ENV)
        if not text:
            return None
        record = json.loads(text)
        record["slots"] = tuple(record["slots"])
        record["stores"] = {int(k): v for k, v in record["stores"].items()}
        return cls(**record)

    @property
    def slot(self) -> int:
        return self.slots[self.process_id]


def join(*, timeout: float = 120.0) -> Job:
    """Join the job this process was launched into; call before JAX starts its backend.

    Sets ``jax_num_cpu_devices`` to the launcher's devices per process, gloo CPU collectives, and
    ``jax.distributed.initialize`` with the launcher's coordinator, process id and count. Without
    the launcher's environment, a standalone one-process job.
    """
    import jax

    spec = JobSpec.from_env(os.environ)
    if spec is None:
        return Job(None)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", spec.devices_per_process)
    jax.distributed.initialize(
        spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        initialization_timeout=int(timeout),
    )
    job = Job(spec)
    job.times["joined"] = time.time()
    return job


def default_config(num_devices: int, abstract_state, rules: Rules) -> ParallelConfig:
    """The ``(data, fsdp)`` mesh of ``num_devices`` with the most FSDP that lays the state out.

    FSDP shards the state over every device, so each process commits and pulls only its share;
    the data-parallel axis takes the rest. Pass ``config=`` to :meth:`Job.restore` to choose
    otherwise (e.g. ``tenplex_jax.demo.choose_config`` asks the planner).
    """
    refused = []
    for fsdp in sorted(
        (d for d in range(1, num_devices + 1) if num_devices % d == 0), reverse=True
    ):
        config = ParallelConfig(data=num_devices // fsdp, fsdp=fsdp)
        try:
            PTC.of(abstract_state, rules, config, range(num_devices))
        except LayoutError as error:
            refused.append(f"{config}: {str(error).split(';')[0]}")
            continue
        return config
    raise LayoutError(f"no (data, fsdp) mesh of {num_devices} devices fits the state: {refused}")


class Job:
    """One process's handle on a launched job (see the module docstring)."""

    def __init__(self, spec: JobSpec | None):
        self.spec = spec
        self.committer = None
        self.clients: dict[int, Any] = {}
        self.last_commit: int | None = None
        self.restored: dict | None = None  # what restore did: source, step, seconds, bytes
        self._checkpointed: int | None = None  # the newest orbax step, as this process knows
        # wall-clock times of this process's start-up, for the recovery benchmark's breakdown
        self.times: dict[str, float] = {"started": _process_start()}

    # -- who am I ------------------------------------------------------------------------------

    @property
    def process_index(self) -> int:
        return 0 if self.spec is None else self.spec.process_id

    @property
    def num_processes(self) -> int:
        return 1 if self.spec is None else self.spec.num_processes

    @property
    def generation(self) -> int:
        return 0 if self.spec is None else self.spec.generation

    @property
    def run_dir(self) -> pathlib.Path | None:
        return None if self.spec is None else pathlib.Path(self.spec.run_dir)

    # -- restore ---------------------------------------------------------------------------------

    def restore(
        self,
        abstract_state,
        rules: Rules,
        dataset: DatasetPTC | None = None,
        *,
        init: Callable[[], Any],
        config: ParallelConfig | Callable[[int], ParallelConfig] | None = None,
    ) -> tuple[Any, PTC, int]:
        """(state, ptc, step): the job's state laid out over this generation's devices.

        ``abstract_state`` gives the tree, shapes, dtypes and logical axes (``nnx.eval_shape``);
        ``config`` the layout for this generation's device count (default :func:`default_config`).
        The state comes from the launcher's choice: the latest complete version in the stores (each
        process pulls its own shards: its own store first, then the writer's, then replicas), the
        orbax checkpoint, or ``init()`` jitted straight into the layout on the first start.
        ``dataset`` resumes at the restored step.
        """
        import jax

        tic = time.perf_counter()
        self.times["restore"] = time.time()
        devices = jax.devices()
        if config is None:
            config = default_config(len(devices), abstract_state, rules)
        elif callable(config):
            config = config(len(devices))
        ptc = PTC.of(abstract_state, rules, config, devices)
        source = "init" if self.spec is None else self.spec.restore
        kind, _, at = source.partition(":")
        record: dict[str, Any] = {
            "source": kind,
            "config": str(config),
            "process": self.process_index,
        }
        if kind == "init":
            state, step, data_state = jax.jit(init, out_shardings=ptc.shardings())(), 0, None
        elif kind == "store":
            state, step, data_state, pulled = self._pull(ptc, int(at))
            record["pull"] = dataclasses.asdict(pulled)
        elif kind == "checkpoint":
            from tenplex_jax.checkpoint import restore_checkpoint

            restored = restore_checkpoint(self.spec.checkpoint_dir, ptc, step=int(at))
            state, step, data_state = restored.state, restored.step, restored.data_state
        else:
            raise StoreError(f"unknown restore source {source!r} from the launcher")
        if dataset is not None:
            if data_state is not None:
                dataset.restore(data_state)
            else:
                dataset.step = step
        jax.block_until_ready(state)
        record |= {"step": step, "state_bytes": ptc.nbytes, "seconds": time.perf_counter() - tic}
        self.times["restored"] = time.time()
        record["times"] = dict(self.times)
        self.restored = record
        self.last_commit = step if kind != "init" else None
        self._write(f"restore-g{self.generation}-p{self.process_index}.json", record, every=True)
        if self.spec is not None:
            self._start_committer()
            if self.spec.checkpoint_dir is not None:  # read before any process of this
                from tenplex_jax.checkpoint import latest_checkpoint  # generation saves

                self._checkpointed = latest_checkpoint(self.spec.checkpoint_dir)
        return state, ptc, step

    def _pull(self, ptc: PTC, step: int):
        import jax

        from tenplex_jax.commit import pull, read_manifest

        self._connect()
        manifest = read_manifest(self.clients, step)
        if manifest is None:
            raise StoreError(f"no live store has the manifest of version {step}")
        arrays, report = pull(self.clients, manifest, ptc, self.spec.slot)
        state = jax.tree_util.tree_unflatten(ptc.treedef, arrays)
        return state, manifest.step, manifest.data_state, report

    def _connect(self) -> None:
        from tenplex_jax.store import StoreClient

        for slot, address in self.spec.stores.items():
            if slot not in self.clients:
                try:
                    self.clients[slot] = StoreClient(address, timeout=60.0)
                except (StoreError, OSError):
                    continue

    def _start_committer(self) -> None:
        from tenplex_jax.commit import Committer
        from tenplex_jax.store import ReplicatedStore

        self._connect()
        spec = self.spec
        missing = [s for s in spec.slots if s not in self.clients]
        if missing:
            raise StoreError(f"the stores of slots {missing} of this generation are not reachable")
        replicas = min(spec.replicas, len(spec.slots) - 1)
        replicated = ReplicatedStore([spec.stores[s] for s in spec.slots], replicas=replicas)
        stores = [self.clients[s] for s in spec.slots]
        self.committer = Committer(spec.process_id, spec.slots, stores, replicated, replicas)

    # -- commit ----------------------------------------------------------------------------------

    def commit(
        self,
        state,
        ptc: PTC,
        step: int,
        dataset: DatasetPTC | None = None,
        *,
        wait: bool = False,
        checkpoint: bool | None = None,
    ) -> None:
        """Commit ``state`` at ``step`` to the stores; in the background unless ``wait``.

        Every process calls it at the same step. The shards are copied to host memory before this
        returns, so the next train step may donate ``state``. ``checkpoint`` also saves an orbax
        checkpoint (default: every ``--checkpoint-every`` steps, when the job has a checkpoint dir).
        """
        data_state = None
        if dataset is not None:
            if dataset.step != step:
                raise DataError(
                    f"the dataset has delivered {dataset.step} global batches but the state is "
                    f"committed at step {step}: commit after setting dataset.step for the batch "
                    "the step trained on"
                )
            data_state = dataset.state()
        if self.spec is None:
            return
        self.committer.commit(state, ptc, step, data_state, wait=wait)
        self.last_commit = step
        every = self.spec.checkpoint_every
        if checkpoint is None:
            checkpoint = every is not None and step % every == 0
        if checkpoint:
            self._checkpoint(state, ptc, step, data_state)

    def _checkpoint(self, state, ptc: PTC, step: int, data_state: DataState | None) -> None:
        """An orbax checkpoint of ``step`` unless there is one: every process decides alike, from
        what it saw at restore and what it saved since (a directory listing could lag behind the
        other processes' saves and split the collective save)."""
        if self.spec.checkpoint_dir is None or self._checkpointed == step:
            return
        from tenplex_jax.checkpoint import save_checkpoint

        save_checkpoint(self.spec.checkpoint_dir, state, ptc, step=step, data_state=data_state)
        self._checkpointed = step

    def wait(self) -> None:
        """Finish the commit in flight, if any (raises what it raised)."""
        if self.committer is not None:
            self.committer.wait()

    def stop_requested(self) -> str | None:
        """``"resize"`` or ``"stop"`` when the launcher asked this generation to end, else None.

        A collective: every process calls it at the same step and gets process 0's answer, so all
        of them stop at the same step.
        """
        if self.spec is None:
            return None
        import numpy as np
        from jax.experimental import multihost_utils

        code = 0
        if self.process_index == 0:
            try:
                action = json.loads((self.run_dir / CONTROL).read_text()).get("action")
                code = ACTIONS.index(action) + 1 if action in ACTIONS else 0
            except (OSError, ValueError):
                code = 0
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        return ACTIONS[code - 1] if code else None

    def after_step(self, state, ptc: PTC, step: int, dataset: DatasetPTC | None = None) -> bool:
        """Call after every train step; True when the loop must end (the launcher asked).

        Records progress, commits every ``--commit-every`` steps in the background, and on a
        planned resize or stop commits synchronously (no step is lost) before returning True.
        """
        if self.spec is None:
            return False
        self._write("progress.json", {"generation": self.generation, "step": step,
                                      "time": time.time()})  # fmt: skip
        action = self.stop_requested()
        if action is not None:
            self.commit(state, ptc, step, dataset, wait=True, checkpoint=action == "stop")
            self._write("stopped.json", {"generation": self.generation, "step": step,
                                         "action": action})  # fmt: skip
            return True
        if step % self.spec.commit_every == 0:
            self.commit(state, ptc, step, dataset)
        return False

    def finish(self, state, ptc: PTC, step: int, dataset: DatasetPTC | None = None) -> None:
        """End of training: wait for commits, save a final orbax checkpoint (with a checkpoint
        dir), and tell the launcher the job is done."""
        if self.spec is None:
            return
        if self.committer is not None:
            self.committer.wait(collect=True)
        self._checkpoint(state, ptc, step, None if dataset is None else dataset.state())
        self._write("finished.json", {"generation": self.generation, "step": step})

    def _write(self, name: str, record: dict, *, every: bool = False) -> None:
        """Atomically write a JSON record into the run dir (process 0 only unless ``every``)."""
        if self.spec is None or not (every or self.process_index == 0):
            return
        path = self.run_dir / name
        tmp = path.with_name(f".{name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, default=_json_default))
        os.replace(tmp, path)


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()


def _json_default(value):
    if isinstance(value, DataState):
        return dataclasses.asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)
