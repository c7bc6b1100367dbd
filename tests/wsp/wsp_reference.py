"""Wave synchronous parallel (HetPipe's WSP) by its definition, for a few virtual workers (VWs)
on one fixed interleaving: a sequential reference, with no stores and no threads, which the
runtime driven through the same interleaving (``wsp_gates.py``) must match minibatch by
minibatch.

An interleaving is a sequence of steps (:func:`interleaving` reads it from text): ``"a"`` starts
VW ``a``'s next wave, ``"a^"`` commits the oldest wave ``a`` has pushed. Between two steps a VW
does only what involves no other VW: it lands its wave's updates one at a time (its next wave's
first ``Nm - 1`` minibatches reading the weights in between) and pushes the wave. So the steps
fix everything one VW sees of another: which minibatches each wave claims (the cursor, in the
order the waves start), when each wave joins the global weights, and which commits each pull
holds. The rules, as ``docs/wsp.md`` states them (every VW joins at clock 0, before any commit):

- a VW's minibatch ``p`` reads its local weights holding its own updates up to ``p - Nm``; its
  update ``step(read) - read`` lands on the local weights as they are when it lands;
- wave ``k`` is pushed, as the change of the local weights since it started, once its last
  update has landed and the VW's wave ``k - 1`` has committed (one push in flight): a VW starts
  wave ``k + 1`` only once its wave ``k - 1`` has committed;
- before wave ``k``'s last minibatch reads (its first ``Nm - 1`` read before): if the VW's last
  pull held every VW's first ``k - D`` waves, it goes on; else, once every VW has committed
  ``k - D`` waves (it **waits** until then), it **pulls**: the global weights (every committed
  wave) plus its own wave in flight;
- a VW's clock counts its waves pushed; a read's global staleness is that clock minus the
  slowest clock its VW's last pull saw (its own counted as its clock).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of an interleaving: VW ``vw`` starts its next wave, or commits its oldest pushed
    wave (``commit``)."""

    vw: str
    commit: bool = False

    def __str__(self) -> str:
        return self.vw + ("^" if self.commit else "")


def interleaving(text: str) -> tuple[Step, ...]:
    """The steps of ``text``: whitespace-separated VW names (a wave starts), ``name^`` (a commit).

    >>> [str(s) for s in interleaving("a b a^")]
    ['a', 'b', 'a^']
    """
    steps = []
    for token in text.split():
        name = token.removesuffix("^")
        if not name.isidentifier():
            raise ValueError(f"a step is a VW's name, or its name and '^'; got {token!r}")
        steps.append(Step(name, token.endswith("^")))
    return tuple(steps)


@dataclasses.dataclass(frozen=True)
class Version:
    """What the weights a minibatch read held: each VW's waves as its VW's last pull found them
    committed (the join's pull included), and its VW's own updates landed (counted from the
    join: every own wave is in the local weights, pushed or not)."""

    pulled: tuple[tuple[str, int], ...]  # (vw, waves committed), by name
    own: int


@dataclasses.dataclass(frozen=True)
class Wave:
    """One wave of one VW, as the reference trains it."""

    vw: str
    wave: int
    minibatches: tuple[int, ...]
    versions: tuple[Version, ...]  # per minibatch: what the weights it read held
    local_staleness: tuple[int, ...]  # per minibatch: own earlier minibatches it missed
    global_staleness: tuple[int, ...]  # per minibatch: its VW's clock minus the slowest pulled
    slowest: int  # the slowest VW's commits when the wave started
    pulled: bool  # it pulled before its last minibatch read
    waited: bool  # it waited for another VW's commit first
    change: dict[str, np.ndarray]  # its push: the change of the weights over it


@dataclasses.dataclass(frozen=True)
class Seen:
    """What one step makes visible to the other VWs and to a driver of the runtime."""

    step: Step
    wave: int  # the wave the step starts or commits
    waits: bool  # a start that waits for another VW's commit
    starts: tuple[tuple[str, int, tuple[int, ...]], ...]  # waves claimed: (vw, wave, minibatches)
    weights: dict[str, np.ndarray] | None  # after a commit: the global weights


