"""Logical axis names → PartitionSpec: flax's own rule semantics, with divisibility on top.

The oracle is ``flax.linen.logical_to_mesh_axes`` itself (what t5x and MaxText use): rules are
tried in
order, not dims, and a name without a rule replicates its dim.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from flax.linen import logical_to_mesh_axes
from hypothesis import event, given, settings
from hypothesis import strategies as st

import tenplex_jax as tj
from tenplex_jax._src import box as boxes
from tenplex_jax._src import rules as tj_rules

MESH = ("pipe", "data", "fsdp", "tensor")
NAMES = ("a", "b", "c", "d")  # "d" has no rule; "x" is a rule for a name no array uses
# a rule's mesh axes: one, several (major to minor), or none at all (replicated)
mesh_axes = st.one_of(
    st.sampled_from(MESH),
    st.lists(st.sampled_from(MESH), unique=True, min_size=1, max_size=3).map(tuple),
    st.sampled_from([None, ()]),
)


@st.composite
def cases(draw):
    """(logical names, rules): 1 to 4 dims, each a distinct name or None (None may repeat); rules
    mostly for the names the array uses, possibly several per name, and some for no name of it."""
    names = draw(st.permutations(NAMES))
    keep = draw(st.lists(st.sampled_from([True, True, False]), min_size=1, max_size=4))
    logical = tuple(name if named else None for name, named in zip(names, keep))
    ruled = [n for n in logical if n is not None and n != "d"] + ["x"]
    rules = [(n, draw(mesh_axes)) for n in ruled for _ in range(draw(st.sampled_from([1, 2, 0])))]
    return logical, draw(st.permutations(rules))


def entries(spec, ndim):
    """Per dim, the mesh axes a spec shards it over: ``None``, ``'x'``, ``('x',)`` and ``()``
    spelled one way."""
    return tuple(tj_rules.spec_entries(spec, ndim))


def leaf_state(shape, logical):
    with nnx.use_eager_sharding(False):
        return {"w": nnx.Param(jax.ShapeDtypeStruct(shape, np.float32), out_sharding=logical)}


@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_spec_is_flax_logical_to_mesh_axes(case):
    logical, rules = case
    got, replicated = tj_rules.spec(
        logical, tj_rules.normalize(rules, MESH), dict.fromkeys(MESH, 2), "w", shape=None
    )
    want = logical_to_mesh_axes(logical, tuple(rules))
    assert entries(got, len(logical)) == entries(want, len(logical))
    assert replicated == ()


@settings(max_examples=150, deadline=None)
@given(
    case=cases(),
    sizes=st.tuples(*[st.sampled_from([2, 3, 1])] * 4),
    data=st.data(),
)
def test_ptc_spec_is_flax_spec_fitted_to_divisibility(case, sizes, data):
    logical, rules = case
    config = tj.ParallelConfig(**dict(zip(MESH, sizes)))
    flax_entries = entries(logical_to_mesh_axes(logical, tuple(rules)), len(logical))
    total = [math.prod(config.shape[a] for a in entry) for entry in flax_entries]
    # each dim a multiple of its sharding, or (sometimes) a size that may not divide
    shape = tuple(data.draw(st.sampled_from([t + 1, t, 2 * t, 6])) for t in total)
    devices = range(config.num_devices)
    bad = [d for d, (n, t) in enumerate(zip(shape, total)) if n % t]
    event("a dim does not divide" if bad else "every dim divides")
    event(f"{sum(t > 1 for t in total)} dims sharded")
    if not bad:
        ptc = tj.PTC.of(leaf_state(shape, logical), rules, config, devices)
        assert entries(ptc.leaf("w").spec, len(shape)) == flax_entries
        assert ptc.leaf("w").replicated == ()
    else:
        dim = bad[0]
        with pytest.raises(tj.errors.LayoutError) as err:
            tj.PTC.of(leaf_state(shape, logical), rules, config, devices)
        want = (
            f"dim {dim} of size {shape[dim]} is sharded over mesh axes {flax_entries[dim]} of "
            f"total size {total[dim]}, which does not divide it"
        )
        assert want in str(err.value) and "leaf 'w'" in str(err.value), str(err.value)
    # allowed to replicate: each dim keeps the longest prefix (outermost axes) of flax's axes that
    # divides it; the dropped axes are reported innermost first
    ptc = tj.PTC.of(leaf_state(shape, logical), rules, config, devices, allow_replicate=True)
    fitted, dropped = [], []
    for dim, (n, entry) in enumerate(zip(shape, flax_entries)):
        keep = max(
            k
            for k in range(len(entry) + 1)
            if n % math.prod(config.shape[a] for a in entry[:k]) == 0
        )
        fitted.append(entry[:keep])
        dropped += [(dim, axis) for axis in reversed(entry[keep:])]
    assert entries(ptc.leaf("w").spec, len(shape)) == tuple(fitted)
    assert ptc.leaf("w").replicated == tuple(dropped)
    # the PTC's boxes are what JAX itself makes of that spec
    if config.num_devices <= 8:
        mesh = config.make_mesh(jax.devices()[: config.num_devices])
        sharding = jax.sharding.NamedSharding(mesh, ptc.leaf("w").spec)
        want = {
            d.id: boxes.of_index(i, shape) for d, i in sharding.devices_indices_map(shape).items()
        }
        assert ptc.boxes(ptc.leaf("w")) == want


def test_rule_order_decides_not_dim_order():
    # flax's docstring example: "batch" has two rules; its first, X, is taken by "features"
    # only if "features" comes first among the *rules*, which it does not here
    rules = (("batch", "data"), ("features", "data"), ("heads", "tensor"), ("batch", "fsdp"))
    logical = ("batch", "length", "heads", "features")
    got, _ = tj_rules.spec(logical, tj_rules.normalize(rules, MESH), {}, "x")
    assert got == jax.sharding.PartitionSpec("data", None, "tensor", None)
    rules = (("features", "data"),) + rules  # now "features" takes data first; batch gets fsdp
    got, _ = tj_rules.spec(logical, tj_rules.normalize(rules, MESH), {}, "x")
    assert got == jax.sharding.PartitionSpec("fsdp", None, "tensor", "data")


def test_unknown_mesh_axis_in_a_rule_is_refused_naming_rule_and_mesh_axes():
    state = leaf_state((4, 8), ("embed", "mlp"))
    msg = re.escape(
        "rule ('mlp', ('tensor', 'model')) maps logical axis 'mlp' to mesh axes ['model'] that "
        "do not exist; mesh axes are ('pipe', 'data', 'fsdp', 'tensor')"
    )
    with pytest.raises(tj.errors.LayoutError, match=msg):
        tj.PTC.of(
            state, (("embed", "fsdp"), ("mlp", ("tensor", "model"))), tj.ParallelConfig(), [0]
        )
    with pytest.raises(tj.errors.LayoutError, match=r"mesh axes \[3\] that do not exist"):
        tj.PTC.of(state, (("mlp", 3),), tj.ParallelConfig(), [0])
    with pytest.raises(tj.errors.LayoutError, match=r"rules are a sequence of .* got NoneType"):
        tj.PTC.of(state, None, tj.ParallelConfig(), [0])
    # the same rules are refused by relayout, before any leaf is laid out
    ptc = tj.PTC.of(state, (("embed", "fsdp"),), tj.ParallelConfig(), [0])
    with pytest.raises(tj.errors.LayoutError, match=r"\['model'\] that do not exist"):
        ptc.relayout(tj.ParallelConfig(), [0], rules=(("mlp", "model"),))


def test_rule_naming_a_mesh_axis_twice_is_refused():
    # flax would hand the dim P(('tensor', 'tensor')), a spec jax refuses only when it is used
    assert logical_to_mesh_axes(
        ("mlp",), (("mlp", ("tensor", "tensor")),)
    ) == jax.sharding.PartitionSpec(("tensor", "tensor"))
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"rule \('mlp', \('tensor', 'tensor'\)\) names \['tensor'\] more than once",
    ):
        tj.PTC.of(
            leaf_state((4, 8), ("embed", "mlp")),
            (("mlp", ("tensor", "tensor")),),
            tj.ParallelConfig(tensor=2),
            range(2),
        )


def test_a_logical_name_used_by_two_dims_is_refused_with_the_leaf():
    with pytest.raises(ValueError, match="occur more than once"):  # flax's own refusal
        logical_to_mesh_axes(("embed", "embed"), (("embed", "fsdp"),))
    with pytest.raises(
        tj.errors.LayoutError,
        match=(
            r"refuse the names \('embed', 'embed'\).*occur more than once.*leaf 'w' "
            r"\(shape=\(4, 8\)"
        ),
    ):
        tj.PTC.of(
            leaf_state((4, 8), ("embed", "embed")),
            (("embed", "fsdp"),),
            tj.ParallelConfig(fsdp=2),
            range(2),
        )


def test_logical_names_must_be_strings_or_none():
    with pytest.raises(tj.errors.LayoutError, match=r"strings, or None.*leaf 'w'"):
        tj.PTC.of(
            leaf_state((4, 8), ("embed", ("mlp", "heads"))),
            (("mlp", "tensor"),),
            tj.ParallelConfig(tensor=2),
            range(2),
        )
