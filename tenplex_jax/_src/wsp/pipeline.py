"""HetPipe's pipeline within a virtual worker as a tick table: at which tick each stage runs each
minibatch's forward and backward, when each update lands, and how long each stage idles per wave.

Two schedules of one VW of ``stages`` stages with ``Nm`` minibatches in flight:

- **per wave** (the wave program the VW runs today, ``wave_step``): a wave's ``Nm`` minibatches
  enter only once the previous wave's program has ended, run through the stages as one GPipe
  schedule (every forward, then every backward), and land at its end. Each stage idles
  ``2 (stages - 1)`` ticks per wave: the fill of the forwards and the drain of the backwards
  (``WaveRecord.idle_ticks`` counts them as ``stages - 1`` ticks of a forward and a backward).
- **unbroken** (HetPipe's slides): minibatch ``p`` enters the first stage as soon as ``p - Nm``
  has landed (its backward left the first stage), whatever wave it belongs to; a stage runs a
  ready backward before a ready forward (one-forward-one-backward, which keeps at most ``Nm`` in
  flight). Only the minibatch the clock distance blocks (a wave's last, which reads the pulled
  weights) waits, ``waits[wave]`` ticks for the pull; those in flight go on meanwhile.

In both, minibatch ``p`` reads the weights stashed when ``p - Nm`` landed (weight stashing), so
its local staleness is exactly ``Nm - 1`` once the pipeline is full: :meth:`Schedule.check`
proves that no minibatch enters before the update it must hold has landed. A tick is one stage
running one minibatch's forward or backward (the slides draw them the same width).

This module plans; it runs nothing (no JAX): :mod:`~tenplex_jax._src.wsp.hetpipe` runs a table
(:meth:`Schedule.arrays`), each tick one step of a ``lax.scan``, each stage picking its slot by
``axis_index``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from tenplex_jax._src.errors import WSPError

Ticks = tuple[tuple[int, ...], ...]  # [minibatch][stage] -> the tick its slot runs at


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A VW's tick table over ``len(waits)`` waves of ``nm`` minibatches.

    Attributes:
      stages: the pipeline's stages.
      nm: ``Nm``, the minibatches of a wave (and the most in flight).
      waits: per wave, the ticks its last minibatch waited for a pull (0: not blocked).
      unbroken: HetPipe's pipeline (True) or one fill and drain per wave (False).
      forward: ``forward[p][s]``, the tick stage ``s`` runs minibatch ``p``'s forward at.
      backward: ``backward[p][s]``, the tick it runs its backward at; ``p``'s update lands at
        the end of the tick of :meth:`landed`.
    """

    stages: int
    nm: int
    waits: tuple[int, ...]
    unbroken: bool
    forward: Ticks
    backward: Ticks

    @property
    def ticks(self) -> int:
        """The ticks from the first minibatch's entry to the last update's landing."""
        return max(self.landed(p) for p in range(len(self.forward))) + 1

    def landed(self, p: int) -> int:
        """The tick at whose end minibatch ``p``'s update lands: its wave program's last tick per
        wave, its backward on the first stage unbroken."""
        if self.unbroken:
            return self.backward[p][0]
        wave = range(p - p % self.nm, p - p % self.nm + self.nm)
        return max(self.backward[q][0] for q in wave)

    def entered(self, p: int) -> int:
        """The tick minibatch ``p`` enters the first stage (and reads its weights) at."""
        return self.forward[p][0]

    def idle_ticks(self) -> tuple[tuple[int, ...], ...]:
        """Per wave, per stage: the ticks the stage ran nothing from the wave's first entry to
        the next wave's (to the last landing, for the last wave)."""
        starts = [self.entered(k * self.nm) for k in range(len(self.waits))] + [self.ticks]
        busy = [sorted(f[s] for f in self.forward + self.backward) for s in range(self.stages)]
        return tuple(
            tuple(b - a - sum(a <= t < b for t in busy[s]) for s in range(self.stages))
            for a, b in itertools.pairwise(starts)
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The table as an executor indexes it, ``-1`` for nothing: ``forward[t, s]`` and
        ``backward[t, s]``, the minibatch stage ``s`` runs at tick ``t``; ``landing[t, i]``, the
        ``i``-th update landing at the end of tick ``t`` (a wave program lands its wave at once,
        in order)."""
        n = len(self.forward)
        forward = np.full((self.ticks, self.stages), -1, np.int32)
        backward = np.full((self.ticks, self.stages), -1, np.int32)
        for p in range(n):
            for s in range(self.stages):
                forward[self.forward[p][s], s] = p
                backward[self.backward[p][s], s] = p
        at = [self.landed(p) for p in range(n)]
        landing = np.full((self.ticks, max(at.count(t) for t in set(at))), -1, np.int32)
        for p, t in enumerate(at):
            landing[t, list(landing[t]).index(-1)] = p
        return forward, backward, landing

    def check(self) -> None:
        """Raise unless the table is a pipeline: one slot per stage per tick; a forward after the
        previous stage's, a backward after its own forward and the next stage's backward; and
        minibatch ``p`` entering only after ``p - Nm`` landed (staleness exactly ``Nm - 1``).

        Raises:
          WSPError: the first rule broken, with the minibatch, stage and ticks (``"invalid"``).
        """
        fail = lambda rule: WSPError(f"the tick table breaks a rule: {rule}", "invalid")
        for s in range(self.stages):
            slots = [f[s] for f in self.forward] + [b[s] for b in self.backward]
            if len(set(slots)) != len(slots):
                raise fail(f"stage {s} runs two slots at one tick (ticks {sorted(slots)})")
        for p, (f, b) in enumerate(zip(self.forward, self.backward)):
            for s in range(self.stages):
                after = [b[s + 1]] if s + 1 < self.stages else []
                if (s and f[s] <= f[s - 1]) or b[s] <= max([f[s], *after]):
                    raise fail(f"minibatch {p} at stage {s}: forwards {f}, backwards {b}")
            if p >= self.nm and self.entered(p) <= self.landed(p - self.nm):
                raise fail(
                    f"minibatch {p} enters at tick {self.entered(p)}, before minibatch "
                    f"{p - self.nm} landed at the end of tick {self.landed(p - self.nm)}"
                )


def schedule(stages: int, nm: int, waits: Sequence[int], *, unbroken: bool) -> Schedule:
    """The tick table of a VW of ``stages`` stages training ``len(waits)`` waves of ``nm``
    minibatches, wave ``k``'s last minibatch blocked ``waits[k]`` ticks by the clock distance.

    >>> [t[0] for t in schedule(2, 2, [0, 0, 0], unbroken=False).idle_ticks()]
    [2, 2, 2]
    >>> [t[0] for t in schedule(2, 2, [0, 0, 0], unbroken=True).idle_ticks()]  # fill, drain
    [1, 0, 1]

    Raises:
      WSPError: ``stages`` or ``nm`` below 1, no waves, or a wait below 0 (``"invalid"``).
    """
    waits = tuple(waits)
    for name, value, low in (("stages", stages, 1), ("nm", nm, 1), ("waves", len(waits), 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise WSPError(f"a tick table needs {name} >= {low}, got {value!r}", "invalid")
    if any(not isinstance(w, int) or w < 0 for w in waits):
        raise WSPError(f"a tick table needs waits of ints >= 0, got {waits}", "invalid")
    table = (_unbroken if unbroken else _per_wave)(stages, nm, waits)
    out = Schedule(stages, nm, waits, unbroken, *table)
    out.check()
    return out


def _per_wave(stages: int, nm: int, waits: tuple[int, ...]) -> tuple[Ticks, Ticks]:
    """One GPipe program per wave: forwards in ``nm + stages - 1`` ticks, then the backwards
    (their reverse); the next wave's program starts when this one ends, after its pull."""
    span, forward, backward, start = nm + stages - 1, [], [], 0
    for wait in waits:
        start += wait  # the whole program waits for its last read's pull
        for j in range(nm):
            forward.append(tuple(start + j + s for s in range(stages)))
            backward.append(
                tuple(start + span + (nm - 1 - j) + (stages - 1 - s) for s in range(stages))
            )
        start += 2 * span
    return tuple(forward), tuple(backward)


def _unbroken(stages: int, nm: int, waits: tuple[int, ...]) -> tuple[Ticks, Ticks]:
    """HetPipe's pipeline, greedily: each tick each stage runs its oldest ready backward, else its
    next ready forward; minibatch ``p`` is ready to enter once ``p - nm`` landed (and, if its
    wave's pull blocks it, the wait after)."""
    n, last = len(waits) * nm, stages - 1
    forward = [[None] * stages for _ in range(n)]
    backward = [[None] * stages for _ in range(n)]
    done = lambda slot, t: slot is not None and slot < t
    entered = [0] * stages  # per stage: the forwards it has run (they run in order)
    # every tick runs at least one slot (the oldest minibatch in flight always has one ready), so
    # the table ends within this many ticks
    bound = 2 * stages * n + sum(waits) + 1
    for t in range(bound):
        for s in range(stages):
            ready = [
                p
                for p in range(n)
                if backward[p][s] is None
                and done(forward[p][s], t)
                and (s == last or done(backward[p][s + 1], t))
            ]
            if ready:
                backward[ready[0]][s] = t
                continue
            p = entered[s]
            if p == n or (s and not done(forward[p][s - 1], t)):
                continue
            if s == 0 and p >= nm:
                landed = backward[p - nm][0]
                wait = waits[p // nm] if p % nm == nm - 1 else 0
                if not done(landed, t - wait):
                    continue
            if s == 0 and p < nm and p % nm == nm - 1 and t < waits[0]:
                continue
            forward[p][s] = t
            entered[s] += 1
        if all(b[0] is not None for b in backward):
            break
    return tuple(map(tuple, forward)), tuple(map(tuple, backward))
