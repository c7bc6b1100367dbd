"""Logical axis names → a ``PartitionSpec``: flax's rule semantics, fitted to the mesh sizes.

Logical names belong to the model (``("embed", "mlp")``), mesh axes to the hardware (``data``,
``fsdp``, ``tensor``, ``pipe``); rules map one to the other. The mapping is flax's own
(``flax.linen.logical_to_mesh_axes``, what t5x and MaxText use), called here rather than
reimplemented, so a PTC agrees with the shardings the user's own ``jit`` gets from the same rules:

- rules are tried in order; a rule gives its mesh axes to a dim whose logical name it names when
  that dim is still unassigned and none of those mesh axes is used by another dim of the array;
- a logical name that no rule assigns (or a rule that maps it to ``None``) leaves its dim
  replicated; ``None`` in the logical names is a dim that is never sharded.

>>> spec(("embed", "mlp"), (("mlp", "tensor"), ("embed", "tensor")), {"tensor": 4}, "w")
(P(None, 'tensor'), ())

On top of flax, a dim must divide by the product of its mesh axes' sizes. When it does not,
``spec`` refuses with a ``LayoutError`` naming the leaf, dim, axes and sizes — or, with
``allow_replicate=True``, drops the dim's mesh axes innermost first until the rest divides and
reports the dropped ``(dim, axis)`` pairs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence

from flax.linen import spmd
from jax.sharding import PartitionSpec

from tenplex_jax._src.errors import LayoutError, where

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]
"""flax logical-axis rules: ``(logical name, mesh axes)`` pairs in precedence order, the mesh axes
one axis, a tuple of axes, or ``None`` (never sharded): ``(("embed", "fsdp"), ("mlp", "tensor"))``.
"""
Logical = tuple[str | None, ...]


def normalize(
    rules: Rules, mesh_axes: Sequence[str], *, mesh: str = "", leaves: Iterable[tuple] = ()
) -> tuple:
    """``rules`` as a hashable tuple, after checking each is ``(name, mesh axes)`` over mesh axes
    that exist.

    ``leaves`` (``(path, shape, logical names)`` triples) let the refusal of a rule naming a mesh
    axis the mesh lacks name the first leaf it would lay out; ``mesh`` is how the mesh is shown.
    """
    if not isinstance(rules, (tuple, list)):
        raise LayoutError(
            f"logical-axis rules are a sequence of (logical_name, mesh_axes) pairs, got "
            f"{type(rules).__name__} {rules!r}"
        )
    out, bad = [], []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise LayoutError(f"a logical-axis rule is (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        named = () if axes is None else tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        unknown = [a for a in named if not isinstance(a, str) or a not in mesh_axes]
        if unknown:
            bad.append((tuple(rule), name, unknown))
            continue
        if len(set(named)) != len(named):
            # flax would hand the dim a spec naming one mesh axis twice, which jax refuses
            raise LayoutError(
                f"a rule shards a dim over distinct mesh axes, but rule {tuple(rule)!r} names "
                f"{[a for a in dict.fromkeys(named) if named.count(a) > 1]} more than once; "
                f"mesh axes are {tuple(mesh_axes)}"
            )
        out.append((name, axes if axes is None or isinstance(axes, str) else tuple(axes)))
    if bad:  # the first bad rule a leaf uses, else the first bad rule
        leaves = list(leaves)
        users = [next((leaf for leaf in leaves if leaf[2] and b[1] in leaf[2]), None) for b in bad]
        rule, name, unknown = next((b for b, u in zip(bad, users) if u), bad[0])
        user = next((u for u in users if u), None)
        shown = f" ({mesh})" if mesh else ""
        raise LayoutError(
            f"rule {rule!r} maps logical axis {name!r} to mesh axes {unknown} that do not exist; "
            f"mesh axes are {tuple(mesh_axes)}{shown}"
            + (
                ": it would lay out " + where(user[0], user[1], tuple(user[2]), mesh)
                if user
                else "; no leaf names it: drop the rule or use a mesh with those axes"
            ),
            path=user[0] if user else None,
        )
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _flax_entries(logical: Logical, rules: tuple) -> tuple[tuple[str, ...], ...]:
    """Per dim, the mesh axes flax assigns (a tuple, empty when replicated)."""
    spec = spmd.logical_to_mesh_axes(logical, rules)
    entries = list(spec) + [None] * (len(logical) - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def spec(
    logical: Logical,
    rules: tuple,
    sizes: Mapping[str, int],
    path: str,
    shape: Sequence[int] | None = None,
    *,
    allow_replicate: bool = False,
    mesh: str = "",
) -> tuple[PartitionSpec, tuple[tuple[int, str], ...]]:
    """(spec, replicated (dim, mesh axis) pairs) of a leaf with ``logical`` names under ``rules``.

    ``rules`` come from :func:`normalize`; ``sizes`` maps mesh axes to sizes; ``shape`` (default:
    every dim divides) is checked for divisibility.
    """
    shown = mesh or str(dict(sizes))
    if not all(name is None or isinstance(name, str) for name in logical):
        raise LayoutError(
            f"logical axis names are strings, or None for a dim never sharded, got "
            f"{tuple(logical)!r}: " + where(path, tuple(shape or ()), tuple(logical), shown)
        )
    try:
        entries = _flax_entries(tuple(logical), rules)
    except ValueError as error:  # flax: a logical name used by two dims
        raise LayoutError(
            f"flax's logical-axis rules refuse the names {tuple(logical)}: {error}: "
            + where(path, tuple(shape or ()), tuple(logical), shown)
        ) from None
    return fit(entries, sizes, path, shape, allow_replicate=allow_replicate, mesh=shown)


def direct(
    names: Sequence,
    sizes: Mapping[str, int],
    path: str,
    shape: Sequence[int],
    *,
    allow_replicate: bool = False,
    mesh: str = "",
) -> tuple[PartitionSpec, tuple[tuple[int, str], ...]]:
    """(spec, replicated pairs) of a leaf whose names are mesh axes already, as flax's
    ``nn.Partitioned`` (``nn.with_partitioning``) boxes hold them: one entry per dim, a mesh axis,
    a tuple of them, or None. Checked against the mesh and fitted to divisibility like
    :func:`spec`."""
    shown = mesh or str(dict(sizes))
    entries = spec_entries(PartitionSpec(*names), len(shape))
    unknown = sorted({a for e in entries for a in e if a not in sizes}, key=str)
    if len(names) != len(shape) or unknown:
        raise LayoutError(
            f"a leaf boxed by nn.Partitioned names one mesh axis (or None) per dim, on axes of the "
            f"mesh ({tuple(sizes)}); got {tuple(names)}"
            + (f", whose axes {unknown} the mesh lacks" if unknown else "")
            + ": "
            + where(path, tuple(shape), tuple(names), shown)
        )
    return fit(tuple(entries), sizes, path, shape, allow_replicate=allow_replicate, mesh=shown)


def fit(
    entries: tuple[tuple[str, ...], ...],
    sizes: Mapping[str, int],
    path: str,
    shape: Sequence[int] | None,
    *,
    allow_replicate: bool = False,
    mesh: str = "",
) -> tuple[PartitionSpec, tuple[tuple[int, str], ...]]:
    """``entries`` (per dim, its mesh axes) as a spec, each dim fitted to divisibility: refused
    with a ``LayoutError``, or with ``allow_replicate`` its axes dropped innermost first until the
    rest divides (the dropped ``(dim, axis)`` pairs are returned)."""
    replicated: list[tuple[int, str]] = []
    if shape is not None:
        fitted = []
        for dim, entry in enumerate(entries):
            entry = list(entry)
            while entry and shape[dim] % math.prod(sizes[a] for a in entry):
                if not allow_replicate:
                    raise LayoutError(
                        f"dim {dim} of size {shape[dim]} is sharded over mesh axes {tuple(entry)} "
                        f"of total size {math.prod(sizes[a] for a in entry)}, which does not "
                        f"divide it; pass allow_replicate=True to replicate it along those axes, "
                        f"or choose another config: "
                        + where(path, tuple(shape), as_spec(entries), mesh or str(dict(sizes)))
                    )
                replicated.append((dim, entry.pop()))
            fitted.append(tuple(entry))
        entries = tuple(fitted)
    return as_spec(entries), tuple(replicated)


def as_spec(entries) -> PartitionSpec:
    """The spec of per-dim mesh axes: ``None``, one axis, or a tuple of them, for each dim."""
    return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries))


def spec_entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """Per dim of an ``ndim`` array, the mesh axes ``spec`` shards it over (major to minor)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
