"""A virtual worker running HetPipe's unbroken pipeline (``WorkerOptions(pipeline="unbroken")``):
its minibatches flow through the stages across wave boundaries, from the tick table
(:mod:`~tenplex_jax._src.wsp.pipeline`) run by :mod:`~tenplex_jax._src.wsp.hetpipe`, what is in
flight carried on the devices from one call into the next.

Each wave ``k`` is two calls (:class:`Calls`), cut where the VW talks to the parameter server:

1. from wave ``k``'s **pull point** (wave ``k - 1``'s last update has landed: the VW pushed it
   and passed WSP's wait, pulling if it had to: the pull lands on what is in flight as a rebase)
   to the tick wave ``k + 1``'s first minibatch enters: wave ``k``'s last minibatch enters, its
   first ones go on;
2. there wave ``k + 1`` is **claimed ahead** (the push of wave ``k - 1`` settled first: the
   ledger leases one wave past the one whose push is in flight), and the second call runs to
   wave ``k + 1``'s pull point, wave ``k + 1``'s first ``Nm - 1`` minibatches entering as wave
   ``k``'s updates land.

The pushes, pulls, claims, WSP's waits and the records are the wave program's (``worker.py``):
each minibatch reads its weights when it enters, with the VW's own updates up to ``p - Nm``
(the table's rule), the last of a wave after the pull. No claim ahead (the run's end, ``stop``,
a wave of fewer than ``Nm``): the pipeline drains, the wave is pushed, and the next wave starts
a pipeline from empty. The first waves of a pipeline fill it; from :attr:`Calls.steady` on,
every wave's calls are the same programs, compiled once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax._src import tree
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp import hetpipe
from tenplex_jax._src.wsp.pipeline import Schedule, schedule
from tenplex_jax._src.wsp.waves import Read, Wave, replaced

if TYPE_CHECKING:
    from tenplex_jax._src.wsp.worker import VirtualWorker

AXIS = "pipe"


@dataclasses.dataclass(frozen=True)
class Calls:
    """The calls of one pipeline run (from empty to drained) of ``stages`` stages and ``Nm``
    minibatches a wave, wave by wave, each a :class:`hetpipe.Window` of the unbroken table whose
    minibatches count from the wave's first (two waves' inputs: this one's and the next's).

    Attributes:
      table: the unbroken table of enough waves that its steady wave repeats.
      steady: the first wave whose calls every later wave repeats (the waves before fill).
    """

    table: Schedule
    steady: int

    @classmethod
    @functools.cache
    def of(cls, stages: int, nm: int) -> Calls:
        """The calls of ``stages`` stages and ``Nm`` minibatches a wave, the steady wave found by
        comparing each wave's windows with the next two's."""
        waves = 2 * stages + 6  # the fill lasts at most a wave per stage
        table = schedule(stages, nm, [0] * waves, unbroken=True)
        calls = cls(table, waves)
        for k in range(waves - 4):
            if calls._windows(k) == calls._windows(k + 1) == calls._windows(k + 2):
                return cls(table, k)
        raise WSPError(  # the greedy table is periodic: a schedule this misses is a bug
            f"the unbroken table of {stages} stages and Nm = {nm} has no steady wave in {waves}",
            "invalid",
        )

    @property
    def nm(self) -> int:
        return self.table.nm

    def pull(self, k: int) -> int:
        """Wave ``k``'s pull point: the tick after wave ``k - 1``'s last landing."""
        return 0 if k == 0 else self.table.landed(k * self.nm - 1) + 1

    def ahead(self, k: int) -> int:
        """The tick wave ``k + 1``'s first minibatch enters at: where it is claimed."""
        return self.table.entered((k + 1) * self.nm)

    def _windows(self, k: int) -> tuple[hetpipe.Window, hetpipe.Window]:
        at = lambda first, end: hetpipe.window(
            self.table, first, end, base=k * self.nm, n=2 * self.nm
        )
        return at(self.pull(k), self.ahead(k)), at(self.ahead(k), self.pull(k + 1))

    def windows(self, k: int) -> tuple[hetpipe.Window, hetpipe.Window]:
        """Wave ``k``'s calls: to the claim of wave ``k + 1``, then to its pull point."""
        return self._windows(min(k, self.steady))

    def drain(self, k: int) -> hetpipe.Window:
        """Wave ``k``'s second call when no wave follows it: until its last update lands."""
        k = min(k, self.steady)
        last = schedule(self.table.stages, self.nm, [0] * (k + 1), unbroken=True)
        return hetpipe.window(last, self.ahead(k), last.ticks, base=k * self.nm, n=2 * self.nm)

    def versions(self, k: int) -> tuple[int, ...]:
        """Per minibatch of wave ``k``: the run's updates in the weights it reads, from the
        table: those landed up to the landing that stashed its slot's version (minibatch ``p -
        Nm``'s; none for the first ``Nm``)."""
        c, table = min(k, self.steady), self.table
        landed = [table.landed(q) for q in range(len(table.forward))]
        stashed = lambda p: sum(t <= landed[p - self.nm] for t in landed) if p >= self.nm else 0
        return tuple(stashed(c * self.nm + j) + (k - c) * self.nm for j in range(self.nm))


