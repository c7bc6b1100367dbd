"""The dataset PTC: which samples form every global batch, and which rank reads which of them.

:class:`DatasetPTC` fixes the order (a seeded permutation per epoch, cut into global batches; the
device count never enters), :class:`DataState` its position, and :class:`BatchLayout` the split of
one global batch over the data-parallel ranks. ``docs/data.md`` states the contract: epoch ends,
padding, and the gradient units that make training bitwise independent of the rank count.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import math
from typing import Any

import jax
import numpy as np

from tenplex_jax._src.errors import DataError, one_of


class Remainder(enum.StrEnum):
    """What ends an epoch when the global batch does not divide the dataset (``DatasetPTC``'s
    ``remainder``): ``"carry"``, ``"drop"`` or ``"pad"``."""

    CARRY = "carry"
    DROP = "drop"
    PAD = "pad"


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a global batch of ``global_batch`` samples is split over ``ranks`` data-parallel ranks.

    >>> layout = BatchLayout(global_batch=64, ranks=3)
    >>> layout.counts, layout.rows                     # real samples per rank; padded rows in all
    ((22, 21, 21), 66)
    >>> BatchLayout(24, ranks=6, grad_units=8).counts  # 8 gradient units of 3 samples, 6 ranks
    (6, 6, 3, 3, 3, 3)

    The batch is cut into ``units`` equal units (one sample each, or ``grad_units`` gradient
    units); rank ``r`` gets a contiguous run of units, the runs differ by at most one, and
    every run is padded to the longest with rows of weight 0, so any rank count works.

    Attributes:
      global_batch: samples in a global batch, fixed whatever the rank count.
      ranks: data-parallel ranks (``data * fsdp`` of the mesh).
      grad_units: gradient units: the batch is cut into that many units, each a
        ``global_batch / grad_units`` slice whose gradient is computed alone, which makes training
        bitwise independent of ``ranks``; ``None``: one sample per unit (plain data parallelism).
      accumulate: pad every rank's rows to a multiple of ``k`` so a step can run them as ``k``
        sequential microbatches (gradient accumulation for plain data parallelism; gradient
        units already run one unit at a time).

    Raises:
      DataError: a count is < 1, ``grad_units`` does not divide the global batch or comes with
        ``accumulate``, or there are more ranks than units.
    """

    global_batch: int
    ranks: int
    grad_units: int | None = None  # units per global batch; None: one sample per unit
    accumulate: int = 1

    def __post_init__(self):
        if self.global_batch < 1 or self.ranks < 1 or self.accumulate < 1:
            raise DataError(
                f"a batch layout needs global_batch, ranks and accumulate >= 1, got {self}"
            )
        if self.grad_units is not None and self.accumulate != 1:
            raise DataError(
                f"accumulate={self.accumulate} with {self.grad_units} gradient units: gradient "
                "units already run one unit at a time; for less memory use more gradient units"
            )
        units = self.units
        if units < 1 or self.global_batch % units:
            raise DataError(
                f"{units} gradient units must divide the global batch {self.global_batch}; "
                f"choose a divisor of {self.global_batch}"
            )
        if self.ranks > units:
            by_units = self.grad_units is not None
            what = "gradient units" if by_units else "samples in a global batch"
            raise DataError(
                f"{self.ranks} data-parallel ranks but only {units} {what}: every rank needs at "
                f"least one; use at most {units} ranks (data * fsdp), or "
                + ("more gradient units" if by_units else "a larger global batch")
            )

    @classmethod
    def fit(
        cls, global_batch: int, ranks: int, *, max_rows: int, grad_units: int | None = None
    ) -> BatchLayout:
        """The layout whose forward passes hold at most ``max_rows`` rows per device.

        The global batch stays ``global_batch`` whatever the rank count: plain data parallelism
        accumulates gradients over as many microbatches as the cap needs; gradient units run one
        unit per pass, so a unit must fit.

        >>> BatchLayout.fit(64, ranks=2, max_rows=10).accumulate     # 32 rows per rank, 4 passes
        4

        Args:
          global_batch: samples in a global batch.
          ranks: data-parallel ranks.
          max_rows: the most rows a device may hold in one forward pass.
          grad_units: gradient units, or ``None`` for plain data parallelism.

        Returns:
          The layout with the least accumulation (plain) or the given gradient units whose
          :attr:`microbatch` is at most ``max_rows``.

        Raises:
          DataError: ``max_rows < 1``, or a gradient unit alone exceeds ``max_rows``.
        """
        if max_rows < 1:
            raise DataError(f"max_rows must be >= 1, got {max_rows}")
        if grad_units is not None:
            layout = cls(global_batch, ranks, grad_units)
            if layout.unit > max_rows:
                raise DataError(
                    f"a gradient unit of {layout.unit} samples exceeds "
                    f"max_rows={max_rows}; "
                    f"use at least {math.ceil(global_batch / max_rows)} gradient units that divide "
                    f"{global_batch}"
                )
            return layout
        per_rank = math.ceil(global_batch / ranks)
        return cls(global_batch, ranks, accumulate=math.ceil(per_rank / max_rows))

    @property
    def microbatch(self) -> int:
        """Rows a device holds in one forward pass."""
        return self.unit if self.grad_units is not None else self.slots // self.accumulate

    @property
    def units(self) -> int:
        """Units per global batch: ``grad_units``, or ``global_batch`` (one sample each)."""
        return self.global_batch if self.grad_units is None else self.grad_units

    @property
    def unit(self) -> int:
        """Samples per unit."""
        return self.global_batch // self.units

    @property
    def unit_counts(self) -> tuple[int, ...]:
        """Units per rank: balanced, the first ``units % ranks`` ranks get one more."""
        q, r = divmod(self.units, self.ranks)
        return tuple(q + (i < r) for i in range(self.ranks))

    @property
    def slots(self) -> int:
        """Units per rank after padding: the longest run, rounded up to ``accumulate``."""
        longest = self.unit_counts[0]
        return math.ceil(longest / self.accumulate) * self.accumulate

    @property
    def counts(self) -> tuple[int, ...]:
        """Real samples per rank."""
        return tuple(c * self.unit for c in self.unit_counts)

    @property
    def rows(self) -> int:
        """Rows of the padded global batch array: ``ranks * slots * unit``."""
        return self.ranks * self.slots * self.unit

    def unit_rows(self) -> np.ndarray:
        """int64[units]: for unit ``v`` in canonical order, its slot in the padded
        ``[ranks * slots]`` stack of units."""
        out = [r * self.slots + s for r, c in enumerate(self.unit_counts) for s in range(c)]
        return np.asarray(out, dtype=np.int64)

    def positions(self) -> np.ndarray:
        """int64[rows]: for each padded row, its position in the global batch, or -1 (padding).

        >>> BatchLayout(5, ranks=2).positions()         # rank 0: 3 samples, rank 1: 2 and a pad
        array([ 0,  1,  2,  3,  4, -1])
        """
        return _positions(self).copy()

    def rank_rows(self, rank: int) -> slice:
        """The rows of the padded global batch that one rank holds.

        Args:
          rank: a data-parallel rank, ``0 <= rank < ranks`` (not checked).

        Returns:
          A slice of ``slots * unit`` rows.
        """
        per = self.slots * self.unit
        return slice(rank * per, (rank + 1) * per)


