"""The parameter server's weights cut into pieces by bytes, and the pieces placed on the stores.

Every piece is one float32 object in one store, and every push and pull costs a request per
piece: a model's many small leaves (biases, norms), each a piece of its own, made a push of GPT
small (44 leaves, 1.6 MB) take 102 ms over 2 stores, against 11.5 ms for the same bytes as one
leaf (2 cores, one run). A leaf kept whole, on the other hand, makes its store carry most of
the bytes and serve a push or a pull alone. So the leaves that may go to the same stores are
laid end to end, flattened, in the weights' order, and that run of elements is cut into equal
pieces of at most ``piece_bytes``, as many on each of those stores: a small leaf shares a
piece with its neighbours, a large one spreads over the stores. Each piece is a list of
*spans*, ranges of a leaf's flattened elements.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from tenplex_jax._src.errors import WSPError

# the largest piece, by default: a 64 MiB leaf over 2 stores pushed in 0.163 s and pulled in
# 0.067 s as 32 MiB pieces, 0.174 and 0.078 s as 8 MiB ones (2 cores, one run)
PIECE_BYTES = 32 << 20


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
) -> tuple[Piece, ...]:
    """Cut float32 leaves into pieces: the leaves allowed the same stores, end to end in the
    weights' order, cut into equal pieces of at most ``piece_bytes``, as many on each of those
    stores (dealt out in turn, the least loaded store first).

    >>> layout = cut({"w": (4, 8), "b": (8,)}, stores=2, piece_bytes=128)
    >>> [(p.key, p.store, [(s.leaf, s.start, s.stop) for s in p.spans]) for p in layout]
    [('p0', 0, [('w', 0, 20)]), ('p1', 1, [('w', 20, 32), ('b', 0, 8)])]

    Args:
      shapes: leaf path -> shape.
      stores: how many stores.
      piece_bytes: the largest piece, bytes (>= 4).
      allowed: leaf path -> the stores it may go to (default: any).

    Returns:
      Every piece, in element order within each group of leaves.

    Raises:
      WSPError: ``piece_bytes`` below one element, or a leaf allowed no store or one that does
        not exist (``"invalid"``, naming the leaf).
    """
    if piece_bytes < 4:
        raise WSPError(f"piece_bytes is at least one float32 (4); got {piece_bytes}", "invalid")
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
        order = sorted(where, key=lambda i: (load[i], i))  # the least loaded first
        for k, spans in enumerate(_equal_runs(sizes, len(where), piece_bytes)):
            piece = Piece(len(pieces), order[k % len(order)], spans)
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
                spans.append(Span(leaves[i][0], a, b))
            i += 1
        runs.append(tuple(spans))
    return runs