def check(vw: VirtualWorker) -> None:
    """Refuse a VW the unbroken pipeline does not run yet, naming the rule and the values.

    Raises:
      WSPError: no adapter, a layout other than a ``pipe`` axis alone, uneven stages, a VW
        over processes, or a prefetch (``"invalid"``).
    """
    options, config = vw.options, vw.ptc.config
    others = {a: n for a, n in zip(vw.mesh.axis_names, vw.mesh.devices.shape) if a != AXIS}
    rules = [
        (options.unbroken is not None, "an UnbrokenModel (WorkerOptions.unbroken)", None),
        (config.pipe > 1, "a 'pipe' axis of 2 stages or more", f"pipe={config.pipe}"),
        (
            all(n == 1 for n in others.values()),
            "no other axis above 1 (no data or tensor parallelism inside a stage yet)",
            others,
        ),
        (options.stages is None, "even stages (WorkerOptions.stages None)", options.stages),
        (vw.group.count == 1, "a VW of one process", f"{vw.group.count} processes"),
        (not options.prefetch, "no prefetch (it claims the wave ahead itself)", "prefetch=True"),
    ]
    for holds, rule, value in rules:
        if not holds:
            got = "" if value is None else f", got {value}"
            raise WSPError(
                f"virtual worker {vw.name!r}: the unbroken pipeline (WorkerOptions.pipeline="
                f"'unbroken') needs {rule}{got}",
                "invalid",
            )


