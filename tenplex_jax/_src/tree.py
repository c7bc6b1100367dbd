"""A train state as a list of leaves, whatever holds it.

tenplex_jax reads a state's leaves from any pytree whose leaves are arrays (``jax.Array``, NumPy,
``jax.ShapeDtypeStruct``), possibly wrapped in the metadata boxes that carry their axis names:

- Flax NNX variables (``nnx.Param``, optimizer moments, RNG state): the logical names are the
  variable's ``out_sharding`` metadata (``nnx.with_partitioning(init, ("embed", "mlp"))``);
- Flax Linen boxes: ``nn.LogicallyPartitioned`` (``nn.with_logical_partitioning``) holds logical
  names; ``nn.Partitioned`` (``nn.with_partitioning``) holds mesh axes, used as they are. optax
  keeps the boxes on the moments it builds from boxed params, so they get the params' layout;
- anything else (plain dicts, equinox-style dataclasses, NNX graph nodes, whose ``nnx.state`` is
  read): the arrays alone, whose layout is their own ``NamedSharding``.

A leaf's path is ``jax.tree_util.keystr(path, simple=True, separator="/")`` of the array or of the
box holding it (``model/w1``, ``params/Dense_0/kernel``), so a boxed and an unboxed tree of the same
arrays have the same paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import meta
from flax.linen.spmd import LogicallyPartitioned

from tenplex_jax._src.errors import LayoutError

Names = tuple  # per dim: a logical name (or a mesh axis, or a tuple of mesh axes), or None


def flatten_state(state) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) of a state; leaves are NNX variables, Linen boxes or array-likes.

    ``treedef`` is the array-level treedef: ``tree_unflatten(treedef, arrays)`` rebuilds the state,
    its variables and boxes included.
    """
    if _is_graph_nodes(state):
        state = nnx.state(state)
    with_paths, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_box)
    arrays, treedef = jax.tree_util.tree_flatten(state)
    if len(arrays) != len(with_paths):
        raise LayoutError(
            "every NNX variable and flax metadata box in the state must hold exactly one array, "
            f"but its {len(with_paths)} leaves hold {len(arrays)} arrays"
        )
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in with_paths]
    return paths, [leaf for _, leaf in with_paths], treedef


def is_box(x) -> bool:
    """An NNX variable or a flax metadata box (``nn.Partitioned``, ``nn.LogicallyPartitioned``)."""
    return isinstance(x, (nnx.Variable, meta.AxisMetadata))


def value_of(leaf):
    """The array (or ShapeDtypeStruct) a leaf holds, unwrapped from its variable or box."""
    if isinstance(leaf, nnx.Variable):
        return leaf.get_value()
    if isinstance(leaf, meta.AxisMetadata):
        # .value, not .unbox(): a Linen box's unbox may add a sharding constraint
        return leaf.value if hasattr(leaf, "value") else leaf.unbox()
    return leaf


def names_of(leaf) -> tuple[Names | None, bool]:
    """(axis names or None, whether they are mesh axes rather than logical names) of a leaf."""
    if isinstance(leaf, nnx.Variable):
        names = leaf.get_metadata().get("out_sharding")
        return (None if names is None else tuple(names)), False
    if isinstance(leaf, meta.Partitioned):
        # LogicallyPartitioned (a subclass) holds logical names; Partitioned itself mesh axes
        return tuple(leaf.names), not isinstance(leaf, LogicallyPartitioned)
    return None, False


def arrays(state) -> tuple[list[str], list[Any], Any]:
    """(paths, arrays, treedef) of a state: variables and boxes unwrapped to the arrays they
    hold."""
    paths, leaves, treedef = flatten_state(state)
    return paths, [value_of(leaf) for leaf in leaves], treedef


def value_and_check(path: str, leaf):
    """The array-like value of one leaf, refusing a leaf that is not one."""
    value = value_of(leaf)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise LayoutError(
            f"leaf {path!r} is {type(value).__name__}, not an array; every leaf of a state must "
            f"be an array or ShapeDtypeStruct (filter others out first, as eqx.filter does)"
        )
    return value


def per_leaf(shardings, state, treedef, count: int) -> list:
    """``shardings`` spread over the ``count`` array leaves of ``state``: one sharding for all, a
    tree shaped like the state, or a prefix of it (as ``jit``'s ``out_shardings`` may be)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * count
    flat, sdef = jax.tree_util.tree_flatten(shardings)
    if sdef == treedef:
        return flat
    if _is_graph_nodes(state):
        state = nnx.state(state)
    try:
        subtrees = sdef.flatten_up_to(state)
    except (ValueError, TypeError) as error:
        raise LayoutError(
            f"the shardings must be one sharding, a tree shaped like the state or a prefix of "
            f"it; the state has {count} array leaves, the shardings tree {len(flat)} leaves "
            f"({error})"
        ) from None
    return [s for s, sub in zip(flat, subtrees) for _ in jax.tree_util.tree_leaves(sub)]


def dtype_name(dtype) -> str:
    """A dtype's name: numpy's for array dtypes, JAX's (``key<fry>``) for PRNG keys; a name
    (as records hold them) as it is."""
    if isinstance(dtype, str):
        return dtype
    is_key = jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    return str(dtype) if is_key else np.dtype(dtype).name


# -- what differs between two trees ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One leaf as a message about two trees shows it. ``shape`` or ``dtype`` is ``None`` where
    unknown (not compared); ``spec`` is shown, never compared (two layouts of one state differ in
    it by design)."""

    path: str
    shape: tuple[int, ...] | None
    dtype: Any = None
    spec: Any = None

    @classmethod
    def of(cls, path: str, value) -> Leaf:
        """An array-like's shape and dtype, and its spec when it has a ``NamedSharding``."""
        sharding = getattr(value, "sharding", None)
        return cls(
            path,
            tuple(value.shape if hasattr(value, "shape") else np.shape(value)),
            getattr(value, "dtype", None),
            sharding.spec if isinstance(sharding, jax.sharding.NamedSharding) else None,
        )

    def facts(self) -> str:
        """``float32[8, 4] spec=P('fsdp', None)``."""
        shape = "[?]" if self.shape is None else str(list(self.shape))
        dtype = "" if self.dtype is None else _name(self.dtype)
        return dtype + shape + ("" if self.spec is None else f" spec={self.spec}")

    def __str__(self) -> str:
        return f"{self.path!r} {self.facts()}"


