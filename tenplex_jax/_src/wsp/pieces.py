"""The parameter server's weights cut into pieces by bytes, and the pieces placed on the stores.

A leaf kept whole lives in one store: a large one would make that store carry most of the bytes
and serve a push or a pull alone. So each float32 leaf is cut into contiguous ranges of its
flattened elements of at most ``piece_bytes``, and each piece goes to the least loaded store it
may go to (a leaf may be confined to some stores: those of the nodes that run its stage).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from tenplex_jax._src.errors import WSPError

# the largest piece of a leaf, by default: a 64 MiB leaf over 2 stores pushed in 0.163 s and
# pulled in 0.067 s as 32 MiB pieces, 0.174 and 0.078 s as 8 MiB ones (2 cores, one run)
PIECE_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Piece:
    """A range of a leaf's flattened elements, kept as one float32 object in one store.

    Attributes:
      leaf: the leaf's path.
      index: the piece's place among its leaf's pieces.
      store: the index of the store that keeps it.
      start: its first element in the flattened leaf.
      stop: one past its last.
    """

    leaf: str
    index: int
    store: int
    start: int
    stop: int

    @property
    def key(self) -> str:
        """Its name under ``WEIGHTS``, ``PREVIOUS`` and a stage."""
        return f"{self.leaf}#{self.index}"


def cut(
    shapes: Mapping[str, tuple[int, ...]],
    stores: int,
    piece_bytes: int = PIECE_BYTES,
    allowed: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, tuple[Piece, ...]]:
    """Cut float32 leaves into pieces of at most ``piece_bytes`` and place each on the least
    loaded store it may go to, largest leaves first.

    >>> layout = cut({"w": (4, 8), "b": (8,)}, stores=2, piece_bytes=64)
    >>> [(p.key, p.store, p.start, p.stop) for p in layout["w"]]
    [('w#0', 0, 0, 16), ('w#1', 1, 16, 32)]
    >>> [(p.key, p.store) for p in layout["b"]]
    [('b#0', 0)]

    Args:
      shapes: leaf path -> shape.
      stores: how many stores.
      piece_bytes: the largest piece, bytes (>= 4).
      allowed: leaf path -> the stores its pieces may go to (default: any).

    Returns:
      Leaf path -> its pieces, in element order.

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
    load, layout = [0] * stores, {}
    for path, shape in sorted(shapes.items(), key=lambda kv: (-math.prod(kv[1]), kv[0])):
        size = math.prod(shape)
        count = max(1, -(-size * 4 // piece_bytes))
        bounds = [size * k // count for k in range(count + 1)]
        where = sorted(set(allowed.get(path, range(stores))))
        pieces = []
        for k in range(count):
            store = min(where, key=lambda i: (load[i], i))
            load[store] += 4 * (bounds[k + 1] - bounds[k])
            pieces.append(Piece(path, k, store, bounds[k], bounds[k + 1]))
        layout[path] = tuple(pieces)
    return {path: layout[path] for path in shapes}