@functools.lru_cache(maxsize=64)
def _positions(layout: BatchLayout) -> np.ndarray:
    """``layout.positions()``, computed once per layout (read-only): a global batch's rows are
    laid out at every step."""
    pos = np.full((layout.ranks * layout.slots, layout.unit), -1, dtype=np.int64)
    pos[layout.unit_rows()] = np.arange(layout.global_batch).reshape(layout.units, layout.unit)
    pos = pos.reshape(-1)
    pos.flags.writeable = False
    return pos


MAX_COUNT = 1 << 62  # a data state's counts: sample indices and their sums stay in int64


ROUNDS = 6  # of the Feistel network that orders each epoch
BLOCK = 1 << 16  # positions of an epoch's order computed at once
KEPT_BLOCKS = 4  # the blocks a dataset keeps (a batch may straddle blocks and epochs)
LAID_OUT_STEPS = 32  # global batches whose rows ``samples`` lays out at once ("carry")
ORDER = "feistel"  # DataState.order


@dataclasses.dataclass(frozen=True)
class DataState:
    """Where a :class:`DatasetPTC` stands: a small record, JSON-serializable, saved with the PTC.

    ``DatasetPTC.state()`` makes one, ``DatasetPTC.restore(state)`` resumes from it; the fields
    besides ``consumed`` say which order it counts in, and restoring refuses a record made for
    another order.

    Attributes:
      fingerprint: the dataset's identity (``DatasetPTC.fingerprint``).
      num_samples: samples in the dataset.
      global_batch: samples per global batch.
      seed: the seed of the epochs' permutations.
      remainder: the :class:`Remainder`: what ends an epoch (see ``DatasetPTC``).
      consumed: real samples delivered since the start of epoch 0.
      order: how each epoch's permutation is drawn: ``"feistel"``, a keyed bijection computed
        per position (a record without it was made by a version that drew whole-epoch
        permutations, whose order this one cannot resume).

    Raises:
      DataError: a count is not an integer (``num_samples`` and ``global_batch`` >= 1, ``seed``
        and ``consumed`` >= 0, each below ``2**62`` so that sample indices are int64), the
        fingerprint not a string, or the remainder or order unknown.
    """

    fingerprint: str
    num_samples: int
    global_batch: int
    seed: int
    remainder: Remainder
    consumed: int = 0
    order: str = ORDER

    def __post_init__(self):
        counts = {
            name: getattr(self, name)
            for name in ("num_samples", "global_batch", "seed", "consumed")
        }
        bad = {
            k: v
            for k, v in counts.items()
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not 0 <= v < MAX_COUNT
        }
        bad |= {k: v for k in ("num_samples", "global_batch") if (v := counts[k]) == 0}
        remainders = tuple(r.value for r in Remainder)
        if (
            bad
            or not isinstance(self.fingerprint, str)
            or self.remainder not in remainders
            or self.order != ORDER
        ):
            raise DataError(
                f"a data state has a string fingerprint, integer counts below 2**62 (num_samples "
                f"and global_batch >= 1, seed and consumed >= 0), a remainder in {remainders} "
                f"and the order {ORDER!r}; got {self!r}" + (f" (bad: {bad})" if bad else "")
            )
        object.__setattr__(self, "remainder", Remainder(self.remainder))
        for name, value in counts.items():  # NumPy integers are kept as Python ints
            object.__setattr__(self, name, int(value))

    def to_json(self) -> str:
        """The record as JSON text: an object of the seven fields, keys sorted."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, record) -> DataState:
        """The data state of a dict (the object :meth:`to_json` encodes).

        Args:
          record: a dict with exactly the seven fields.

        Returns:
          The data state.

        Raises:
          DataError: ``record`` is not such a dict, or its values break the rules.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        if isinstance(record, dict) and set(record) == fields - {"order"}:
            raise DataError(
                "this data state was made by a version of tenplex_jax that drew each epoch's "
                "order as a whole permutation; this version orders epochs by position "
                f"(order {ORDER!r}), so it cannot resume that order exactly: {record!r:.300}"
            )
        if not isinstance(record, dict) or set(record) != fields:
            raise DataError(
                f"a data state is an object with keys {sorted(fields)}, got {record!r:.300}"
            )
        return cls(**record)

    @classmethod
    def from_json(cls, text: str) -> DataState:
        """The data state of :meth:`to_json`'s text.

        Args:
          text: JSON text of an object with the seven fields.

        Returns:
          The data state.

        Raises:
          DataError: the text is not JSON, or not such an object.
        """
        try:
            record = json.loads(text)
        except (TypeError, ValueError, RecursionError) as error:
            raise DataError(
                f"a data state is JSON text, got {str(text)[:200]!r}: {error}"
            ) from None
        return cls.from_dict(record)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijective avalanche of uint64s (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _shuffle(positions: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """The elements at ``positions`` of a permutation of ``range(n)`` keyed by ``keys``: a
    balanced Feistel network, one round per key, over the fewest even bits that hold ``n - 1``,
    walked in cycles until it lands in ``range(n)`` (a bijection of ``range(n)``; at most 4
    times the range, so a few walks). Any position costs the same: no epoch is materialized."""
    half = max(1, ((int(n) - 1).bit_length() + 1) // 2)
    shift, low = np.uint64(half), np.uint64((1 << half) - 1)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & low
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & low)
        return (left << shift) | right

    x = encrypt(np.asarray(positions, dtype=np.uint64))
    outside = x >= np.uint64(n)
    while outside.any():
        x[outside] = encrypt(x[outside])
        outside = x >= np.uint64(n)
    return x.astype(np.int64)


class DatasetPTC:
    """A dataset served as a seeded, epoch-by-epoch sequence of global batches.

    Global batch ``k`` is a pure function of (dataset, seed, global batch, ``k``): the device
    count never enters, so a job that resizes sees exactly the batches of one that does not. The
    position is :attr:`step`, saved as a :class:`DataState`.

    >>> ds = DatasetPTC(np.arange(10), global_batch=4, seed=0)
    >>> layout = BatchLayout(global_batch=4, ranks=3)           # 2, 1, 1 samples per rank
    >>> rows, weights, samples = ds.next_batch(layout)           # rows: int64[6], 2 of weight 0
    >>> weights
    array([1., 1., 1., 0., 1., 0.], dtype=float32)
    >>> ds.indices(2)[1]                  # epochs of batch 2's samples: it straddles epochs 0, 1
    array([0, 0, 1, 1])
    >>> ds.step, ds.state().consumed
    (1, 4)

    Args:
      source: anything with ``len()`` and integer indexing whose items are arrays or pytrees of
        arrays: a NumPy array or memmap (indexed with an index array, one read per batch), a
        dict of equally long arrays, or a ``grain.MapDataset`` (indexed item by item).
      global_batch: samples per global batch.
      seed: the seed of every epoch's permutation.
      remainder: what ends an epoch when the global batch does not divide the dataset, a
        :class:`tenplex_jax.data.Remainder`: ``"carry"`` (the epochs form one stream; a batch
        may straddle two), ``"drop"`` (each epoch skips its last ``N % global_batch`` samples)
        or ``"pad"`` (each epoch ends with a short batch, padded with weight-0 rows).
      fingerprint: identifies the dataset in saved states (default: a hash of the length and of
        up to 16 items spread over the dataset).

    Attributes:
      step: global batches delivered so far (the position; :meth:`restore` sets it).
      num_samples: the dataset's length.

    Raises:
      DataError: the source has no length, ``remainder`` is unknown, ``global_batch`` or ``seed``
        is out of range, or the dataset is shorter than one global batch.
    """

    def __init__(
        self,
        source: Any,
        global_batch: int,
        *,
        seed: int = 0,
        remainder: Remainder | str = "carry",
        fingerprint: str | None = None,
    ):
        n = _length(source)
        remainder = one_of(Remainder, remainder, "remainder", DataError)
        if global_batch < 1:
            raise DataError(f"global_batch must be >= 1, got {global_batch}")
        if n < global_batch:
            raise DataError(
                f"the dataset has {n} samples, fewer than one global batch of {global_batch}"
            )
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.source = source
        self.num_samples = n
        self.global_batch = global_batch
        self.seed = seed
        self.remainder = remainder
        self.fingerprint = fingerprint or _fingerprint(source, n)
        self.step = 0  # global batches delivered
        self._blocks: dict[tuple[int, int], np.ndarray] = {}  # (epoch, block) -> its samples
        # ((first step, layout), samples[LAID_OUT_STEPS, rows], weights[rows]): ``samples``'
        self._laid_out: tuple | None = None

    # -- the order: pure functions of (dataset, seed, global batch, step) ---------------------

    @property
    def steps_per_epoch(self) -> float:
        """Global batches per epoch (fractional with ``remainder="carry"``)."""
        n, b = self.num_samples, self.global_batch
        per_epoch = {
            Remainder.CARRY: n / b,
            Remainder.DROP: n // b,
            Remainder.PAD: math.ceil(n / b),
        }
        return per_epoch[self.remainder]

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the samples in one epoch.

        Args:
          epoch: the epoch, from 0.

        Returns:
          A permutation of ``range(num_samples)`` seeded by ``(seed, epoch)``.
        """
        positions = np.arange(self.num_samples)
        return _shuffle(positions, self.num_samples, self._round_keys(epoch))

    def _round_keys(self, epoch: int) -> np.ndarray:
        return np.random.SeedSequence((self.seed, epoch)).generate_state(ROUNDS, np.uint64)

    def _ordered(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at ``positions`` of epoch ``epoch``'s order, computed by blocks of
        ``BLOCK`` positions (``_shuffle``; the last few kept): no epoch is ever held whole, so a
        process that resumes pays for a block, not for the dataset."""
        blocks = positions // BLOCK
        if len(blocks) and blocks.min() == blocks.max():  # one block: a batch, most often
            block = int(blocks[0])
            return self._block(epoch, block)[positions - block * BLOCK].astype(np.int64)
        out = np.empty(len(positions), dtype=np.int64)
        for block in np.unique(blocks):
            mask = blocks == block
            out[mask] = self._block(epoch, int(block))[positions[mask] - block * BLOCK]
        return out

    def _block(self, epoch: int, block: int) -> np.ndarray:
        found = self._blocks.get((epoch, block))
        if found is None:
            start = block * BLOCK
            positions = np.arange(start, min(start + BLOCK, self.num_samples))
            found = _shuffle(positions, self.num_samples, self._round_keys(epoch))
            if len(self._blocks) >= KEPT_BLOCKS:
                self._blocks.pop(next(iter(self._blocks)))  # the oldest
            self._blocks[epoch, block] = found
        return found

    def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples of one global batch and the epoch of each.

        Args:
          step: the global batch, from 0.

        Returns:
          ``(indices, epochs)``: int64[global_batch] sample indices and the epoch each comes
          from; with ``remainder="pad"`` the last batch of an epoch is shorter.

        Raises:
          DataError: ``step < 0``.
        """
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        n, b = self.num_samples, self.global_batch
        if self.remainder == Remainder.CARRY:
            return self._carried(step * b, b)
        epoch, k = divmod(step, int(self.steps_per_epoch))
        offsets = np.arange(k * b, min((k + 1) * b, n))
        return self._ordered(epoch, offsets), np.full(offsets.shape, epoch)

    def _carried(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The samples at positions ``start .. start + count - 1`` of the "carry" stream (the
        epochs' orders one after another) and the epoch of each."""
        n = self.num_samples
        epoch, first = divmod(start, n)
        if first + count <= n:  # within one epoch: a batch, most often
            return self._ordered(epoch, np.arange(first, first + count)), np.full(count, epoch)
        epochs, offsets = np.divmod(np.arange(start, start + count), n)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._ordered(int(epoch), offsets[mask])
        return out, epochs

    def consumed_after(self, step: int) -> int:
        """Real samples delivered by global batches ``0 .. step - 1``.

        Args:
          step: a global batch count.

        Returns:
          The sample count (what :class:`DataState` records as ``consumed``).
        """
        n, b = self.num_samples, self.global_batch
        if self.remainder == Remainder.CARRY:
            return step * b
        spe = int(self.steps_per_epoch)
        epoch, k = divmod(step, spe)
        per_epoch = n if self.remainder == Remainder.PAD else spe * b
        return epoch * per_epoch + min(k * b, n)

    # -- the position ---------------------------------------------------------------------------

    def state(self) -> DataState:
        """The position as a :class:`DataState`, to save beside the train state."""
        return DataState(
            fingerprint=self.fingerprint,
            num_samples=self.num_samples,
            global_batch=self.global_batch,
            seed=self.seed,
            remainder=self.remainder,
            consumed=self.consumed_after(self.step),
        )

    def restore(self, state: DataState) -> None:
        """Resume at the sample after a saved position: set :attr:`step` from it.

        Args:
          state: a :class:`DataState` from this dataset's :meth:`state` (here or in an earlier
            run).

        Raises:
          DataError: the state was made for another order (fingerprint, sample count, global
            batch, seed or remainder differ), or its ``consumed`` is not a global-batch boundary.
        """
        saved, mine = json.loads(state.to_json()), json.loads(self.state().to_json())
        for name in ("fingerprint", "num_samples", "global_batch", "seed", "remainder"):
            if saved[name] != mine[name]:
                raise DataError(
                    f"cannot restore a data state saved with {name}={saved[name]!r} onto a "
                    f"dataset with {name}={mine[name]!r}: it counts samples in another order; "
                    "restore it onto the dataset and global batch size it was saved with"
                )
        step = self._step_of(state.consumed)
        if step is None:
            raise DataError(
                f"consumed={state.consumed} is not a global-batch boundary of this order "
                f"(global batch {self.global_batch}, {self.num_samples} samples, "
                f"remainder={str(self.remainder)!r})"
            )
        self.step = step

    def _step_of(self, consumed: int) -> int | None:
        if consumed < 0:
            return None
        if self.remainder == Remainder.CARRY:
            step, r = divmod(consumed, self.global_batch)
            return None if r else step
        spe = int(self.steps_per_epoch)
        per_epoch = self.consumed_after(spe)
        epoch, within = divmod(consumed, per_epoch)
        k, r = divmod(within, self.global_batch)
        return None if r else epoch * spe + k

    # -- serving ---------------------------------------------------------------------------------

    def load(self, indices: np.ndarray) -> Any:
        """Read items of the source.

        Args:
          indices: int sample indices (any order, repeats allowed).

        Returns:
          The items stacked along a new leading dim: a pytree of NumPy arrays.
        """
        return _load(self.source, indices)

    def samples(self, step: int, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
        """Which sample each row of a global batch holds, laid out for ``layout``. Reads no data.

        Args:
          step: the global batch.
          layout: its :class:`BatchLayout`, for this dataset's global batch.

        Returns:
          ``(samples, weights)``: int64[rows], the sample in every row (-1 on padding), and
          float32[rows] weights, 1 on real rows and 0 on padding.

        Raises:
          DataError: the layout is for another global batch size.
        """
        self._check_layout(layout)
        if self.remainder == Remainder.CARRY and step >= 0:  # every batch whole: laid out ahead
            first = step - step % LAID_OUT_STEPS
            if self._laid_out is None or self._laid_out[0] != (first, layout):
                self._laid_out = ((first, layout), *self._lay_out(first, layout))
            return self._laid_out[1][step - first].copy(), self._laid_out[2].copy()
        indices, _ = self.indices(step)
        pos = _positions(layout)
        real = (pos >= 0) & (pos < len(indices))  # "pad": a short batch leaves more rows empty
        return np.where(real, indices[np.where(real, pos, 0)], -1), real.astype(np.float32)

    def _lay_out(self, first: int, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
        """``samples`` of the ``LAID_OUT_STEPS`` global batches from ``first`` ("carry": each
        holds ``global_batch`` samples): int64[LAID_OUT_STEPS, rows] and their weights."""
        b = self.global_batch
        indices, _ = self._carried(first * b, LAID_OUT_STEPS * b)
        pos = _positions(layout)
        real = pos >= 0
        rows = indices.reshape(LAID_OUT_STEPS, b)[:, np.where(real, pos, 0)]
        return np.where(real, rows, -1), real.astype(np.float32)

    def read(self, samples: np.ndarray) -> Any:
        """The data of the rows holding some samples.

        Args:
          samples: int64 sample indices, -1 for a padding row (as :meth:`samples` gives them).

        Returns:
          A pytree of arrays with one row per entry; a padding row repeats a real sample (its
          weight is 0, so it only has to be valid input).
        """
        fill = samples[samples >= 0][0] if (samples >= 0).any() else 0
        return self.load(np.where(samples >= 0, samples, fill))

    def batch(self, step: int, layout: BatchLayout) -> tuple[Any, np.ndarray, np.ndarray]:
        """One global batch, read and laid out for ``layout`` (on the host).

        Args:
          step: the global batch.
          layout: its :class:`BatchLayout`.

        Returns:
          ``(rows, weights, samples)``: a pytree of arrays with leading dim ``layout.rows``
          (padding rows repeat a real sample), float32[rows] weights (0 on padding) and the int64
          sample index of every row (-1 on padding).

        Raises:
          DataError: the layout is for another global batch size.
        """
        samples, weights = self.samples(step, layout)
        return self.read(samples), weights, samples

    def rank_batch(self, step: int, layout: BatchLayout, rank: int):
        """One rank's part of a global batch: only its samples are read, so a process loads just
        what its devices hold.

        Args:
          step: the global batch.
          layout: its :class:`BatchLayout`.
          rank: the data-parallel rank, ``0 <= rank < layout.ranks``.

        Returns:
          The triple of :meth:`batch`, for the rank's ``layout.rank_rows(rank)`` only.

        Raises:
          DataError: the rank is out of range, or the layout is for another global batch size.
        """
        if not 0 <= rank < layout.ranks:
            raise DataError(f"rank {rank} is not in 0..{layout.ranks - 1}")
        samples, weights = self.samples(step, layout)
        rows = layout.rank_rows(rank)
        return self.read(samples[rows]), weights[rows], samples[rows]

    def next_batch(self, layout: BatchLayout) -> tuple[Any, np.ndarray, np.ndarray]:
        """The batch at :attr:`step`, then advance :attr:`step` by one.

        Args:
          layout: the :class:`BatchLayout` of the current mesh.

        Returns:
          The triple of :meth:`batch`.

        Raises:
          DataError: the layout is for another global batch size.
        """
        out = self.batch(self.step, layout)
        self.step += 1
        return out

    def _check_layout(self, layout: BatchLayout) -> None:
        if layout.global_batch != self.global_batch:
            raise DataError(
                f"the batch layout is for a global batch of {layout.global_batch}, the dataset "
                f"serves {self.global_batch}: the global batch is fixed across resizes"
            )


def _length(source) -> int:
    if isinstance(source, dict):
        lengths = {key: _length(value) for key, value in source.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"a dict source needs one length for all its arrays, got {lengths}")
        return next(iter(lengths.values()))
    try:
        return len(source)
    except TypeError:
        raise DataError(
            f"a dataset source needs len() and integer indexing, got {type(source).__name__}"
        ) from None


def _load(source, indices: np.ndarray) -> Any:
    indices = np.asarray(indices, dtype=np.int64)
    if isinstance(source, np.ndarray):  # memmaps too: read in ascending order, then reorder
        order = np.argsort(indices, kind="stable")
        out = np.empty((len(indices), *source.shape[1:]), source.dtype)
        out[order] = source[indices[order]]
        return out
    if isinstance(source, dict):
        return {key: _load(value, indices) for key, value in source.items()}
    items = [source[int(i)] for i in indices]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *items)


def _fingerprint(source, n: int) -> str:
    """A hash of the length and of up to 16 items spread over the dataset."""
    h = hashlib.sha256(str(n).encode())
    picks = np.unique(np.linspace(0, n - 1, num=min(n, 16)).astype(np.int64))
    for leaf in jax.tree.leaves(_load(source, picks)):
        leaf = np.ascontiguousarray(leaf)
        h.update(f"{leaf.dtype}{leaf.shape}".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()[:16]