def leaves_of(paths: Sequence[str], values: Sequence) -> list[Leaf]:
    return [Leaf.of(path, value) for path, value in zip(paths, values)]


def difference(
    a: Sequence,
    b: Sequence,
    names: tuple[str, str],
    *,
    subset: bool = False,
    dtypes: bool = True,
    show: int = 3,
) -> str:
    """What differs between two flattened trees, for a message; ``""`` when nothing does.

    ``a`` and ``b`` hold :class:`Leaf` records or anything with ``path``, ``shape``, ``dtype`` and
    ``spec`` (a PTC's leaves); ``names`` call the two trees (``("the state", "the PTC")``).
    Named, up to ``show`` of each: the paths of one tree missing from the other, the leaves of the
    same path whose shape or dtype differ (both sides with their specs), else the first position
    where the same paths come in another order. ``subset``: ``b`` may hold leaves ``a`` lacks (a
    restore reads part of a checkpoint), and its order does not matter. ``dtypes=False``
    compares shapes only.
    """
    if len(a) == len(b) and all(map(_identical, a, b)):
        return ""  # the common case, without building records
    a, b = [_leaf(x) for x in a], [_leaf(y) for y in b]
    first, second = names
    in_a, in_b = {x.path for x in a}, {}
    for y in b:
        in_b.setdefault(y.path, y)
    parts = []
    missing = [x for x in a if x.path not in in_b]
    if missing:
        parts.append(f"{_are(missing)} in {first}, not in {second}: {_list(missing, show)}")
    extra = [] if subset else [y for y in b if y.path not in in_a]
    if extra:
        parts.append(f"{_are(extra)} in {second}, not in {first}: {_list(extra, show)}")
    changed = [
        (x, in_b[x.path]) for x in a if x.path in in_b and not _same(x, in_b[x.path], dtypes)
    ]
    if changed:
        shown = "; ".join(
            f"{x.path!r} is {x.facts()} in {first}, {y.facts()} in {second}"
            for x, y in changed[:show]
        )
        more = f"; and {len(changed) - show} more" if len(changed) > show else ""
        parts.append(f"{_are(changed)} in both with another shape or dtype: {shown}{more}")
    if parts or subset:
        return "; ".join(parts)
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x.path != y.path), min(len(a), len(b)))
    if at == len(a) == len(b):
        return ""
    path = lambda leaves: repr(leaves[at].path) if at < len(leaves) else "(none)"
    return (
        f"the same paths in another order (or repeated): leaf {at} is {path(a)} in {first}, "
        f"{path(b)} in {second}"
    )


def _identical(x, y) -> bool:
    return x.path == y.path and x.shape == y.shape and x.dtype is y.dtype


def _leaf(leaf) -> Leaf:
    if isinstance(leaf, Leaf):
        return leaf
    return Leaf(leaf.path, leaf.shape, leaf.dtype, getattr(leaf, "spec", None))


def _same(x: Leaf, y: Leaf, dtypes: bool) -> bool:
    """Equal shapes and dtypes where both are known; dtypes by name (a record read back names
    them by strings)."""
    if x.shape is not None and y.shape is not None and tuple(x.shape) != tuple(y.shape):
        return False
    if not dtypes or x.dtype is None or y.dtype is None:
        return True
    return _name(x.dtype) == _name(y.dtype)


def _name(dtype) -> str:
    try:
        return dtype_name(dtype)
    except TypeError:  # not a dtype numpy or JAX knows (a checkpoint's metadata may hold one)
        return str(dtype)


def _are(leaves: Sequence) -> str:
    return "1 leaf is" if len(leaves) == 1 else f"{len(leaves)} leaves are"


def _list(leaves: Sequence[Leaf], show: int) -> str:
    shown = ", ".join(map(str, leaves[:show]))
    return shown + (f", and {len(leaves) - show} more" if len(leaves) > show else "")


def _is_graph_nodes(state) -> bool:
    """NNX objects, or a tuple / list / dict of them, such as ``{"model": m, "optimizer": o}``."""
    if isinstance(state, dict):
        nodes = list(state.values())
    else:
        nodes = list(state) if isinstance(state, (tuple, list)) else [state]
    return len(nodes) > 0 and all(nnx.graph.is_graph_node(n) for n in nodes)
