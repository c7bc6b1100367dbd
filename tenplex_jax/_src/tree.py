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

from typing import Any

import jax
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


def _is_graph_nodes(state) -> bool:
    """NNX objects, or a tuple / list / dict of them, such as ``{"model": m, "optimizer": o}``."""
    if isinstance(state, dict):
        nodes = list(state.values())
    else:
        nodes = list(state) if isinstance(state, (tuple, list)) else [state]
    return len(nodes) > 0 and all(nnx.graph.is_graph_node(n) for n in nodes)