@dataclasses.dataclass(frozen=True)
class Reference:
    """A run of the reference: each step's :class:`Seen`, each wave, the final global weights."""

    steps: tuple[Seen, ...]
    waves: dict[tuple[str, int], Wave]
    weights: dict[str, np.ndarray]
    total: int  # minibatches claimed


@jax.jit
def _landed(current, after, read):
    """An update computed on ``read`` (the step made it ``after``), added to ``current``."""
    return jax.tree.map(lambda c, a, r: c + (a - r), current, after, read)


@jax.jit
def _add(weights, change):
    return jax.tree.map(lambda w, c: w + c, weights, change)


@jax.jit
def _change(end, start):
    return jax.tree.map(lambda e, s: e - s, end, start)


@dataclasses.dataclass
class _Read:
    weights: object
    version: Version
    behind: int


@dataclasses.dataclass
class _VW:
    """A VW's own state in the reference."""

    name: str
    weights: object  # its local weights (a pytree)
    applied: int = 0  # own updates landed
    started: int = 0  # own minibatches claimed
    clock: int = 0  # waves pushed
    fresh: int = 0  # the slowest clock its last pull saw
    pulled: dict[str, int] = dataclasses.field(default_factory=dict)  # commits at its last pull
    waves: int = 0  # waves started
    reads: list[_Read] = dataclasses.field(default_factory=list)  # its next wave's, so far
    pushes: list[tuple[int, object]] = dataclasses.field(default_factory=list)  # uncommitted
    waiting: bool = False  # its next wave waits for a commit


class _Run:
    """The reference's state between steps."""

    def __init__(self, names, weights, step, minibatches, distance, host):
        self.step, self.nm, self.distance, self.host = step, minibatches, distance, host
        self.glob, self.cursor = weights, 0
        self.committed = dict.fromkeys(names, 0)
        self.vws = {v: _VW(v, weights, pulled=dict(self.committed)) for v in names}
        self.waves: dict[tuple[str, int], Wave] = {}
        for vw in self.vws.values():  # wave 0's first Nm - 1 minibatches read the joined weights
            vw.reads = [self._read(vw) for _ in range(self.nm - 1)]

    def _read(self, vw: _VW) -> _Read:
        version = Version(tuple(sorted(vw.pulled.items())), vw.applied)
        return _Read(vw.weights, version, max(vw.clock - vw.fresh, 0))

    def start(self, vw: _VW, where: str) -> tuple[bool, tuple]:
        """``vw`` starts its next wave: (whether it waits, the waves claimed)."""
        k = vw.waves
        if vw.waiting:
            raise ValueError(f"{where}: {vw.name} waits to start wave {k}; it cannot start another")
        if any(wave < k - 1 for wave, _ in vw.pushes):
            raise ValueError(
                f"{where}: {vw.name} starts wave {k} only once its wave {k - 2} has committed "
                f"(one push in flight); its uncommitted waves: {[w for w, _ in vw.pushes]}"
            )
        if vw.fresh >= k - self.distance:
            return False, (self._go(vw, pull=False, waited=False),)
        if min(self.committed.values()) >= k - self.distance:
            return False, (self._go(vw, pull=True, waited=False),)
        vw.waiting = True
        return True, ()

    def commit(self, vw: _VW, where: str) -> tuple[int, tuple]:
        """``vw``'s oldest pushed wave commits: (the wave, the waves the commit lets start)."""
        if not vw.pushes:
            raise ValueError(f"{where}: {vw.name} has no pushed wave to commit")
        wave, change = vw.pushes.pop(0)
        self.glob = _add(self.glob, change)
        self.committed[vw.name] += 1
        slowest = min(self.committed.values())
        going = [u for u in self.vws.values() if u.waiting and slowest >= u.waves - self.distance]
        if len(going) > 1:  # they would claim at once, in no fixed order
            raise ValueError(
                f"{where}: the commit lets {[u.name for u in going]} start at once; an "
                "interleaving fixes the order of the claims"
            )
        for u in going:
            u.waiting = False
        return wave, tuple(self._go(u, pull=True, waited=True) for u in going)

    def _go(self, vw: _VW, pull: bool, waited: bool) -> tuple[str, int, tuple[int, ...]]:
        """``vw``'s next wave goes (after a pull): it claims, its last minibatch reads; then,
        with no other VW involved, its updates land and it is pushed."""
        k, nm = vw.waves, self.nm
        if pull:  # the global weights and its own wave in flight
            weights = self.glob
            for _, change in vw.pushes:
                weights = _add(weights, change)
            vw.weights, vw.pulled = weights, dict(self.committed)
            others = [c for name, c in self.committed.items() if name != vw.name]
            vw.fresh = min([*others, vw.clock])
        minibatches = tuple(range(self.cursor, self.cursor + nm))
        self.cursor += nm
        reads, vw.reads = [*vw.reads, self._read(vw)], []
        start = vw.weights
        for j, q in enumerate(minibatches):  # the wave lands; the next one's first reads
            read = reads[j]
            after = self.step(read.weights, q)
            current = vw.weights is read.weights  # nothing landed or pulled since it read
            vw.weights = after if current else _landed(vw.weights, after, read.weights)
            vw.applied += 1
            if j < nm - 1:
                vw.reads.append(self._read(vw))
        change = _change(vw.weights, start)
        vw.pushes.append((k, change))
        self.waves[vw.name, k] = Wave(
            vw=vw.name,
            wave=k,
            minibatches=minibatches,
            versions=tuple(r.version for r in reads),
            local_staleness=tuple(vw.started + j - r.version.own for j, r in enumerate(reads)),
            global_staleness=tuple(r.behind for r in reads),
            slowest=min(self.committed.values()),
            pulled=pull,
            waited=waited,
            change=self.host(change),
        )
        vw.started += nm
        vw.clock, vw.waves = k + 1, k + 1
        return vw.name, k, minibatches


