"""Boxes: the one vocabulary for a block of an array, shared by the plan, the executor, the tensor
store and the commit protocol.

A *box* is one half-open ``(start, stop)`` interval per dim, in the global indices of an array::

    Box = tuple[tuple[int, int], ...]        # ((0, 4), (8, 16)): rows 0..3, columns 8..15

It is what ``NamedSharding.devices_indices_map`` gives per device, with slices as intervals (see
:func:`of_index`), and what a store object covers. Boxes are plain tuples: hashable, cheap to build
by the million when planning for thousands of devices. This module imports neither JAX nor NumPy,
so the store server and the planner can use it alone.

>>> a, b = ((0, 4), (0, 8)), ((2, 6), (4, 8))
>>> intersect(a, b), contains(a, ((1, 2), (0, 8))), shape(b)
(((2, 4), (4, 8)), True, (4, 4))
>>> index(((2, 4), (4, 8)), a)          # where that block sits in an array covering ``a``
(Ellipsis, slice(2, 4, None), slice(4, 8, None))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Shape = tuple[int, ...]
"""An array's shape: one size per dim."""
Box = tuple[tuple[int, int], ...]
"""A block of an array: one half-open ``(start, stop)`` per dim, in global indices
(``((0, 4), (8, 16))``: rows 0..3, columns 8..15; ``()`` for a scalar)."""


def shape(box: Box) -> Shape:
    """The shape of the block a box covers."""
    return tuple(stop - start for start, stop in box)


def full(array_shape: Sequence[int]) -> Box:
    """The box of a whole array."""
    return tuple((0, int(n)) for n in array_shape)


def size(box: Box) -> int:
    """Elements in the box (1 for a scalar's empty box)."""
    return math.prod(stop - start for start, stop in box)


def nbytes(box: Box, itemsize: int) -> int:
    return size(box) * itemsize


def contains(outer: Box, inner: Box) -> bool:
    return len(outer) == len(inner) and all(
        olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner)
    )


def intersect(a: Box, b: Box) -> Box:
    """The common part of two boxes (a dim with ``start >= stop`` means they are disjoint)."""
    return tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b))


def within(box: Box, array_shape: Sequence[int]) -> bool:
    """Whether ``box`` is a valid box of an array of ``array_shape`` (one ordered interval per dim,
    inside the array)."""
    return len(box) == len(array_shape) and all(
        0 <= start <= stop <= n for (start, stop), n in zip(box, array_shape)
    )


def index(inner: Box, outer: Box) -> tuple:
    """The index into an array covering ``outer`` that selects ``inner`` (global coordinates).

    The leading ``Ellipsis`` keeps a scalar's index a 0-d view rather than a copy of its element.
    """
    return (..., *(slice(lo - olo, hi - olo) for (lo, hi), (olo, _) in zip(inner, outer)))


def of_index(idx: Iterable[slice], array_shape: Sequence[int]) -> Box:
    """A box from a tuple of slices, as ``Sharding.devices_indices_map`` gives them."""
    return tuple(s.indices(n)[:2] for s, n in zip(idx, array_shape))


def parse(value) -> Box:
    """A box from any nesting of int pairs (JSON lists, tuples, NumPy ints); shape unchecked.

    Raises ``TypeError`` or ``ValueError`` on anything else.
    """
    return tuple((int(start), int(stop)) for start, stop in value)


def to_json(box: Box) -> list[list[int]]:
    return [list(interval) for interval in box]
