"""A virtual worker (HetPipe's VW): a group of devices training with wave synchronous parallel.

A VW owns its devices' mesh (pipeline, data and tensor parallelism inside it, no collective with
any other VW), its copy of the weights and its own optimizer state. It trains in *waves* of
``Nm`` minibatches (``minibatches=``) and synchronizes with the others only through the parameter
server (:mod:`tenplex_jax._src.wsp.ps`) and the ledger (:mod:`tenplex_jax._src.wsp.ledger`).

Its minibatches run as in HetPipe's pipeline, ``Nm`` of them in flight and no flush between
them: its ``p``-th minibatch reads the VW's local weights holding exactly the updates of its own
minibatches up to ``p - Nm`` (**local staleness** ``Nm - 1``: it misses the updates of the
``Nm - 1`` before it, still in flight), and its update, computed on those weights, lands on the
local weights as they are when it is done. Wave ``k`` is its minibatches ``k Nm .. k Nm + Nm - 1``:

1. while wave ``k - 1``'s updates land one at a time, wave ``k``'s first ``Nm - 1`` minibatches
   read their weights, each after one more of them;
2. when the last has landed, the VW **pushes** wave ``k - 1``'s update: the change of the local
   weights over its ``Nm`` updates, ``w_end - w_start``, copied off the devices, staged,
   committed with its minibatches and applied on a thread of its own, beside wave ``k``'s
   compute (Hydrozoa's communication thread); pushes commit in order (the next push and
   leaving wait for the one in flight), and a pull does not wait for it: its update is added
   to the pieces the stores have not applied it to yet;
3. **WSP**: the weights wave ``k``'s last minibatch reads must hold every VW's waves before
   ``k - D`` (``distance=D``). If its last pull already did (it pulled when the slowest had
   committed ``>= k - D`` waves), it goes on without pulling; else it waits until the slowest
   member has committed ``k - D`` waves and **pulls** the global weights (**global staleness**:
   the VW's own waves in the weights a minibatch reads, minus the waves every VW's are there up
   to: at most ``D``). ``D = 0``: every wave waits for every VW and pulls;
4. it **claims** wave ``k``'s ``Nm`` minibatches (the dataset PTC's global batches) from the
   ledger, as its lease ahead while wave ``k - 1``'s push is in flight, and the last of them
   reads the weights.

``Nm = 1`` is a wave of one minibatch trained on the latest weights, pushed before the next one
starts. Each minibatch's update is the user's step (``train_step(state, batch) -> (state,
metrics)``, the step ``tj.ElasticJob`` runs) applied to the weights it read and the optimizer state
as it is when the update lands: ``update = step(read) - read``, the optimizer's output for the
gradient at the read weights (with decoupled weight decay, the decay of the read weights too).
With a ``wave_step`` and a ``pipe`` axis, a wave runs as one program: its ``Nm`` minibatches flow
through the stages together, each on the weights it read (weight stashing), and the pipeline
fills and drains once per wave (``stages - 1`` idle ticks per stage, not per minibatch); the
updates then land as above. Otherwise the device runs one ``train_step`` per minibatch, on the
same schedule of reads and updates.

**The optimizer state.** The parameter server holds the weights only (float32); each VW's
optimizer state (AdamW moments, step count: every leaf not under ``part``) is its own, kept across
pulls (a pull replaces the weights, not the moments). A VW shares it through the stores every
``optimizer_every`` waves and when it leaves (:mod:`tenplex_jax._src.wsp.optimizer`); a joining VW
pulls the global weights, takes the freshest optimizer state shared (else keeps ``init()``'s) and
starts at the slowest member's clock.

**What ``D = 0`` equals.** With ``Nm = 1`` and plain SGD, WSP is synchronous data parallelism:
every wave each VW computes the gradient of its minibatch at the same weights and the server adds
the ``V`` updates, ``w - lr * (g_1 + ... + g_V)``: one synchronous SGD step over the ``V``
minibatches with their gradients summed (each minibatch's loss a mean over its samples).

**Heterogeneity on CPU.** ``slowdown=s`` makes a VW ``s`` times slower: after each wave it sleeps
``(s - 1)`` times the wave's compute time, as a device type ``s`` times slower would take. What
this cannot show: the contention of real devices for host memory and PCIe, and a slow
device's different memory; fake CPU devices also share the host's
cores, so VWs in one process slow each other down, and the pushes beside them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
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
from tenplex_jax._src.elastic.executables import ExecutableCache
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.executor import place
from tenplex_jax._src.pipelining import Stages
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules
from tenplex_jax._src.wsp import optimizer, waves
from tenplex_jax._src.wsp.group import Group
from tenplex_jax._src.wsp.ledger import Beats, Ledger
from tenplex_jax._src.wsp.ps import ParameterServer
from tenplex_jax._src.wsp.waves import Read, Wave, WaveRecord, delta, landed, replaced

WAIT_SECONDS = 1.0  # the longest a waiting VW blocks on the ledger before it looks again


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


class VirtualWorker:
    """A VW named ``name`` on ``devices`` (laid out as ``config``) in the job on ``ps``.

    Built (its state laid out, its step compiled) when made; :meth:`run` joins the job and
    trains. Example::

        worker = VirtualWorker("vw1", ps, rules, dataset, init, train_step,
                               devices=jax.devices()[:4], config=tj.ParallelConfig(pipe=2, data=2),
                               minibatches=4, distance=1)
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
      minibatches: ``Nm``, the minibatches of a wave.
      distance: WSP's ``D``: the waves it may run ahead of the slowest member.
      grad_units: the batch layout's gradient units (None: one per sample).
      slowdown: ``s >= 1``: after each wave, sleep ``s - 1`` times its compute time, as a device
        ``s`` times slower would take (heterogeneity on one machine).
      timeout: seconds of unchanged heartbeats after which a waiting VW drops a member (this
        VW too, if it falls silent); it heartbeats every ``timeout / 4``, and while it waits it
        blocks on the ledger's changes for ``timeout / 4`` (at most 1 s) at a time.
      part: the top-level key of the weights the parameter server holds.
      on_wave: ``on_wave(name, wave, minibatches)``, called when a wave's minibatches are
        claimed.
      on_record: ``on_record(record)``, called with each :class:`WaveRecord` when its wave is
        pushed.
      steps: a step cache of the same ``train_step`` shared by the VWs of one process (built
        over all their devices, ``donate=False``: a donating one costs a copy of the weights per
        minibatch), so a VW that replaces another on the same devices compiles nothing
        (default: its own).
      optimizer_every: share the optimizer state through the stores every this many waves (and
        when leaving), for VWs that join later; 0: never.
      wave_step: HetPipe's pipelined wave: ``wave_step(state, reads, batch) -> (state, landed,
        metrics)`` runs a wave's minibatches in one program with all of them in flight in the
        pipeline (no flush between them); ``reads`` is the state's ``part`` subtree with each
        weight leaf's versions stacked (minibatch ``j`` read version ``j``), ``batch`` a
        :class:`tenplex_jax.Batch` whose data and weights lead with the wave's minibatches;
        it returns the state after the wave's updates landed (each computed at its version,
        added to the weights as they are when it lands, as ``train_step``'s are), ``landed``
        (the ``part`` subtree after each landing but the last) and ``metrics["loss"]`` per
        minibatch. The reads and updates are the same schedule as ``train_step``'s, which is
        then used for nothing but the layout (``tenplex_jax_models.train.wave_step`` for the
        reference GPT). Used where ``config`` has a ``pipe`` axis larger than 1; None, or no
        pipeline: one ``train_step`` per minibatch.
      stages: uneven pipeline stages (HetPipe: more layers on the faster devices; the planner's
        ``WorkerPlan.candidate.stages``): the VW holds every leaf whose first logical axis is
        ``layers`` padded for them (:meth:`tenplex_jax.pipelining.Stages.pad`), and the
        ``train_step`` must run its pipeline with them. What it pushes, pulls and shares is
        unpadded, so VWs of different stages train one job. None: the stacked leaves as they are.
      executables: an on-disk cache of compiled programs (``ExecutableCache``): the VW's train
        step and wave program are loaded from it when a VW on such devices compiled them before
        (a replacement on a dead VW's devices compiles nothing), else compiled and stored; the
        wave program is then ready before the VW joins. None: compiled in memory, the wave
        program at the first wave.
      group: the VW's processes, when its ``devices`` span processes (its own
        ``jax.distributed`` job; :meth:`Group.of_jax`): every process makes the VW, and its leader
        alone talks to the parameter server (:mod:`tenplex_jax._src.wsp.group`). Default: one.

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
      WSPError: ``minibatches < 1``, ``distance < 0``, ``slowdown < 1``,
        ``optimizer_every < 0``, or the state has no leaves under ``part`` (``"invalid"``).
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
        minibatches: int = 1,
        distance: int = 0,
        grad_units: int | None = None,
        slowdown: float = 1.0,
        timeout: float = 10.0,
        part: str = "model",
        on_wave: Callable[[str, int, tuple[int, ...]], None] | None = None,
        on_record: Callable[[WaveRecord], None] | None = None,
        steps: StepCache | None = None,
        optimizer_every: int = 4,
        stages: Stages | None = None,
        wave_step: Callable | None = None,
        executables: ExecutableCache | None = None,
        group: Group | None = None,
    ):
        if minibatches < 1 or distance < 0 or slowdown < 1.0 or optimizer_every < 0:
            raise WSPError(
                f"a virtual worker needs minibatches >= 1, distance >= 0, slowdown >= 1 and "
                f"optimizer_every >= 0; got {minibatches}, {distance}, {slowdown}, "
                f"{optimizer_every}",
                "invalid",
            )
        self.optimizer_every, self.optimizer_from = optimizer_every, None
        self.share_errors: list[Exception] = []  # shares written in the background that failed
        self._sharing: threading.Thread | None = None
        self._shared: int | None = None  # the clock of the last share written
        self.name, self.ps, self.dataset = name, ps, dataset
        self.group = group or Group()
        self.executables = executables
        self._programs: dict[int, Callable] = {}  # a wave's minibatches -> its program, compiled
        self.nm, self.distance, self.slowdown = minibatches, distance, slowdown
        self.timeout, self.on_wave, self.on_record = timeout, on_wave, on_record
        self.devices = list(devices)
        self.stages, self.stacked = stages, frozenset()
        if stages is not None:  # the stacked leaves padded for the stages, on the host
            self.stacked = waves.stacked_leaves(
                jax.eval_shape(init) if callable(init) else init, rules
            )
            init = waves.padded(init, self.stacked, stages)
        if callable(init):  # built straight into the layout
            self.ptc = PTC.of(jax.eval_shape(init), rules, config, self.devices)
            self.mesh = self.ptc.mesh(self.devices)
            self.state = jax.jit(init, out_shardings=self.ptc.shardings(self.mesh))()
        else:  # a state built once for every VW: placed
            self.ptc = PTC.of(init, rules, config, self.devices)
            self.mesh = self.ptc.mesh(self.devices)
            self.state = place(init, self.ptc)
        self.paths, self.part = [leaf.path for leaf in self.ptc.leaves], part
        self.weights = [i for i, p in enumerate(self.paths) if p.startswith(part + "/")]
        self.others = sorted(set(range(len(self.paths))) - set(self.weights))
        if not self.weights:
            raise WSPError(
                f"the state has no leaves under {part!r}: its paths start "
                f"{sorted({p.split('/')[0] for p in self.paths})}",
                "invalid",
            )
        self.layout = BatchLayout(
            dataset.global_batch, ranks=config.data * config.fsdp, grad_units=grad_units
        )
        if steps is None:
            sample = jax.tree.map(np.asarray, dataset.load(np.zeros(1, np.int64)))
            steps = StepCache(
                train_step, sample, self.devices, donate=False, executables=executables
            )
        self.steps = steps
        self.wave_step = wave_step if config.pipe > 1 else None  # nothing to overlap without
        self.step = None  # the train step, compiled only where it runs
        if self.wave_step is None:
            self.step = self.steps.get(self.ptc, self.layout, ahead=False).result().executable
        weights = list(self._weights())
        jax.block_until_ready((landed(weights, weights, weights), delta(weights, weights)))
        if self.wave_step is not None and executables is not None:  # ready before it joins
            data, batch_weights, _ = device_batch(dataset, 0, self.layout, self.mesh)
            n = self.nm
            self._program(n, (self.state, [tuple(weights)] * n, [data] * n, [batch_weights] * n))
        self.records: list[WaveRecord] = []
        self.clock = self.fresh = 0  # waves pushed (the ledger's clock); the last pull's min clock
        self.members: frozenset[str] = frozenset()  # the ledger's members at the last pull
        self.applied = self.started = 0  # own updates landed; own minibatches started
        self.changes = 0  # changes to the weights (updates and pulls): which reads are current
        self.crashed = threading.Event()  # a simulated death: stop at once, leave nothing behind
        self.dropped = False
        self.watched, self.watched_at = Beats(), -math.inf  # the members' heartbeats, seen when
        self._pushing: _Thread | None = None  # the push in flight
        self._copied: concurrent.futures.Future | None = None  # its update, once on the host
        self.push_waits = self._waited = 0.0  # in all; when the last push started

    # -- the weights between host and devices ------------------------------------------------

    def host_weights(self) -> dict[str, np.ndarray]:
        """The VW's current weights: :func:`weights_of` its state (stacked leaves unpadded)."""
        weights = weights_of(self.state, self.part)
        return {self.paths[i]: self._unpad(i, weights[self.paths[i]]) for i in self.weights}

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Replace the VW's weights (a pull); its optimizer state stays as it is.

        Args:
          weights: leaf path -> host array for every weight leaf (what
            ``ParameterServer.pull`` returns), cast to each leaf's dtype.

        Raises:
          KeyError: a weight leaf is missing.
        """
        self._place(self.weights, [weights[self.paths[i]] for i in self.weights])
        self.changes += 1

    def _unpad(self, i: int, x: np.ndarray) -> np.ndarray:
        """Leaf ``i`` as the parameter server and the optimizer shares hold it: unpadded."""
        return x[self.stages.mask] if i in self.stacked else x

    def _shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s shape as the parameter server and the optimizer shares hold it."""
        shape = tuple(self.ptc.leaves[i].shape)
        return (self.stages.num_layers,) + shape[1:] if i in self.stacked else shape

    def _place(self, indices: list[int], host: list[np.ndarray]) -> None:
        """Host arrays (unpadded) onto the devices as the state's leaves ``indices`` (padded
        where stacked; dtype and layout)."""
        self.state = replaced(
            self.state,
            indices,
            [
                jax.device_put(
                    (waves.pad_rows(x, self.stages) if i in self.stacked else x).astype(
                        self.ptc.leaves[i].dtype
                    ),
                    NamedSharding(self.mesh, self.ptc.leaves[i].spec),
                )
                for i, x in zip(indices, host)
            ],
        )

    # -- the loop --------------------------------------------------------------------------------

    def run(
        self, stop: threading.Event | None = None, waves: int | None = None
    ) -> list[WaveRecord]:
        """Join, then train waves until the run's minibatches are done, ``stop`` is set (then
        leave at the next wave boundary), ``waves`` waves are done, or the VW is dropped.

        The waves overlap as in HetPipe's pipeline: while wave ``k - 1``'s updates land, one
        at a time, wave ``k``'s minibatches read their weights; when the last one has landed
        the wave is pushed, WSP waits and pulls for wave ``k``, and wave ``k``'s minibatches are
        claimed. A VW that leaves lands and pushes the wave it holds first. A dropped VW returns
        quietly (``dropped`` is set).

        Args:
          stop: set it (from another thread) to leave at the next wave boundary.
          waves: the most waves to train (default: until the run is done).

        Returns:
          :attr:`records`: the :class:`WaveRecord` of every wave pushed.

        Raises:
          WSPError: a ledger rule broken other than being dropped.
          StoreError: a store failed a request.
        """
        stop = stop or threading.Event()

        def join() -> tuple[Ledger, dict[str, np.ndarray]]:
            self.ps.open()
            self.ps.beat(self.name, 0)  # before it is a member: a member always has a heartbeat
            ledger, _ = self.ps.update(lambda led: (led.join(self.name), None))
            return ledger, self.ps.pull(ledger)

        ledger, weights = self.group.agree(join)
        self.clock = joined = ledger.clocks[self.name]
        self.set_weights(weights)
        self.fresh, self.members = ledger.min_clock or 0, frozenset(ledger.clocks)
        if self.others:
            self._take_optimizer()
        beating = threading.Event()
        heart = threading.Thread(
            target=self._heartbeat, args=(beating,), daemon=True, name=f"wsp-heartbeat-{self.name}"
        )
        if self.group.leader:  # a VW beats while its leader lives
            heart.start()
        try:
            try:
                self._loop(stop, waves)
            finally:  # the push in flight ends first (a crash's too: it may have committed)
                if self._pushing is not None:
                    self._pushing.join()
            if not self.crashed.is_set():
                self._settle()  # raises what it raised
            if not (self.crashed.is_set() or self.dropped):
                if self.clock > joined and self.optimizer_every:
                    self._share_optimizer(wait=True)  # its last clock's, whatever was skipped
                self.group.agree(lambda: self.ps.update(lambda led: (led.leave(self.name), None)))
        except WSPError as error:
            if error.reason != "dropped":
                raise
            self.dropped = True
        finally:
            beating.set()
            if heart.is_alive():
                heart.join(timeout=self.timeout)
        if self.group.leader and not self.crashed.is_set():  # its heartbeat object goes
            with contextlib.suppress(StoreError):
                self.ps.forget(self.name)
        return self.records

    def _loop(self, stop: threading.Event, waves: int | None) -> None:
        held: Wave | None = None  # the claimed wave whose updates have not all landed
        claimed = 0
        while not (self.crashed.is_set() or self.dropped):
            leaving = self.group.agree(stop.is_set) or (waves is not None and claimed >= waves)
            if held is None and leaving:
                return
            # wave k's first Nm - 1 minibatches read their weights as wave k - 1's updates land
            reads = []
            for j in range(self.nm - 1):
                if held is not None and j < len(held.minibatches) and not self._land(held, j):
                    return
                reads.append(self._read())
            if held is not None:
                for j in range(self.nm - 1, len(held.minibatches)):
                    if not self._land(held, j):
                        return
                if not self._push(held):
                    return
                held = None
                if leaving:
                    return
            # the last minibatch reads the weights holding wave k - 1 whole: WSP's wait and pull
            start = time.time()
            ledger, pulled = self._wait(self.clock, self.fresh)
            if ledger is None:
                return
            led, minibatches = self.group.agree(
                lambda: self.ps.update(lambda now: now.claim(self.name, self.clock, self.nm))
            )
            if not minibatches:
                if led.done:
                    return
                # others hold the last: they may die
                self.group.agree(lambda led=led: self._idle(led))
                continue
            if self.on_wave is not None:
                self.on_wave(self.name, self.clock, minibatches)
            reads.append(self._read())
            reads = reads[: len(minibatches) - 1] + reads[-1:]
            held = Wave(
                self.clock,
                tuple(minibatches),
                tuple(reads),
                tuple(self.started + j - r.version for j, r in enumerate(reads)),
                self._weights(),
                self.changes,
                ledger.min_clock or 0,
                pulled,
                start,
                time.time() - start,
            )
            self.started += len(minibatches)
            claimed += 1

    def _weights(self) -> tuple[jax.Array, ...]:
        """The device arrays of the VW's weight leaves, in leaf order."""
        _, leaves, _ = tree.arrays(self.state)
        return tuple(leaves[i] for i in self.weights)

    def _read(self) -> Read:
        """A minibatch starts: the weights it reads (the arrays themselves, immutable: no copy)."""
        return Read(self._weights(), self.applied, self.changes, max(self.clock - self.fresh, 0))

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
        current = read.changes == self.changes
        weights = read.weights
        if self.steps.donate:  # a read that a later minibatch or the push still needs is copied
            kept = read.changes == wave.start_changes or any(
                r.changes == read.changes for r in wave.reads[j + 1 :]
            )
            if kept or not current:
                weights = tuple(x.copy() for x in read.weights)
        now = self._weights()
        data, batch_weights, rows = device_batch(self.dataset, k, self.layout, self.mesh)
        after, metrics = self.step(
            replaced(self.state, self.weights, weights),
            Batch(data, batch_weights, self.layout, self.mesh, BATCH_AXES),
        )
        if not current:  # the update computed on older weights lands on the current ones
            _, leaves, _ = tree.arrays(after)
            on_now = landed(list(now), [leaves[i] for i in self.weights], list(read.weights))
            after = replaced(after, self.weights, on_now)
        self.state = after
        self.applied += 1
        self.changes += 1
        wave.losses.append(metrics["loss"])
        wave.samples.extend(int(s) for s in rows if s >= 0)
        return True

    def _land_pipelined(self, wave: Wave, j: int) -> bool:
        """Minibatch ``j`` of ``wave`` with ``wave_step``: the whole wave runs as one pipelined
        program when its first update lands; each landing then sets the weights it produced."""
        n = len(wave.minibatches)
        if j == 0:
            batches = [
                device_batch(self.dataset, k, self.layout, self.mesh) for k in wave.minibatches
            ]
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
            shardings = [NamedSharding(self.mesh, self.ptc.leaves[i].spec) for i in self.weights]
            weights = [jax.device_put(x, s) for x, s in zip(wave.landed[j], shardings)]
            self.state = replaced(self.state, self.weights, weights)
        self.applied += 1
        self.changes += 1
        return True

    def _program(self, n: int, args: tuple) -> Callable:
        """The pipelined program of a wave of ``n`` minibatches for arguments like ``args``:
        jitted (compiled at its first call, shared in this process), or, with
        :attr:`executables`, loaded or compiled now and stored (once per ``n``: looked up
        first, as it runs every wave)."""
        if n in self._programs:
            return self._programs[n]
        program = waves.program(
            self.wave_step, n, self.ptc, self.layout, self.part, tuple(self.weights), self.mesh
        )
        if self.executables is None:
            return program
        # a stored executable's outputs must all be laid out on the mesh: the landed weights
        # as the weights, the metrics whole (left to the compiler, they are not)
        _, landed, metrics = program.eval_shape(*args)
        weights = [NamedSharding(self.mesh, self.ptc.leaves[i].spec) for i in self.weights]
        whole = NamedSharding(self.mesh, PartitionSpec())
        outs = (
            self.ptc.shardings(self.mesh),
            jax.tree.unflatten(jax.tree.structure(landed), weights * len(landed)),
            jax.tree.map(lambda _: whole, metrics),
        )
        lowered = jax.jit(program, out_shardings=outs).lower(*args)
        loaded = self.executables.load(lowered, self.mesh)
        self._programs[n] = loaded or self.executables.compile(lowered, self.mesh)
        return self._programs[n]

    def _push(self, wave: Wave) -> bool:
        """Push a wave whose updates have all landed, after the slowdown's sleep: its change of
        the weights since it was claimed, computed on the devices now, then copied off, pushed
        and recorded on a thread beside the next wave's compute (the push before it settled
        first: pushes commit in order). False when the VW died."""
        losses = [float(x) for x in jax.device_get(wave.losses)]
        compute = time.perf_counter() - wave.tic
        slow = (self.slowdown - 1.0) * compute
        if slow and self.crashed.wait(slow):
            return False
        if self.crashed.is_set():
            return False  # died mid-wave: nothing pushed, the minibatches go back
        self._settle()
        waited, self._waited = self.push_waits - self._waited, self.push_waits
        change = self.group.replicated(delta(list(self._weights()), list(wave.start)), self.mesh)
        self.clock = wave.wave + 1
        if self.group.leader:  # the leader pushes; the others' change was for its all-gather
            self._copied = concurrent.futures.Future()  # (wave, the update on the host)
            args = (wave, change, self._copied, tuple(losses), compute, slow, waited)
            self._pushing = _Thread(self._send, args, f"wsp-push-{self.name}-{wave.wave}")
        if self.others and self.optimizer_every and self.clock % self.optimizer_every == 0:
            self._share_optimizer()
        return True

    def _send(self, wave: Wave, change: list, copied, losses, compute, slow, waited) -> None:
        """The push thread: the wave's change copied off the devices (``copied``'s result, for a
        pull that cannot wait for the push), pushed (committed and in the weights when it
        returns), its record added."""
        tic = time.perf_counter()
        try:
            host = jax.device_get(change)
            updates = {self.paths[i]: self._unpad(i, d) for i, d in zip(self.weights, host)}
        except BaseException as error:
            copied.set_exception(error)
            raise
        copied.set_result((wave.wave, updates))
        if self.crashed.is_set():
            return  # died before the push: nothing committed, the minibatches go back
        self.ps.push(self.name, wave.wave, updates)
        record = WaveRecord(
            self.name,
            wave.wave,
            wave.minibatches,
            tuple(wave.samples),
            losses,
            wave.slowest,
            wave.pulled,
            wave.wait,
            compute,
            slow,
            time.perf_counter() - tic,
            wave.started,
            time.time(),
            tuple(r.version for r in wave.reads),
            wave.staleness,
            tuple(r.behind for r in wave.reads),
            self._idle_ticks(len(wave.minibatches)),
            waited,
        )
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def _settle(self) -> None:
        """Wait for the push in flight (counted in :attr:`push_waits`); raise what it raised
        (every process of the VW raises it)."""
        self.group.agree(self._end_push)

    def _end_push(self) -> None:
        """The leader's :meth:`_settle`."""
        pushing, self._pushing = self._pushing, None
        if pushing is not None:
            tic = time.perf_counter()
            pushing.join()
            self.push_waits += time.perf_counter() - tic
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

        def skip() -> bool:  # the leader's: a share in flight, or this clock's written
            if self._sharing is not None and self._sharing.is_alive():
                if not wait:
                    return True
                self._sharing.join()
            return wait and self._shared == self.clock

        if self.group.agree(skip):
            return
        _, leaves, _ = tree.arrays(self.state)
        # immutable: copied off on the thread
        arrays = self.group.replicated([leaves[i] for i in self.others], self.mesh)

        def write(clock=self.clock):
            host = jax.device_get(arrays)
            shared = {self.paths[i]: self._unpad(i, x) for i, x in zip(self.others, host)}
            optimizer.share(self.ps, self.name, clock, shared)
            self._shared = clock

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

        self._sharing = threading.Thread(
            target=write_or_note, daemon=True, name=f"wsp-share-{self.name}"
        )
        self._sharing.start()

    def _take_optimizer(self) -> None:
        """A joiner: the optimizer state (every leaf not under ``part``) from the freshest share.

        Raises:
          WSPError: a shared leaf's shape differs from this VW's (``"invalid"``).
        """

        def fetch() -> tuple[str, int, dict[str, np.ndarray]] | None:
            shared = optimizer.freshest(self.ps)
            if shared is None:
                return None
            vw, wave, arrays = shared
            for i in self.others:
                path, shape = self.paths[i], self._shape(i)
                if path not in arrays or arrays[path].shape != shape:
                    got = arrays[path].shape if path in arrays else "no such leaf"
                    raise WSPError(
                        f"the optimizer state {vw!r} shared at wave {wave} does not fit "
                        f"{self.name!r}: {path} is {got}, here {shape}",
                        "invalid",
                    )
            return vw, wave, {self.paths[i]: arrays[self.paths[i]] for i in self.others}

        shared = self.group.agree(fetch)
        if shared is None:
            return
        vw, wave, arrays = shared
        self._place(self.others, [arrays[self.paths[i]] for i in self.others])
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
        self.fresh, self.members = min([*others, self.clock]), frozenset(ledger.clocks)
        return ledger, True

    def _until(self, wave: int, fresh: int) -> tuple[Ledger | None, dict | None]:
        """The leader's WSP wait: (the ledger once the VW may go on or was dropped, and the
        weights it pulled, if it had to); no ledger when it died."""
        ledger = self.ps.ledger()
        while True:
            if self.name not in ledger.clocks:
                return ledger, None
            decision = ledger.decide(self.name, wave, fresh, self.distance, self.members)
            if decision == "go":
                return ledger, None
            if decision == "pull":  # its push in flight is added where the stores lack it
                pending = None if self._pushing is None else (self.name, *self._copied.result())
                return ledger, self.ps.pull(ledger, pending=pending)
            if self.crashed.is_set():
                return None, None
            if self._pushing is not None and self._pushing.done:
                self._end_push()  # its push failed: WSP would wait for its commit for ever
            ledger = self._idle(ledger)  # the slowest member's next commit

    def _idle(self, ledger: Ledger) -> Ledger:
        """Wait for the ledger to change (a commit, a join, a leave), at most a quarter of the
        timeout; first drop the members whose heartbeats have not changed for the timeout
        (read at most every quarter of it). The ledger after."""
        now = time.monotonic()
        if now - self.watched_at >= self.timeout / 4:
            self.watched = self.watched.observe(ledger.clocks, self.ps.beats(), now)
            self.watched_at = now
            silent = [vw for vw in self.watched.silent(now, self.timeout) if vw != self.name]
            if silent:
                ledger, dropped = self.ps.update(lambda led: led.drop(silent))
                for vw in dropped:  # a dead VW leaves its heartbeat object behind
                    with contextlib.suppress(StoreError):
                        self.ps.forget(vw)
                return ledger
        return self.ps.wait(min(self.timeout / 4, WAIT_SECONDS))

    def _heartbeat(self, done: threading.Event) -> None:
        count = 0
        while not done.wait(self.timeout / 4):
            if self.crashed.is_set():
                return  # a dead VW falls silent
            count += 1
            self.ps.beat(self.name, count)


class _Thread:
    """``target(*args)`` on a daemon thread; ``result`` raises what it raised."""

    def __init__(self, target: Callable, args: tuple, name: str):
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(target, args), name=name, daemon=True
        )
        self.thread.start()

    def _run(self, target: Callable, args: tuple) -> None:
        try:
            target(*args)
        except BaseException as error:  # raised by ``result``
            self.error = error

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def join(self) -> None:
        self.thread.join()

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
