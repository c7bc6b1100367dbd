"""Logical axis names → PartitionSpec: flax's own semantics, then divisibility on top."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flax import nnx
from flax.linen import logical_to_mesh_axes
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax import rules as logical_rules
from tenplex_jax.ptc import MESH_AXES

C = tj.ParallelConfig
NAMES = ("batch", "embed", "mlp", "heads", "kv", "vocab", "layers")


def param(shape, names):
    with nnx.use_eager_sharding(False):
        return nnx.Param(np.zeros(shape, np.float32), out_sharding=names)


def test_the_first_rule_that_names_a_dim_takes_the_mesh_axis_as_in_flax():
    """Rules (mlp -> tensor, embed -> tensor) on ("embed", "mlp"): flax gives "tensor" to mlp,
    whose rule comes first, and leaves embed replicated. (tenplex_jax once gave it to embed, the
    first dim, so its PTC disagreed with the shardings the user's own jit got.)"""
    rules = (("mlp", "tensor"), ("embed", "tensor"))
    assert logical_to_mesh_axes(("embed", "mlp"), rules) == P(None, "tensor")
    ptc = tj.PTC.of({"w": param((8, 8), ("embed", "mlp"))}, rules, C(tensor=2), range(2))
    assert ptc.leaf("w").spec == P(None, "tensor")


# random logical names (None, names with and without rules) and random rules over the mesh axes
logical_names = st.lists(st.sampled_from((None, *NAMES)), min_size=1, max_size=4).filter(
    lambda names: len([n for n in names if n]) == len({n for n in names if n})
)
mesh_axes = st.one_of(
    st.none(),
    st.sampled_from(MESH_AXES),
    st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=3, unique=True).map(tuple),
)
rule_lists = st.lists(st.tuples(st.sampled_from(NAMES), mesh_axes), max_size=8)


def flax_entries(names, rules) -> list[tuple[str, ...]]:
    return logical_rules.spec_entries(logical_to_mesh_axes(tuple(names), rules), len(names))


@settings(max_examples=300, deadline=None)
@given(logical_names, rule_lists)
def test_specs_equal_flax_on_random_names_and_rules(names, rules):
    rules = tuple(rules)
    spec, dropped = logical_rules.spec(tuple(names), logical_rules.normalize(rules, MESH_AXES),
                                       dict.fromkeys(MESH_AXES, 2), "w")  # fmt: skip
    assert logical_rules.spec_entries(spec, len(names)) == flax_entries(names, rules)
    assert dropped == ()


@settings(max_examples=100, deadline=None)
@given(logical_names, rule_lists, st.sampled_from([C(data=2, tensor=2), C(fsdp=2, pipe=2)]))
def test_a_ptc_lays_dims_that_divide_out_as_flax_maps_them(names, rules, config):
    rules = tuple(rules)
    want = flax_entries(names, rules)
    shape = tuple(math.prod(config.shape[a] for a in entry) * 3 for entry in want)
    ptc = tj.PTC.of({"w": param(shape, tuple(names))}, rules, config, range(config.num_devices))
    assert logical_rules.spec_entries(ptc.leaf("w").spec, len(names)) == want


@settings(max_examples=100, deadline=None)
@given(logical_names, rule_lists)
def test_an_indivisible_dim_is_refused_or_replicated_innermost_axis_first(names, rules):
    rules = tuple(rules)
    want = flax_entries(names, rules)
    config = C(data=2, fsdp=2, tensor=2, pipe=2)
    shape = tuple(3 if entry else 5 for entry in want)  # 3 divides by no product of axis sizes
    leaf = {"w": param(shape, tuple(names))}
    if not any(want):
        assert tj.PTC.of(leaf, rules, config, range(16)).leaf("w").spec == P(*[None] * len(names))
        return
    dim = next(i for i, entry in enumerate(want) if entry)
    with pytest.raises(tj.errors.LayoutError, match=rf"dim {dim} of size 3 is sharded over"):
        tj.PTC.of(leaf, rules, config, range(16))
    replicated = tj.PTC.of(leaf, rules, config, range(16), allow_replicate=True).leaf("w")
    assert replicated.spec == P(*[None] * len(names))
    assert replicated.replicated == tuple(
        (dim, axis) for dim, entry in enumerate(want) for axis in reversed(entry)
    )