class Driver:
    """The loop of a VW with ``pipeline="unbroken"``; :meth:`loop` replaces its wave program's."""

    def __init__(self, vw: VirtualWorker):
        check(vw)
        self.vw, self.adapter = vw, vw.options.unbroken
        self.mesh = Mesh(
            vw.mesh.devices.reshape(-1), (AXIS,), axis_types=(AxisType.Auto,)
        )  # the other axes are 1: the devices in pipe order
        self.whole = NamedSharding(self.mesh, P())
        self.placed = None  # the stages' weights' shardings (a tree like them)
        # where each of the VW's weight leaves is among the stages' (found once), so that a
        # wave's end writes the weights alone into the VW's state; None: through merge
        self.positions: tuple | None = None
        self.pending = 0  # updates landed since the optimizer state was last written back

    # -- the state between the VW's layout and the stages' -------------------------------------

    def _split(self):
        """The VW's state as the stages hold it: weights and optimizer state on the pipe mesh."""
        weights, opt = self.adapter.split(self.vw.state)
        if self.positions is None:
            self.positions = _positions(self.vw, weights)
        rows = lambda tree: jax.tree.map(lambda _: NamedSharding(self.mesh, P(AXIS)), tree)
        whole = lambda tree: jax.tree.map(lambda _: self.whole, tree)
        shardings = self.placed = (rows(weights[0]), whole(weights[1]))
        opt_shardings = optax.tree_map_params(
            self.adapter.optimizer,
            lambda _, s: s,
            opt,
            shardings,
            transform_non_params=lambda _: self.whole,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        return jax.device_put(weights, shardings), jax.device_put(opt, opt_shardings)

    def _merge(self, inflight: hetpipe.InFlight, updates: int, whole: bool) -> None:
        """What is in flight written into the VW's state: its weights (what a push changes);
        with ``whole`` (or no positions known), its optimizer state too, through ``merge``."""
        vw = self.vw
        self.pending += updates
        if whole or self.positions is None:
            state = self.adapter.merge(vw.state, inflight.weights, inflight.opt_state, self.pending)
            vw.state = jax.device_put(state, vw.ptc.shardings(vw.mesh))
            self.pending = 0
            return
        flat, spec = jax.tree.leaves(inflight.weights), vw.ptc.leaves
        arrays = [
            jax.device_put(flat[j], NamedSharding(vw.mesh, spec[i].spec))
            for i, j in zip(vw.leaves.weights, self.positions[1])
        ]
        vw.state = replaced(vw.state, list(vw.leaves.weights), arrays)

    def _state_weights(self):
        """The VW's weights (its state's) as the stages hold them, on the pipe mesh."""
        if self.positions is None:
            return self._split()[0]
        treedef, at = self.positions
        flat = [None] * len(at)
        for x, j in zip(self.vw._weights(), at):
            flat[j] = x
        return jax.device_put(jax.tree.unflatten(treedef, flat), self.placed)

    def _inputs(self, wave: Wave, data: dict) -> None:
        """Wave's minibatches read and placed (``data[j]``: input and target, on the host)."""
        vw = self.vw
        for j, m in enumerate(wave.minibatches):
            batch, weights, rows = vw._batch(wave, m)
            if not np.all(np.asarray(weights) == 1):
                raise WSPError(
                    f"virtual worker {vw.name!r}: the unbroken pipeline trains whole minibatches"
                    f" (every row's weight 1); minibatch {m} has padding rows",
                    "invalid",
                )
            data[j] = jax.device_get(self.adapter.batch(batch))
            wave.samples.extend(int(s) for s in rows if s >= 0)

    def _xs(self, now: dict, ahead: dict | None):
        """The inputs and targets of a call: this wave's ``Nm``, then the next's (zeros where
        none)."""
        nm = self.nm
        zero = jax.tree.map(np.zeros_like, now[0])
        rows = [now[j] for j in range(nm)] + [(ahead or {}).get(j, zero) for j in range(nm)]
        xs, targets = (np.stack([r[i] for r in rows]) for i in (0, 1))
        return jax.device_put(xs, self.whole), jax.device_put(targets, self.whole)

    # -- the loop ------------------------------------------------------------------------------

    def loop(self, stop: threading.Event, limit: int | None) -> None:
        """Train until the run is done, ``stop`` is set, ``limit`` waves are claimed, or the VW
        died or was dropped; a pipeline run per stretch of full waves."""
        vw, claimed = self.vw, 0
        while not vw._ended():
            if vw.group.agree(stop.is_set) or (limit is not None and claimed >= limit):
                return
            if vw.options.on_ready is not None:
                vw.options.on_ready(vw.name, vw.progress.clock)
            more, wave = vw._claim([])
            if not more:
                return
            if wave is None:
                continue
            # its reads are the pipeline's: taken as its minibatches enter (below)
            vw.progress.started -= len(wave.minibatches)
            wave = dataclasses.replace(wave, reads=(), staleness=())
            claimed += 1
            claimed = self._pipeline(wave, stop, limit, claimed)
            if claimed is None:
                return

    def _pipeline(self, wave: Wave, stop, limit, claimed: int) -> int | None:
        """One pipeline run from empty, from ``wave`` (claimed, its WSP wait passed) on, until
        no full wave follows; the waves claimed, or None when the VW died."""
        vw, at = self.vw, self.vw.progress
        self.nm = nm = len(wave.minibatches)
        calls = Calls.of(vw.ptc.config.pipe, nm)
        model, optimizer = self.adapter.model, self.adapter.optimizer
        weights, opt = self._split()
        self.pending = 0  # the VW's state is whole: the pipeline starts from it
        now: dict = {}
        self._inputs(wave, now)
        shape = jax.ShapeDtypeStruct((len(calls.table.forward), *now[0][0].shape), now[0][0].dtype)
        inflight = hetpipe.start(calls.table, model, weights, opt, shape, mesh=self.mesh)
        base = at.applied

        def run(ticks, model, optimizer, inflight, xs, targets):
            if not ticks.ticks:  # a call of no ticks (Nm = 1: the claim is at the pull point)
                return inflight, None
            return hetpipe.run_window(
                ticks, model, optimizer, inflight, xs, targets, mesh=self.mesh
            )

        wave = self._entered(wave, calls, 0, base, range(nm))
        k, losses, merged = 0, {}, 0  # the run's wave, wave k's losses, updates since a merge
        while True:
            wave.tic = time.perf_counter()
            first, second = calls.windows(k)
            inflight, out = run(first, model, optimizer, inflight, *self._xs(now, None))
            merged += self._ran(first, out, losses)
            # wave k + 1 claimed ahead, once wave k - 1's push has committed
            leaving = vw.group.agree(stop.is_set) or (limit is not None and claimed >= limit)
            ahead = None
            if not leaving and nm == vw.options.minibatches and not vw._ended():
                vw._settle()
                ahead = self._claim_ahead(wave.wave + 1)
            if ahead is None:  # drain: wave k is the last of this pipeline run
                drain = calls.drain(k)
                inflight, out = run(drain, model, optimizer, inflight, *self._xs(now, None))
                merged += self._ran(drain, out, losses)
                self._land(wave, inflight, losses, merged, calls, k, first, drain, whole=True)
                return claimed if vw._push(wave) else None
            claimed += 1
            following = Wave(
                wave=wave.wave + 1,
                minibatches=ahead,
                reads=(),
                staleness=(),
                start=(),
                start_changes=0,
                slowest=0,
                pulled=False,
                started=time.time(),
                wait=0.0,
            )
            after: dict = {}
            self._inputs(following, after)
            following = self._entered(following, calls, k + 1, base, range(nm - 1))
            inflight, out = run(second, model, optimizer, inflight, *self._xs(now, after))
            nxt: dict = {}  # wave k + 1's losses
            merged += self._ran(second, out, losses, nxt)
            # the push shares the optimizer state at clocks of optimizer_every: it must be whole
            every = vw.options.optimizer_every
            due = bool(vw.leaves.others) and every > 0 and (wave.wave + 1) % every == 0
            self._land(wave, inflight, losses, merged, calls, k, first, second, whole=due)
            merged = 0
            if not vw._push(wave):
                return None
            # wave k + 1's pull point: WSP's wait, its pull a rebase of what is in flight
            if vw.options.on_ready is not None:
                vw.options.on_ready(vw.name, at.clock)
            tic = time.time()
            ledger, pulled = vw._wait(at.clock, at.fresh)
            if ledger is None:
                return None
            if pulled:
                inflight = self._rebase(inflight)
            wave = self._entered(following, calls, k + 1, base, [nm - 1])
            wave = dataclasses.replace(wave, **vw._waited(ledger, pulled, tic))
            k, now, losses = k + 1, after, nxt

    def _claim_ahead(self, wave: int) -> tuple[int, ...] | None:
        """Wave ``wave``'s minibatches leased ahead; None when fewer than ``Nm`` were left (the
        lease stays: the next pipeline run claims it again and gets it back)."""
        vw = self.vw
        _, minibatches = vw.group.agree(
            lambda: vw.ps.update(lambda now: now.claim(vw.name, wave, vw.options.minibatches))
        )
        if len(minibatches) < vw.options.minibatches:
            return None
        if vw.options.on_wave is not None:
            vw.options.on_wave(vw.name, wave, minibatches)
        return tuple(minibatches)

    def _entered(self, wave: Wave, calls: Calls, k: int, base: int, js) -> Wave:
        """``wave`` (the run's wave ``k``) with the reads of its minibatches ``js``: the weights
        now, the version the table gives (the run's updates landed before it entered)."""
        at = self.vw.progress
        versions = calls.versions(k)
        reads, staleness = list(wave.reads), list(wave.staleness)
        for j in js:
            read = Read(
                weights=(),
                version=base + versions[j],
                changes=at.changes,
                behind=max(at.clock - at.fresh, 0),
            )
            reads.append(read)
            staleness.append(at.started - read.version)
            at.started += 1
        return dataclasses.replace(wave, reads=tuple(reads), staleness=tuple(staleness))

    def _ran(self, ticks: hetpipe.Window, out: jax.Array, losses: dict, nxt=None) -> int:
        """After a call: the losses of the minibatches whose backward left the last stage in it,
        by position in their wave (this wave's into ``losses``, the next's into ``nxt``); the
        updates it landed."""
        for m in (b[-1] for b in ticks.backward if b[-1] >= 0):
            if m < self.nm:
                losses[m] = (out, m)
            else:
                nxt[m - self.nm] = (out, m)
        return sum(m >= 0 for row in ticks.landing for m in row)

    def _land(self, wave, inflight, losses, merged, calls, k, *windows, whole: bool) -> None:
        """Wave ``k``'s updates have all landed: the VW's state holds them (its push is their
        change; ``whole``: its optimizer state too), its losses, the table's idle ticks of its
        calls."""
        at = self.vw.progress
        at.applied += merged
        at.changes += merged
        self._merge(inflight, merged, whole)
        outs = [losses[j] for j in range(len(wave.minibatches))]
        host = jax.device_get([out for out, _ in outs])  # one copy: they are done by the push
        wave.losses[:] = [x[m] for x, (_, m) in zip(host, outs)]
        idle = [sum(w.idle_ticks()[s] for w in windows) for s in range(calls.table.stages)]
        wave.stage_idle = tuple(idle)
        # the record's unit: a forward and a backward (two of the table's ticks)
        wave.idle_ticks = math.ceil(max(idle) / 2)

    def _rebase(self, inflight: hetpipe.InFlight) -> hetpipe.InFlight:
        """The pull (the VW's state holds the pulled weights) landed on what is in flight: its
        difference from the weights now added to them and to the version the wave's last
        minibatch reads (stashed by the last landing: slot ``Nm - 1``)."""
        pulled = self._state_weights()
        return _rebased(inflight, pulled, jnp.arange(self.nm) == self.nm - 1)


def _positions(vw: VirtualWorker, weights) -> tuple | None:
    """Where each of ``vw``'s weight leaves is among ``weights`` (the stages' tree, as ``split``
    gave it from ``vw.state``: the same arrays): ``(treedef, [position per leaf])``, or None
    when they are not the same arrays one to one."""
    _, leaves, _ = tree.arrays(vw.state)
    flat, treedef = jax.tree.flatten(weights)
    where: dict[int, list[int]] = {}
    for j, x in enumerate(flat):
        where.setdefault(id(x), []).append(j)
    at = [where.get(id(leaves[i]), []) for i in vw.leaves.weights]
    if len(at) != len(flat) or any(len(a) != 1 for a in at) or len({*map(tuple, at)}) != len(at):
        return None
    return treedef, [a[0] for a in at]


@jax.jit
def _rebased(inflight: hetpipe.InFlight, pulled, slots: jax.Array) -> hetpipe.InFlight:
    """``inflight`` rebased onto ``pulled`` weights (one program: the difference and the sums)."""
    delta = jax.tree.map(jnp.subtract, pulled, inflight.weights)
    return hetpipe.rebased(inflight, delta, slots)
