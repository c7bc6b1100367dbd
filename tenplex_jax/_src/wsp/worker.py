"""A virtual worker (HetPipe's VW): a group of devices training with wave synchronous parallel.

A VW owns its devices' mesh (no collective with any other VW), its copy of the weights and its
own optimizer state, and synchronizes with the others only through the parameter server
(:mod:`~tenplex_jax._src.wsp.ps`) and the ledger (:mod:`~tenplex_jax._src.wsp.ledger`). Its
``Nm`` minibatches are in flight as in HetPipe's pipeline: minibatch ``p`` reads the local
weights holding its own updates up to ``p - Nm``, and its update (``step(read) - read``, the
user's step at the weights it read, with the optimizer state as it is when it lands) lands on the
local weights as they are then. Wave ``k`` is its minibatches ``k Nm .. k Nm + Nm - 1``:

1. while wave ``k - 1``'s updates land one at a time, wave ``k``'s first ``Nm - 1`` minibatches
   read their weights, each after one more of them;
2. when the last has landed, the VW **pushes** wave ``k - 1``'s change of the weights on a thread
   of its own, beside wave ``k``'s compute; pushes commit in order, and a pull does not wait for
   the one in flight (its update is added where the stores lack it);
3. **WSP**: the weights wave ``k``'s last minibatch reads hold every VW's waves before ``k - D``:
   if its last pull did not, it waits until the slowest member has committed ``k - D`` waves
   and **pulls** the global weights;
4. it **claims** wave ``k``'s minibatches from the ledger (a lease ahead while the push is in
   flight), and the last of them reads the weights.

With a ``wave_step`` and a ``pipe`` axis, a wave runs as one program (its minibatches in the
pipeline together, each on the weights it read); otherwise one ``train_step`` per minibatch, on
the same schedule; with ``pipeline="unbroken"``, HetPipe's pipeline carried across waves
(:mod:`~tenplex_jax._src.wsp.unbroken`), with the same pushes, pulls and records. The optimizer
state (every leaf not under ``part``) is kept across pulls and shared for joiners
(:mod:`~tenplex_jax._src.wsp.optimizer`). ``docs/wsp.md`` states the contract.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tenplex_jax._src import tree
from tenplex_jax._src.batch import BATCH_AXES, Batch, device_batch
from tenplex_jax._src.data import BatchLayout, DatasetPTC
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.executor import place
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules
from tenplex_jax._src.wsp import optimizer, unbroken, waves
from tenplex_jax._src.wsp.group import Group
from tenplex_jax._src.wsp.ledger import Beats, Ledger, Start
from tenplex_jax._src.wsp.memory import MemoryMonitor, MemoryUse, device_limit
from tenplex_jax._src.wsp.options import WorkerOptions
from tenplex_jax._src.wsp.prefetch import Prefetcher
from tenplex_jax._src.wsp.ps import ParameterServer
from tenplex_jax._src.wsp.waves import Read, Wave, WaveRecord, delta, landed, replaced

WAIT_SECONDS = 1.0  # the longest a waiting VW blocks on the ledger before it looks again


@dataclasses.dataclass(frozen=True)
class _Leaves:
    """The state's leaves by role, as indices in :func:`tree.arrays` order."""

    paths: tuple[str, ...]
    weights: tuple[int, ...]  # under ``part``: what the parameter server holds
    others: tuple[int, ...]  # the optimizer state: the VW's own, shared through the stores
    stacked: frozenset[int]  # padded for uneven stages on the VW, unpadded everywhere else


@dataclasses.dataclass
class _Progress:
    """Where the VW's loop is."""

    clock: int = 0  # waves pushed (the ledger's clock)
    fresh: int = 0  # the slowest member's clock at the last pull (every VW's waves held)
    members: frozenset[str] = frozenset()  # the ledger's members at the last pull
    applied: int = 0  # own updates landed
    started: int = 0  # own minibatches started
    changes: int = 0  # changes to the weights (updates and pulls): which reads are current


@dataclasses.dataclass
class _Background:
    """What the VW's communication threads (Hydrozoa's, beside its compute) have in flight."""

    push: concurrent.futures.Future | None = None  # the push in flight, on its thread
    copied: concurrent.futures.Future | None = None  # its (wave, update on the host), once there
    waits: float = 0.0  # seconds waited for pushes in flight, in all
    waited: float = 0.0  # ``waits`` when the last push started
    share: threading.Thread | None = None  # the optimizer share being written
    shared: int | None = None  # the clock of the last share written
    beats: Beats = dataclasses.field(default_factory=Beats)  # the members' heartbeats as seen
    watched: float = -math.inf  # when they were last read (monotonic)


