"""The parameter server's weights cut into pieces by bytes, and the pieces placed on the stores.

Every piece is one float32 object in one store, and every push and pull costs a request per
piece, while a leaf kept whole makes its store carry most of the bytes and serve a push or a pull
alone. So the leaves that may go to the same stores are laid end to end, flattened, in the
weights' order, and that run of elements is cut into equal pieces of at most ``piece_bytes``, as
many on each of those stores: a small leaf shares a piece with its neighbours, a large one
spreads over the stores. Weights too small to pay for another store's requests
(``spread_bytes`` a store, or a piece) stay on fewer stores. Each piece is a list of *spans*,
ranges of a leaf's flattened elements.
(What the piece size costs: ``benchmarks/RESULTS.md``, ``ps_lean``.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from tenplex_jax._src.errors import WSPError

PIECE_BYTES = 32 << 20
# the fewest bytes worth a store of their own: each store a push or pull talks to costs a
# request per round (about a millisecond of two processes' Python on a small machine), more than
# sending a megabyte takes, so weights smaller than this stay on one store (``RESULTS.md``)
SPREAD_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Span:
    """Elements ``start`` to ``stop`` (one past the last) of leaf ``leaf``, flattened."""

    leaf: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Piece:
    """Consecutive spans of the weights kept as one float32 object in one store.

    Attributes:
      index: its place among the weights' pieces; its name under ``WEIGHTS``, ``PREVIOUS`` and
        a stage is ``p<index>``.
      store: the index of the store that keeps it.
      spans: what it holds, in order: its object is their elements, end to end.
    """

    index: int
    store: int
    spans: tuple[Span, ...]

    @property
    def key(self) -> str:
        return f"p{self.index}"

    @property
    def size(self) -> int:
        """Its elements."""
        return sum(s.size for s in self.spans)


def cut(
    shapes: Mapping[str, tuple[int, ...]],
    stores: int,
    piece_bytes: int = PIECE_BYTES,
    allowed: Mapping[str, Sequence[int]] | None = None,
    spread_bytes: int = SPREAD_BYTES,
) -> tuple[Piece, ...]:
    """Cut float32 leaves into pieces: the leaves allowed the same stores, end to end in the
    weights' order, cut into equal pieces of at most ``piece_bytes``, as many on each of as
    many of those stores as they have ``min(spread_bytes, piece_bytes)`` for (dealt out in turn,
    the least loaded store first).

    >>> layout = cut({"w": (4, 8), "b": (8,)}, stores=2, piece_bytes=128)
    >>> [(p.key, p.store, [(s.leaf, s.start, s.stop) for s in p.spans]) for p in layout]
    [('p0', 0, [('w', 0, 20)]), ('p1', 1, [('w', 20, 32), ('b', 0, 8)])]
    >>> [p.store for p in cut({"w": (4, 8), "b": (8,)}, stores=2)]  # 160 bytes: one store
    [0]

    Args:
      shapes: leaf path -> shape.
      stores: how many stores.
      piece_bytes: the largest piece, bytes (>= 4).
      allowed: leaf path -> the stores it may go to (default: any).
      spread_bytes: the fewest bytes that take another store (>= 4).

    Returns:
      Every piece, in element order within each group of leaves.

    Raises:
      WSPError: ``piece_bytes`` or ``spread_bytes`` below one element, or a leaf allowed no
        store or one that does not exist (``"invalid"``, naming the leaf).
    """
    if min(piece_bytes, spread_bytes) < 4:
        raise WSPError(
            f"piece_bytes and spread_bytes are at least one float32 (4); got {piece_bytes} "
            f"and {spread_bytes}",
            "invalid",
        )
    allowed = allowed or {}
    for path, where in allowed.items():
        if path not in shapes or not where or any(not 0 <= i < stores for i in where):
            raise WSPError(
                f"the stores allowed leaf {path!r} must be a non-empty subset of 0..{stores - 1}"
                f" of a leaf of the weights; got {list(where)}"
                + ("" if path in shapes else " for no such leaf"),
                "invalid",
            )
    groups: dict[tuple[int, ...], list[str]] = {}
    for path in shapes:
        groups.setdefault(tuple(sorted(set(allowed.get(path, range(stores))))), []).append(path)
    load, pieces = [0] * stores, []
    # the largest group first, so the smaller ones even out the stores' loads
    for where, paths in sorted(
        groups.items(), key=lambda kv: -sum(math.prod(shapes[p]) for p in kv[1])
    ):
        sizes = [(p, math.prod(shapes[p])) for p in paths]
        nbytes = 4 * sum(n for _, n in sizes)
        spread = min(len(where), max(1, -(-nbytes // min(spread_bytes, piece_bytes))))
        order = sorted(where, key=lambda i: (load[i], i))[:spread]  # the least loaded first
        for k, spans in enumerate(_equal_runs(sizes, spread, piece_bytes)):
            piece = Piece(index=len(pieces), store=order[k % len(order)], spans=spans)
            load[piece.store] += 4 * piece.size
            pieces.append(piece)
    return tuple(pieces)


def _equal_runs(
    leaves: list[tuple[str, int]], stores: int, piece_bytes: int
) -> list[tuple[Span, ...]]:
    """The leaves ``(path, elements)`` end to end, cut into equal runs of at most
    ``piece_bytes``, a multiple of ``stores`` of them (fewer only where there are fewer
    elements); each run as the spans of the leaves it covers. Empty leaves are in none."""
    total = sum(size for _, size in leaves)
    if total == 0:
        return []
    needed = -(-total // (piece_bytes // 4))
    count = min(total, stores * -(-needed // stores))
    bounds = [total * k // count for k in range(count + 1)]
    starts = [0]
    for _, size in leaves:
        starts.append(starts[-1] + size)
    runs, first = [], 0
    for lo, hi in itertools.pairwise(bounds):
        while starts[first + 1] <= lo:  # leaves that end before this run
            first += 1
        spans, i = [], first
        while i < len(leaves) and starts[i] < hi:
            a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
            if b > a:
                spans.append(Span(leaf=leaves[i][0], start=a, stop=b))
            i += 1
        runs.append(tuple(spans))
    return runs


def gather_piece(piece: Piece, flat: Mapping[str, np.ndarray]) -> np.ndarray:
    """``piece``'s elements of the flattened leaves ``flat``: a view when it is one span."""
    parts = [flat[s.leaf][s.start : s.stop] for s in piece.spans]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def pull_buffer(
    layout: Sequence[Piece], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The arrays of a pull, views of one buffer in which the leaves lie in the pieces' order
    (:func:`check_layout`: each piece is then one run of the buffer): leaf path -> its array,
    and each piece's place in the buffer, so that every piece is received where it belongs,
    whatever leaves it holds."""
    offsets, total = _offsets(layout, shapes)
    buffer = np.empty(total, np.float32)
    out = {
        path: buffer[offsets[path] : offsets[path] + math.prod(shape)].reshape(shape)
        for path, shape in shapes.items()
    }
    places = []
    for p in layout:
        start = offsets[p.spans[0].leaf] + p.spans[0].start
        places.append(buffer[start : start + p.size])
    return out, places


def check_layout(layout: Sequence[Piece], shapes: Mapping[str, tuple[int, ...]], stores: int):
    """ValueError unless every piece is on a store, the pieces' spans cover each leaf's elements
    exactly once (a pull would leave the rest of its arrays unwritten) and each piece is one run
    of :func:`pull_buffer`'s buffer (its spans a leaf's end, then the next leaf's start)."""
    covered: dict[str, list[tuple[int, int]]] = {path: [] for path in shapes}
    for p in layout:
        if not 0 <= p.store < stores:
            raise ValueError(f"piece {p.key} is on store {p.store}; there are {stores}")
        for s in p.spans:
            covered[s.leaf].append((s.start, s.stop))
    for path, ranges in covered.items():
        size, at = math.prod(shapes[path]), 0
        for start, stop in sorted(ranges):
            if start != at or stop <= start:
                break
            at = stop
        if at != size:
            raise ValueError(f"the pieces cover leaf {path!r} of {size} elements as {ranges}")
    offsets, _ = _offsets(layout, shapes)
    for p in layout:
        for s, t in itertools.pairwise(p.spans):
            if offsets[s.leaf] + s.stop != offsets[t.leaf] + t.start:
                raise ValueError(f"piece {p.key}'s spans {s} and {t} are not consecutive")


def _offsets(
    layout: Sequence[Piece], shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, int], int]:
    """Each leaf's first element in one buffer of the leaves in the order the pieces first hold
    them (then the empty ones), and the buffer's size."""
    order = list(dict.fromkeys(s.leaf for p in layout for s in p.spans))
    order += [path for path in shapes if path not in set(order)]
    offsets, at = {}, 0
    for path in order:
        offsets[path], at = at, at + math.prod(shapes[path])
    return offsets, at