def reference(
    steps: Sequence[Step],
    names: Sequence[str],
    weights,
    step: Callable,
    *,
    minibatches: int,
    distance: int,
    host: Callable[[object], dict[str, np.ndarray]],
) -> Reference:
    """WSP by its definition (the module's docstring) on the interleaving ``steps``.

    Args:
      steps: the interleaving; it must end with every VW's waves committed and none waiting.
      names: the VWs, all joined at clock 0 before the first step.
      weights: the initial weights (a pytree).
      step: ``step(weights, minibatch)``: the weights after one optimizer step on the minibatch
        from ``weights`` (a stateless optimizer: SGD).
      minibatches: ``Nm``.
      distance: ``D``.
      host: the weights as the parameter server holds them (leaf path -> float32 array).

    Raises:
      ValueError: a step the runtime cannot take there (it names the step and the rule): a
        start of a VW that waits, or whose wave two before has not committed; a commit with
        nothing pushed; a commit that lets two waiting VWs start at once; an end with waves
        uncommitted or a VW waiting.
    """
    run = _Run(tuple(names), weights, step, minibatches, distance, host)
    seen = []
    for i, s in enumerate(steps):
        where = f"step {i} ({s})"
        if s.vw not in run.vws:
            raise ValueError(f"{where}: no VW {s.vw!r} among {list(names)}")
        vw = run.vws[s.vw]
        if s.commit:
            wave, starts = run.commit(vw, where)
            seen.append(Seen(s, wave, False, starts, host(run.glob)))
        else:
            wave = vw.waves
            waits, starts = run.start(vw, where)
            seen.append(Seen(s, wave, waits, starts, None))
    for vw in run.vws.values():
        left = [f"waiting to start wave {vw.waves}"] if vw.waiting else []
        left += [f"waves {[w for w, _ in vw.pushes]} uncommitted"] if vw.pushes else []
        if left:
            raise ValueError(f"the interleaving ends with VW {vw.name}: {'; '.join(left)}")
    return Reference(tuple(seen), run.waves, host(run.glob), run.cursor)