class VirtualWorker:
    """A VW named ``name`` on ``devices`` (laid out as ``config``) in the job on ``ps``.

    Built (its state laid out, its step compiled) when made; :meth:`run` joins the job and
    trains. Example::

        worker = VirtualWorker("vw1", ps, rules, dataset, init, train_step,
                               devices=jax.devices()[:4], config=tj.ParallelConfig(pipe=2, data=2),
                               options=WorkerOptions(minibatches=4, distance=1))
        records = worker.run()

    Args:
      name: the VW's name, unique in the job.
      ps: the job's :class:`ParameterServer` client (this VW's own).
      rules: the state's logical-axis rules, as for ``tj.ElasticJob``.
      dataset: the :class:`tenplex_jax.DatasetPTC`: minibatch ``k`` is its global batch ``k``.
      init: ``init()`` gives the train state (``{"model": ..., "optimizer": ...}``), built
        straight into the layout; or ``init`` is that state (one built for every VW: placed,
        not rebuilt).
      train_step: ``train_step(state, batch) -> (state, metrics)``, one step on a ``tj.Batch``
        (``metrics["loss"]`` is recorded), as for ``tj.ElasticJob``.
      devices: the VW's devices, in mesh order.
      config: the :class:`tenplex_jax.ParallelConfig` laid out over them.
      options: the :class:`WorkerOptions` (``Nm``, ``D``, slowdown, timeout, stages, ...).

    Attributes:
      records: the :class:`WaveRecord` of every wave pushed (each added when its push is done).
      push_waits: seconds the VW waited for a push in flight (before the next push, a pull or
        leaving): the communication its compute did not hide.
      crashed: a ``threading.Event``: set it to end the VW at once, as a crash.
      dropped: whether the ledger dropped this VW.
      optimizer_from: ``(vw, wave)`` of the optimizer state it took when it joined, or None
        (it kept ``init()``'s: none was shared).
      share_errors: the errors of optimizer shares written in the background (a joiner then
        takes an older share; the last share, when leaving, raises instead).

    Raises:
      WSPError: the state has no leaves under ``options.part`` (``"invalid"``).
    """

    def __init__(
        self,
        name: str,
        ps: ParameterServer,
        rules: Rules,
        dataset: DatasetPTC,
        init: Callable,
        train_step: Callable,
        *,
        devices: Sequence[jax.Device],
        config: ParallelConfig,
        options: WorkerOptions = WorkerOptions(),
    ):
        self.name, self.ps, self.dataset, self.options = name, ps, dataset, options
        self.group = options.group or Group()
        self.devices = list(devices)
        self.records: list[WaveRecord] = []
        self.crashed = threading.Event()  # a simulated death: stop at once, leave nothing behind
        self.dropped = False
        self.optimizer_from: tuple[str, int] | None = None
        self.share_errors: list[Exception] = []  # shares written in the background that failed
        self.progress, self.background = _Progress(), _Background()
        self._lay_out(init, rules, config)
        self.layout = BatchLayout(
            dataset.global_batch, ranks=config.data * config.fsdp, grad_units=options.grad_units
        )
        self._programs: dict[int, Callable] = {}  # a wave's minibatches -> its program, compiled
        # HetPipe's unbroken pipeline runs the waves instead of the wave program (unbroken.py)
        self.unbroken = None
        if options.pipeline == "unbroken":
            self.unbroken = unbroken.Driver(self)
        self._compile(train_step)
        self.memory = MemoryMonitor(
            name,
            self.devices,
            self._memory_use(),
            options.memory_limit,
            stages=config.pipe,
            batch=dataset.global_batch,
        )
        self.prefetcher = None
        if options.prefetch and self.group.count == 1:
            self.prefetcher = Prefetcher(name, self._claim_ahead, self._load, self._ended)

    def _memory_use(self) -> MemoryUse | None:
        """The compiled program's bytes per device: the train step's, or the wave program's
        (compiled now, where a memory limit is known, and kept: it runs every wave)."""
        if self.unbroken is not None:  # its calls are compiled as the pipeline first runs them
            return None
        if self.wave_step is None:
            return MemoryUse.of(self.step)
        n = self.options.minibatches
        if n not in self._programs and (
            self.options.memory_limit is not None or device_limit(self.devices) is not None
        ):
            weights = tuple(self._weights())
            data, batch_weights, _ = device_batch(self.dataset, 0, self.layout, self.mesh)
            args = (self.state, [weights] * n, [data] * n, [batch_weights] * n)
            program = self._program(n, args)  # jitted (compiled at its first call) or compiled
            if n not in self._programs:  # compiled now, and what every full wave then runs
                self._programs[n] = program.lower(*args).compile()
        return MemoryUse.of(self._programs[n]) if n in self._programs else None

    def _ended(self) -> bool:
        return self.crashed.is_set() or self.dropped

    def _claim_ahead(self, wave: int) -> tuple[int, ...]:
        """The prefetcher's: lease ``wave`` ahead (the ledger's rule: one past the wave whose
        push is in flight; asked again by :meth:`_claim`, the same lease comes back)."""
        nm = self.options.minibatches
        return self.ps.update(lambda now: now.claim(self.name, wave, nm))[1]

    def _load(self, minibatch: int) -> tuple:
        """Read and place ``minibatch`` on the mesh."""
        return device_batch(self.dataset, minibatch, self.layout, self.mesh)

    def _batch(self, wave: Wave, minibatch: int) -> tuple:
        """The data path: ``minibatch`` of ``wave`` read and placed (by the prefetcher, if it
        claimed its wave ahead); at a wave's first minibatch the prefetcher is asked for the
        next wave, claimed once this one's push before it has committed, and the memory
        monitor looks (once a wave: it reads every live array's shards)."""
        first = minibatch == wave.minibatches[0]
        if first:
            self.memory.observe()
        if self.prefetcher is None:
            return self._load(minibatch)
        if first:
            self.prefetcher.ahead(wave.wave + 1, self.background.push)
        placed = self.prefetcher.take(minibatch)
        return self._load(minibatch) if placed is None else placed

    def _lay_out(self, init, rules: Rules, config: ParallelConfig) -> None:
        """The state on the VW's mesh (stacked leaves padded for uneven stages), its leaves by
        role."""
        stages, stacked = self.options.stages, frozenset()
        if stages is not None:  # the stacked leaves padded for the stages, on the host
            stacked = waves.stacked_leaves(jax.eval_shape(init) if callable(init) else init, rules)
            init = waves.padded(init, stacked, stages)
        if callable(init):  # built straight into the layout
            self.ptc = PTC.of(jax.eval_shape(init), rules, config, self.devices)
            self.mesh = self.ptc.mesh(self.devices)
            self.state = jax.jit(init, out_shardings=self.ptc.shardings(self.mesh))()
        else:  # a state built once for every VW: placed
            self.ptc = PTC.of(init, rules, config, self.devices)
            self.mesh = self.ptc.mesh(self.devices)
            self.state = place(init, self.ptc)
        paths, part = tuple(leaf.path for leaf in self.ptc.leaves), self.options.part
        weights = tuple(i for i, p in enumerate(paths) if p.startswith(part + "/"))
        if not weights:
            raise WSPError(
                f"the state has no leaves under {part!r}: its paths start "
                f"{sorted({p.split('/')[0] for p in paths})}",
                "invalid",
            )
        others = tuple(sorted(set(range(len(paths))) - set(weights)))
        self.leaves = _Leaves(paths=paths, weights=weights, others=others, stacked=stacked)

    def _compile(self, train_step: Callable) -> None:
        """The train step (where it runs) and, with an executable cache, the wave program."""
        options = self.options
        self.steps = options.steps
        if self.steps is None:
            sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
            self.steps = StepCache(
                train_step, sample, self.devices, donate=False, executables=options.executables
            )
        # nothing to overlap without a pipeline
        self.wave_step = options.wave_step if self.ptc.config.pipe > 1 else None
        self.step = None  # the train step, compiled only where it runs
        if self.unbroken is not None:
            self.wave_step = None
        elif self.wave_step is None:
            self.step = self.steps.get(self.ptc, self.layout, ahead=False).result().executable
        weights = list(self._weights())
        jax.block_until_ready((landed(weights, weights, weights), delta(weights, weights)))
        if self.wave_step is not None and options.executables is not None:  # ready before it joins
            data, batch_weights, _ = device_batch(self.dataset, 0, self.layout, self.mesh)
            n = options.minibatches
            self._program(n, (self.state, [tuple(weights)] * n, [data] * n, [batch_weights] * n))

    @property
    def push_waits(self) -> float:
        """Seconds waited for pushes in flight, in all (see the class's Attributes)."""
        return self.background.waits

    # -- the weights between host and devices ------------------------------------------------

    def host_weights(self) -> dict[str, np.ndarray]:
        """The VW's current weights: :func:`weights_of` its state (stacked leaves unpadded)."""
        _, leaves, _ = tree.arrays(self.state)
        return self._host(self.leaves.weights, [leaves[i] for i in self.leaves.weights])

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Replace the VW's weights (a pull); its optimizer state stays as it is.

        Args:
          weights: leaf path -> host array for every weight leaf (what
            ``ParameterServer.pull`` returns), cast to each leaf's dtype.

        Raises:
          KeyError: a weight leaf is missing.
        """
        self._place(
            self.leaves.weights, [weights[self.leaves.paths[i]] for i in self.leaves.weights]
        )
        self.progress.changes += 1

    def _host(self, indices: Sequence[int], arrays: Sequence[jax.Array]) -> dict[str, np.ndarray]:
        """The leaves ``indices`` (``arrays``, on the devices) copied to the host as the parameter
        server and the optimizer shares hold them: by path, float32 weights, unpadded."""
        host = jax.device_get(list(arrays))
        weights = set(self.leaves.weights)
        out = {}
        for i, x in zip(indices, host):
            x = np.asarray(x, np.float32) if i in weights else np.asarray(x)
            out[self.leaves.paths[i]] = (
                x[self.options.stages.mask] if i in self.leaves.stacked else x
            )
        return out

    def _shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s shape as the parameter server and the optimizer shares hold it."""
        shape = tuple(self.ptc.leaves[i].shape)
        return (self.options.stages.num_layers,) + shape[1:] if i in self.leaves.stacked else shape

    def _place(self, indices: list[int], host: list[np.ndarray]) -> None:
        """Host arrays (unpadded) onto the devices as the state's leaves ``indices`` (padded
        where stacked; dtype and layout)."""
        stages, leaves = self.options.stages, self.ptc.leaves
        padded = [
            waves.pad_rows(x, stages) if i in self.leaves.stacked else x
            for i, x in zip(indices, host)
        ]
        arrays = [
            jax.device_put(x.astype(leaves[i].dtype), NamedSharding(self.mesh, leaves[i].spec))
            for i, x in zip(indices, padded)
        ]
        self.state = replaced(self.state, indices, arrays)

    # -- the loop --------------------------------------------------------------------------------

    def run(
        self, stop: threading.Event | None = None, waves: int | None = None
    ) -> list[WaveRecord]:
        """Join, then train waves (see the module's docstring) until the run's minibatches are
        done, ``stop`` is set (from another thread: it leaves at the next wave boundary, after
        landing and pushing the wave it holds), ``waves`` waves are done (None: no limit), or
        the VW is dropped (it returns quietly, ``dropped`` set); :attr:`records`.

        Raises:
          WSPError: a ledger rule broken other than being dropped.
          StoreError: a store failed a request.
        """
        stop = stop or threading.Event()
        joined = self._join()
        beating = threading.Event()
        heart = threading.Thread(
            target=self._heartbeat, args=(beating,), daemon=True, name=f"wsp-heartbeat-{self.name}"
        )
        if self.group.leader:  # a VW beats while its leader lives
            heart.start()
        try:
            try:
                if self.unbroken is not None:
                    self.unbroken.loop(stop, waves)
                else:
                    self._loop(stop, waves)
            finally:  # the push in flight ends first (a crash's too: it may have committed)
                if self.background.push is not None:
                    concurrent.futures.wait([self.background.push])
            self._leave(joined)
        except WSPError as error:
            if error.reason != "dropped":
                raise
            self.dropped = True
        finally:
            beating.set()
            if self.prefetcher is not None:  # whatever ended the run (closed once already
                self.prefetcher.close()  # when it left the ledger)
            if heart.is_alive():
                heart.join(timeout=self.options.timeout)
        if self.group.leader and not self.crashed.is_set():  # its heartbeat object goes
            with contextlib.suppress(StoreError):
                self.ps.forget(self.name)
        return self.records

    def _join(self) -> int:
        """Join the ledger, pull the global weights, take the freshest optimizer state shared;
        the clock it joined at."""

        def join() -> tuple[Ledger, dict[str, np.ndarray]]:
            self.ps.open()
            self.ps.beat(self.name, 0)  # before it is a member: a member always has a heartbeat
            ledger, _ = self.ps.update(lambda led: (led.join(self.name), None))
            return ledger, self.ps.pull(ledger)

        ledger, weights = self.group.agree(join)
        self.progress.clock = ledger.clocks[self.name]
        self.set_weights(weights)
        self.progress.fresh, self.progress.members = ledger.min_clock or 0, frozenset(ledger.clocks)
        if self.leaves.others:
            self._take_optimizer()
        return self.progress.clock

    def _leave(self, joined: int) -> None:
        """After the loop: the last push settled (raising what it raised), the optimizer state
        of the last clock shared, the ledger left (neither when crashed or dropped)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if not self.crashed.is_set():
            self._settle()
        if not (self.crashed.is_set() or self.dropped):
            if self.progress.clock > joined and self.options.optimizer_every:
                self._share_optimizer(wait=True)  # its last clock's, whatever was skipped
            self.group.agree(lambda: self.ps.update(lambda led: (led.leave(self.name), None)))

    def _loop(self, stop: threading.Event, waves: int | None) -> None:
        held: Wave | None = None  # the claimed wave whose updates have not all landed
        claimed, nm = 0, self.options.minibatches
        while not (self.crashed.is_set() or self.dropped):
            leaving = self.group.agree(stop.is_set) or (waves is not None and claimed >= waves)
            if held is None and leaving:
                return
            # wave k's first Nm - 1 minibatches read their weights as wave k - 1's updates land
            reads = []
            for j in range(nm - 1):
                if held is not None and j < len(held.minibatches) and not self._land(held, j):
                    return
                reads.append(self._read())
            if held is not None:
                if not all(self._land(held, j) for j in range(nm - 1, len(held.minibatches))):
                    return
                if not self._push(held) or leaving:
                    return
            # the last minibatch reads the weights holding wave k - 1 whole: WSP's wait and pull
            if self.options.on_ready is not None:
                self.options.on_ready(self.name, self.progress.clock)
            more, held = self._claim(reads)
            if not more:
                return
            claimed += held is not None

    def _claim(self, reads: list[Read]) -> tuple[bool, Wave | None]:
        """WSP's wait (and pull) before the next wave, then its minibatches claimed and its last
        read taken: (whether the VW goes on, the wave); no wave when none was left to claim now
        (others hold the last: they may die); the VW stops when done, dropped or dead."""
        start, at = time.time(), self.progress
        ledger, pulled = self._wait(at.clock, at.fresh)
        if ledger is None:
            return False, None
        led, minibatches = self.group.agree(
            lambda: self.ps.update(
                lambda now: now.claim(self.name, at.clock, self.options.minibatches)
            )
        )
        if not minibatches:
            if led.done:
                return False, None
            self.group.agree(lambda: self._idle(led))
            return True, None
        if self.options.on_wave is not None:
            self.options.on_wave(self.name, at.clock, minibatches)
        reads.append(self._read())
        reads = reads[: len(minibatches) - 1] + reads[-1:]
        wave = Wave(
            wave=at.clock,
            minibatches=tuple(minibatches),
            reads=tuple(reads),
            staleness=tuple(at.started + j - r.version for j, r in enumerate(reads)),
            **self._waited(ledger, pulled, start),
        )
        at.started += len(minibatches)
        return True, wave

    def _waited(self, ledger: Ledger, pulled: bool, since: float) -> dict:
        """A wave's fields once WSP's wait that began at ``since`` (wall clock) has passed: the
        weights it starts from and their changes, the slowest VW's clock, whether it pulled,
        when it began and how long it took."""
        return {
            "start": self._weights(),
            "start_changes": self.progress.changes,
            "slowest": ledger.min_clock or 0,
            "pulled": pulled,
            "started": since,
            "wait": time.time() - since,
        }

    def _weights(self) -> tuple[jax.Array, ...]:
        """The device arrays of the VW's weight leaves, in leaf order."""
        _, leaves, _ = tree.arrays(self.state)
        return tuple(leaves[i] for i in self.leaves.weights)

    def _read(self) -> Read:
        """A minibatch starts: the weights it reads (the arrays themselves, immutable: no copy)."""
        at = self.progress
        return Read(
            weights=self._weights(),
            version=at.applied,
            changes=at.changes,
            behind=max(at.clock - at.fresh, 0),
        )

    def _land(self, wave: Wave, j: int) -> bool:
        """Minibatch ``j`` of ``wave``: the user's step on the weights it read (with the
        optimizer state as it is now), its update ``after - read`` added to the current weights.
        False when the VW died meanwhile."""
        if self.crashed.is_set():
            return False
        if j == 0:
            wave.tic = time.perf_counter()
        if self.wave_step is not None:
            return self._land_pipelined(wave, j)
        read, k = wave.reads[j], wave.minibatches[j]
        current = read.changes == self.progress.changes
        weights = read.weights
        if self.steps.donate:  # a read that a later minibatch or the push still needs is copied
            kept = read.changes == wave.start_changes or any(
                r.changes == read.changes for r in wave.reads[j + 1 :]
            )
            if kept or not current:
                weights = tuple(x.copy() for x in read.weights)
        now = self._weights()
        data, batch_weights, rows = self._batch(wave, k)
        after, metrics = self.step(
            replaced(self.state, self.leaves.weights, weights),
            Batch(data, batch_weights, self.layout, self.mesh, BATCH_AXES),
        )
        if not current:  # the update computed on older weights lands on the current ones
            _, leaves, _ = tree.arrays(after)
            on_now = landed(list(now), [leaves[i] for i in self.leaves.weights], list(read.weights))
            after = replaced(after, self.leaves.weights, on_now)
        self.state = after
        self.progress.applied += 1
        self.progress.changes += 1
        wave.losses.append(metrics["loss"])
        wave.samples.extend(int(s) for s in rows if s >= 0)
        return True

    def _land_pipelined(self, wave: Wave, j: int) -> bool:
        """Minibatch ``j`` of ``wave`` with ``wave_step``: the whole wave runs as one pipelined
        program when its first update lands; each landing then sets the weights it produced."""
        n = len(wave.minibatches)
        if j == 0:
            batches = [self._batch(wave, k) for k in wave.minibatches]
            args = (
                self.state,
                [r.weights for r in wave.reads],
                [data for data, _, _ in batches],
                [weights for _, weights, _ in batches],
            )
            after, landed, metrics = self._program(n, args)(*args)
            wave.after, wave.landed = after, [tree.arrays(w)[1] for w in landed]
            wave.losses.extend(metrics["loss"][i] for i in range(n))
            for _, _, rows in batches:
                wave.samples.extend(int(s) for s in rows if s >= 0)
        if j == n - 1:
            self.state = wave.after
        else:  # the weights after landing j, for the next wave's read j
            shardings = [
                NamedSharding(self.mesh, self.ptc.leaves[i].spec) for i in self.leaves.weights
            ]
            weights = [jax.device_put(x, s) for x, s in zip(wave.landed[j], shardings)]
            self.state = replaced(self.state, self.leaves.weights, weights)
        self.progress.applied += 1
        self.progress.changes += 1
        return True

    def _program(self, n: int, args: tuple) -> Callable:
        """The pipelined program of a wave of ``n`` minibatches for arguments like ``args``:
        jitted (compiled at its first call, shared in this process), or, with
        :attr:`executables`, loaded or compiled now and stored (once per ``n``: looked up
        first, as it runs every wave)."""
        if n in self._programs:
            return self._programs[n]
        program = waves.program(
            self.wave_step,
            n,
            self.ptc,
            self.layout,
            self.options.part,
            tuple(self.leaves.weights),
            self.mesh,
        )
        if self.options.executables is None:
            return program
        # a stored executable's outputs must all be laid out on the mesh: the landed weights
        # as the weights, the metrics whole (left to the compiler, they are not)
        _, landed, metrics = program.eval_shape(*args)
        weights = [NamedSharding(self.mesh, self.ptc.leaves[i].spec) for i in self.leaves.weights]
        whole = NamedSharding(self.mesh, PartitionSpec())
        outs = (
            self.ptc.shardings(self.mesh),
            jax.tree.unflatten(jax.tree.structure(landed), weights * len(landed)),
            jax.tree.map(lambda _: whole, metrics),
        )
        lowered = jax.jit(program, out_shardings=outs).lower(*args)
        loaded = self.options.executables.load(lowered, self.mesh)
        self._programs[n] = loaded or self.options.executables.compile(lowered, self.mesh)
        return self._programs[n]

    def _push(self, wave: Wave) -> bool:
        """Push a wave whose updates have all landed, after the slowdown's sleep: its change of
        the weights since it was claimed, computed on the devices now, then copied off, pushed
        and recorded on a thread beside the next wave's compute (the push before it settled
        first: pushes commit in order). False when the VW died."""
        losses = [float(x) for x in jax.device_get(wave.losses)]
        compute = time.perf_counter() - wave.tic
        slow = (self.options.slowdown - 1.0) * compute
        if slow and self.crashed.wait(slow):
            return False
        if self.crashed.is_set():
            return False  # died mid-wave: nothing pushed, the minibatches go back
        self._settle()
        back, every = self.background, self.options.optimizer_every
        waited, back.waited = back.waits - back.waited, back.waits
        change = self.group.replicated(delta(list(self._weights()), list(wave.start)), self.mesh)
        self.progress.clock = wave.wave + 1
        if self.group.leader:  # the leader pushes; the others' change was for its all-gather
            back.copied = concurrent.futures.Future()  # (wave, the update on the host)
            args = (wave, change, back.copied, tuple(losses), compute, slow, waited)
            back.push = _thread(self._send, args, f"wsp-push-{self.name}-{wave.wave}")
        if self.leaves.others and every and self.progress.clock % every == 0:
            self._share_optimizer()
        return True

    def _send(self, wave: Wave, change: list, copied, losses, compute, slow, waited) -> None:
        """The push thread: the wave's change copied off the devices (``copied``'s result, for a
        pull that cannot wait for the push), pushed (committed and in the weights when it
        returns), its record added."""
        tic = time.perf_counter()
        try:
            updates = self._host(self.leaves.weights, change)
        except BaseException as error:
            copied.set_exception(error)
            raise
        copied.set_result((wave.wave, updates))
        if self.crashed.is_set():
            return  # died before the push: nothing committed, the minibatches go back
        self.ps.push(self.name, wave.wave, updates)
        record = WaveRecord(
            vw=self.name,
            wave=wave.wave,
            minibatches=wave.minibatches,
            samples=tuple(wave.samples),
            losses=losses,
            slowest=wave.slowest,
            pulled=wave.pulled,
            wait_seconds=wave.wait,
            compute_seconds=compute,
            slowdown_seconds=slow,
            push_seconds=time.perf_counter() - tic,
            started=wave.started,
            ended=time.time(),
            local_versions=tuple(r.version for r in wave.reads),
            local_staleness=wave.staleness,
            global_staleness=tuple(r.behind for r in wave.reads),
            idle_ticks=(
                self._idle_ticks(len(wave.minibatches))
                if wave.idle_ticks is None
                else wave.idle_ticks
            ),
            push_wait_seconds=waited,
            stage_idle=wave.stage_idle,
        )
        self.records.append(record)
        if self.options.on_record is not None:
            self.options.on_record(record)

    def _settle(self) -> None:
        """Wait for the push in flight (counted in :attr:`push_waits`); raise what it raised
        (every process of the VW raises it)."""
        self.group.agree(self._end_push)

    def _end_push(self) -> None:
        """The leader's :meth:`_settle`."""
        pushing, self.background.push = self.background.push, None
        if pushing is not None:
            tic = time.perf_counter()
            concurrent.futures.wait([pushing])
            self.background.waits += time.perf_counter() - tic
            pushing.result()

    def _idle_ticks(self, n: int) -> int:
        """Ticks each stage waits in a wave of ``n`` minibatches, by the schedule."""
        fill = self.ptc.config.pipe - 1
        return fill if self.wave_step is not None else n * fill

    def _share_optimizer(self, wait: bool = False) -> None:
        """Share the optimizer state as of this clock, written by a thread while the VW trains
        on (Hydrozoa's communication beside compute); skipped while the last share is still
        being written, unless ``wait`` (then this clock's share is written before it returns,
        raising its errors)."""

        back = self.background

        def skip() -> bool:  # the leader's: a share in flight, or this clock's written
            if back.share is not None and back.share.is_alive():
                if not wait:
                    return True
                back.share.join()
            return wait and back.shared == self.progress.clock

        if self.group.agree(skip):
            return
        _, leaves, _ = tree.arrays(self.state)
        # immutable: copied off on the thread
        arrays = self.group.replicated([leaves[i] for i in self.leaves.others], self.mesh)

        def write(clock=self.progress.clock):
            optimizer.share(self.ps, self.name, clock, self._host(self.leaves.others, arrays))
            back.shared = clock

        if wait:
            self.group.agree(write)
            return
        if not self.group.leader:
            return

        def write_or_note():
            try:
                write()
            except Exception as error:  # a joiner takes an older share; the VW trains on
                self.share_errors.append(error)

        back.share = threading.Thread(
            target=write_or_note, daemon=True, name=f"wsp-share-{self.name}"
        )
        back.share.start()

    def _take_optimizer(self) -> None:
        """A joiner: the optimizer state (every leaf not under ``part``) from the freshest share.

        Raises:
          WSPError: a shared leaf's shape differs from this VW's (``"invalid"``).
        """

        paths, others = self.leaves.paths, self.leaves.others

        def fetch() -> tuple[str, int, dict[str, np.ndarray]] | None:
            shared = optimizer.freshest(self.ps)
            if shared is None:
                return None
            vw, wave, arrays = shared
            for i in others:
                path, shape = paths[i], self._shape(i)
                if path not in arrays or arrays[path].shape != shape:
                    got = arrays[path].shape if path in arrays else "no such leaf"
                    raise WSPError(
                        f"the optimizer state {vw!r} shared at wave {wave} does not fit "
                        f"{self.name!r}: {path} is {got}, here {shape}",
                        "invalid",
                    )
            return vw, wave, {paths[i]: arrays[paths[i]] for i in others}

        shared = self.group.agree(fetch)
        if shared is None:
            return
        vw, wave, arrays = shared
        self._place(others, [arrays[paths[i]] for i in others])
        self.optimizer_from = (vw, wave)

    def _wait(self, wave: int, fresh: int) -> tuple[Ledger | None, bool]:
        """WSP before wave ``wave``: (the ledger, whether the weights were pulled, and then
        :attr:`fresh` set); no ledger when the VW must stop."""
        ledger, pulled = self.group.agree(lambda: self._until(wave, fresh))
        if ledger is None:
            return None, False
        if self.name not in ledger.clocks:
            self.dropped = True
            return None, False
        if pulled is None:
            return ledger, False
        self.set_weights(pulled)
        # the weights hold every other VW's commits and all of its own waves
        others = [c for vw, c in ledger.clocks.items() if vw != self.name]
        self.progress.fresh = min([*others, self.progress.clock])
        self.progress.members = frozenset(ledger.clocks)
        return ledger, True

    def _until(self, wave: int, fresh: int) -> tuple[Ledger | None, dict | None]:
        """The leader's WSP wait: (the ledger once the VW may go on or was dropped, and the
        weights it pulled, if it had to); no ledger when it died."""
        ledger = self.ps.ledger()
        while True:
            if self.name not in ledger.clocks:
                return ledger, None
            back = self.background
            decision = ledger.decide(
                self.name, wave, fresh, self.options.distance, self.progress.members
            )
            if decision == Start.GO:
                return ledger, None
            if decision == Start.PULL:  # its push in flight is added where the stores lack it
                pending = None if back.push is None else (self.name, *back.copied.result())
                return ledger, self.ps.pull(ledger, pending=pending)
            if self.crashed.is_set():
                return None, None
            ledger = self._idle(ledger)  # the slowest member's next commit

    def _idle(self, ledger: Ledger) -> Ledger:
        """Wait for the ledger to change (a commit, a join, a leave), at most a quarter of the
        timeout; first drop the members whose heartbeats have not changed for the timeout
        (read at most every quarter of it). The ledger after.

        Raises what a push that ended meanwhile raised: its lease is never committed, and a
        VW waiting for its own commit (WSP's clock, or the run's last minibatches) would wait
        for ever."""
        now, back, timeout = time.monotonic(), self.background, self.options.timeout
        if back.push is not None and back.push.done():
            self._end_push()
        if now - back.watched >= timeout / 4:
            back.beats, back.watched = back.beats.observe(ledger.clocks, self.ps.beats(), now), now
            silent = [vw for vw in back.beats.silent(now, timeout) if vw != self.name]
            if silent:
                ledger, dropped = self.ps.update(lambda led: led.drop(silent))
                for vw in dropped:  # a dead VW leaves its heartbeat object behind
                    with contextlib.suppress(StoreError):
                        self.ps.forget(vw)
                return ledger
        return self.ps.wait(min(timeout / 4, WAIT_SECONDS))

    def _heartbeat(self, done: threading.Event) -> None:
        count = 0
        while not done.wait(self.options.timeout / 4):
            if self.crashed.is_set():
                return  # a dead VW falls silent
            count += 1
            self.ps.beat(self.name, count)


def _thread(target: Callable, args: tuple, name: str) -> concurrent.futures.Future:
    """``target(*args)`` on a daemon thread of its own; its future (its result or error)."""
    future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(target(*args))
        except BaseException as error:  # raised by ``future.result()``
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
