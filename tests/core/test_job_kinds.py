"""Any JAX job: the change matrix for states that do not look like the reference NNX job.

Three kinds of job run the core change matrix (DP, TP, FSDP, PP, mixed, disjoint devices, failures)
of ``tests.helpers.MATRIX``, shard by shard, with the bytes copied equal to the plan's minimum:

- ``nnx-6-axis``: the NNX GPT on a user's ``jax.make_mesh`` (Explicit axes) of six axes with names
  and an order of its own, ``(replica, stage, shard, seq, expert, model)``;
- ``linen``: a Flax Linen model whose params (and AdamW moments) carry ``nn.LogicallyPartitioned``
  and ``nn.Partitioned`` boxes, laid out by rules;
- ``pytree``: a plain dict of arrays placed with ``jax.device_put`` on a ``Mesh(devices, names)``
  of other names, whose PTC is read from the arrays' own shardings, the target from a tree of
  shardings.

Then: a state laid out by the user's ``jit(out_shardings=...)`` resharded into an orbax-style
``ShapeDtypeStruct`` target, sources and targets of different kinds and axis names, and every bad
input refused with the path, shape, both specs and both meshes, the state untouched.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tests.helpers import (
    MATRIX,
    RULES,
    abstract_state,
    assert_shards_equal,
    host_copy,
    linen_state,
    minimum_bytes,
    poison,
    train_state,
)

C = tj.ParallelConfig
IDS = [row[0] for row in MATRIX]

# the six-axis mesh: the default axes renamed, two more of size 1, data outermost
SIX = ("replica", "stage", "shard", "seq", "expert", "model")
SIX_NAMES = {"data": "replica", "pipe": "stage", "fsdp": "shard", "tensor": "model"}
# the plain pytree's mesh: four axes of its own names, in another order
FOUR = ("dp", "zero", "pp", "tp")
FOUR_NAMES = {"data": "dp", "fsdp": "zero", "pipe": "pp", "tensor": "tp"}


def renamed_rules(names: dict[str, str]) -> tuple:
    """``RULES`` over renamed mesh axes (the same layout under the user's names)."""
    rename = lambda a: names.get(a, a) if isinstance(a, str) else a
    return tuple(
        (logical, tuple(rename(a) for a in axes) if isinstance(axes, tuple) else rename(axes))
        for logical, axes in RULES
    )


def user_mesh(config: C, devices, axes, names, *, make_mesh: bool) -> Mesh:
    """The user's own mesh with ``config``'s sizes under ``names``: ``jax.make_mesh`` (Explicit
    axes) or ``Mesh(devices, names)`` (Auto)."""
    sizes = {names.get(a, a): s for a, s in config.shape.items()}
    shape = tuple(sizes.get(a, 1) for a in axes)
    devices = [jax.devices()[i] for i in devices]
    if make_mesh:
        return jax.make_mesh(shape, axes, devices=devices)
    return Mesh(np.array(devices).reshape(shape), axes)


@functools.cache
def trained_nnx_state():
    """The tiny GPT + AdamW, one update in (so the moments are not zero), unplaced (built once:
    ``tj.place`` copies it, so a donating reshard never frees it)."""
    model, optimizer = train_state()
    optimizer.update(model, jax.tree.map(lambda p: 1e-2 * np.ones_like(p), nnx.state(model)))
    return nnx.state((model, optimizer))


linen = functools.cache(linen_state)  # built once, placed (copied) by every test


def layouts(kind: str, row):
    """(placed state, source PTC, target PTC) of a matrix row for a kind of job."""
    _, src_cfg, src_ids, dst_cfg, dst_ids, *_ = row
    if kind == "nnx-6-axis":
        rules = renamed_rules(SIX_NAMES)
        mesh = user_mesh(src_cfg, src_ids, SIX, SIX_NAMES, make_mesh=True)
        src = tj.PTC.of(trained_nnx_state(), rules, mesh)
        state = tj.place(trained_nnx_state(), src)
        dst = src.relayout(user_mesh(dst_cfg, dst_ids, SIX, SIX_NAMES, make_mesh=True))
        assert src.config.axis_types == (AxisType.Explicit,) * 6
        return state, src, dst
    if kind == "linen":
        devices = [jax.devices()[i] for i in src_ids]
        src = tj.PTC.of(linen(), RULES, src_cfg, devices)
        return tj.place(linen(), src), src, src.relayout(dst_cfg, dst_ids)
    assert kind == "pytree"
    rules = renamed_rules(FOUR_NAMES)
    # plain nested dicts of arrays, from the host (device_put may alias a device's own buffer)
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(trained_nnx_state()))

    def shardings(config, ids):  # the user's own spec for each leaf, on the user's mesh
        mesh = user_mesh(config, ids, FOUR, FOUR_NAMES, make_mesh=False)
        specs = tj.PTC.of(abstract_state(), rules, mesh).leaves
        flat = [NamedSharding(mesh, leaf.spec) for leaf in specs]
        return jax.tree.unflatten(jax.tree.structure(pure), flat)

    state = jax.device_put(pure, shardings(src_cfg, src_ids))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
    dst = tj.PTC.from_shardings(abstract, shardings(dst_cfg, dst_ids))
    return state, tj.PTC.from_shardings(state), dst


@pytest.mark.parametrize("kind", ["nnx-6-axis", "linen", "pytree"])
@pytest.mark.parametrize("row", MATRIX, ids=IDS)
def test_every_kind_of_job_reshards_the_matrix_shard_by_shard_at_the_minimum(kind, row):
    failed = row[5] if len(row) > 5 else ()
    state, src, dst = layouts(kind, row)
    expected = host_copy(state)
    poison(state, failed)
    dst = tj.allocate(src, dst)
    plan = tj.make_plan(src, dst, failed=failed)
    new, report = tj.reshard(state, plan, donate=not failed)
    assert_shards_equal(new, expected, dst)
    assert report.bytes_moved == plan.bytes_moved == minimum_bytes(src, dst, failed)
    assert report.bytes_kept == plan.bytes_kept
    # the new state is laid out as the target says, in the user's own mesh
    assert tj.PTC.from_shardings(new) == dst


def test_the_six_axis_mesh_keeps_its_names_order_and_types():
    mesh = user_mesh(C(pipe=2, data=2, tensor=2), range(8), SIX, SIX_NAMES, make_mesh=True)
    ptc = tj.PTC.of(abstract_state(), renamed_rules(SIX_NAMES), mesh)
    assert ptc.config.names == SIX and ptc.config.sizes == (2, 2, 1, 1, 1, 2)
    assert ptc.mesh() == mesh  # the user's mesh as it was: names, devices, Explicit axes
    assert ptc.leaf("0/w1").spec == P("stage", "shard", "model")
    assert ptc.config.data == 1 and ptc.config.size("replica") == 2  # no axis named data


# -- a jit's out_shardings, resharded into an orbax-style target -----------------------------------


def test_a_state_laid_out_by_the_users_jit_reshards_into_a_shape_dtype_struct_target():
    """The user's init, jitted with out_shardings on a (replica, model) mesh; the target is what
    orbax restores onto: ShapeDtypeStructs with shardings on an Explicit (fsdp, tensor) mesh over
    other devices."""
    src_mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("replica", "model"))
    specs = {
        "w1": P(None, "model"),
        "w2": P("model", None),
        "emb": P("model", "replica"),
        "step": P(),
        "mu": {"w1": P("replica", "model")},
    }

    def init():
        key = jax.random.key(0)
        w1 = jax.random.normal(key, (16, 32))
        return {
            "w1": w1,
            "w2": w1.T * 2,
            "emb": jax.random.normal(key, (64, 16)),
            "step": jax.numpy.int32(5),
            "mu": {"w1": w1 * 0.1},
        }

    shardings = jax.tree.map(lambda s: NamedSharding(src_mesh, s), specs)
    state = jax.jit(init, out_shardings=shardings)()
    expected = host_copy(state)
    dst_mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), devices=jax.devices()[4:])
    target_specs = {
        "w1": P("fsdp", "tensor"),
        "w2": P("tensor", "fsdp"),
        "emb": P(("fsdp", "tensor")),
        "step": P(),
        "mu": {"w1": P("fsdp")},
    }
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(dst_mesh, s)),
        state,
        target_specs,
    )
    src = tj.PTC.from_shardings(state)
    # the same PTC from the jit's out_shardings and the abstract state
    assert tj.PTC.from_shardings(jax.eval_shape(init), shardings) == src
    dst = tj.PTC.from_shardings(target)
    plan = tj.make_plan(src, dst)
    new, report = tj.reshard(state, plan)
    assert_shards_equal(new, expected, dst)
    assert report.bytes_moved == plan.bytes_moved == minimum_bytes(src, dst) > 0
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(target)):
        # what a jit compiled for the target takes, as it is
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


# -- sources and targets of different kinds, meshes with different names ---------------------------


def test_a_linen_state_reshards_into_the_unboxed_tree_of_an_orbax_target():
    """Source: Linen boxes laid out by rules over the default axes. Target: the unboxed arrays as
    ShapeDtypeStructs on a mesh of other names. The new state has the target's containers."""
    src = tj.PTC.of(linen(), RULES, C(data=2, fsdp=2, tensor=2), jax.devices())
    state = tj.place(linen(), src)
    expected = host_copy(state)
    mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[2:6])
    unboxed = nn.unbox(state)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P("x") if x.ndim else P())
        ),
        unboxed,
    )
    dst = tj.PTC.from_shardings(target)
    assert [leaf.path for leaf in dst.leaves] == [
        leaf.path for leaf in src.leaves
    ]  # boxes add no path
    new, _ = tj.reshard(state, tj.make_plan(src, dst))
    assert_shards_equal(new, expected, dst)
    assert jax.tree.structure(new) == jax.tree.structure(unboxed)  # no boxes left


def test_an_nnx_state_moves_from_the_default_axes_to_a_users_mesh_with_its_own_rules():
    state = trained_nnx_state()
    src = tj.PTC.of(state, RULES, C(data=2, tensor=4), jax.devices())
    state = tj.place(state, src)
    expected = host_copy(state)
    mesh = jax.make_mesh((2, 2), ("batch", "model"), devices=jax.devices()[4:])
    rules = (("embed", "batch"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"))
    dst = src.relayout(mesh, rules=rules)
    assert dst.leaf("0/w1").spec == P(None, "batch", "model")
    plan = tj.make_plan(src, dst)
    new, report = tj.reshard(state, plan)
    assert_shards_equal(new, expected, dst)
    assert report.bytes_moved == minimum_bytes(src, dst)


# -- bad input: the path, shape, both specs and both meshes; the state untouched -------------------


@pytest.fixture(scope="module")
def six():
    """(rules, mesh, PTC) of the NNX GPT on a six-axis user mesh over devices 0..3."""
    rules = renamed_rules(SIX_NAMES)
    mesh = user_mesh(C(data=2, tensor=2), range(4), SIX, SIX_NAMES, make_mesh=True)
    return rules, mesh, tj.PTC.of(trained_nnx_state(), rules, mesh)


def assert_untouched(state, expected, ptc):
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert_shards_equal(state, expected, ptc)


def test_a_rule_naming_an_axis_the_target_mesh_lacks_names_the_leaf_and_both_layouts(six):
    _, _, src = six
    state = tj.place(trained_nnx_state(), src)
    expected = host_copy(state)
    lacking = jax.make_mesh((2, 2), ("replica", "model"), devices=jax.devices()[4:])
    with pytest.raises(tj.errors.LayoutError) as error:
        src.relayout(lacking)  # the rules map layers -> stage and embed -> shard
    message = str(error.value)
    for part in (
        (
            "rule ('embed', 'shard') maps logical axis 'embed' to mesh axes ['shard'] that do not "
            "exist; mesh axes are ('replica', 'model') (Mesh('replica': 2, 'model': 2; Explicit))"
        ),
        "leaf '0/b2' (shape=(2, 32), spec=('layers', 'embed'), mesh=Mesh('replica': 2, 'model': 2; "
        "Explicit))",
        (
            "it is laid out as P('stage', 'shard') on Mesh('replica': 2, 'stage': 1, 'shard': 1, "
            "'seq': 1, 'expert': 1, 'model': 2; Explicit) now"
        ),
        "relayout from replica=2,model=2 [Explicit] on devices 0..3",
    ):
        assert part in message, message
    assert_untouched(state, expected, src)


def test_a_live_array_whose_sharding_disagrees_with_the_rules_names_both_specs_and_meshes(six):
    rules, mesh, src = six
    state = tj.place(trained_nnx_state(), src)
    expected = host_copy(state)
    swapped = tuple((n, {"replica": "model", "model": "replica"}.get(a, a)) for n, a in rules)
    with pytest.raises(tj.errors.LayoutError) as error:
        tj.PTC.of(state, swapped, mesh)
    message = str(error.value)
    for part in (
        (
            "the array is placed as P('stage', 'model') on Mesh('replica': 2, 'stage': 1, "
            "'shard': 1, 'seq': 1, 'expert': 1, 'model': 2; Explicit) over devices [0, 1, 2, 3]"
        ),
        "the rules give P('stage', 'replica') on Mesh('replica': 2, 'stage': 1",
        "leaf '0/b1' (shape=(2, 64)",
    ):
        assert part in message, message
    assert_untouched(state, expected, src)


def test_an_indivisible_dim_under_any_axis_names_is_refused_naming_both_layouts(six):
    _, _, src = six
    three = user_mesh(C(tensor=3), range(4, 7), SIX, SIX_NAMES, make_mesh=True)
    with pytest.raises(tj.errors.LayoutError) as error:
        src.relayout(three)
    message = str(error.value)
    for part in (
        (
            "dim 1 of size 64 is sharded over mesh axes ('model',) of total size 3, which does not "
            "divide it"
        ),
        (
            "leaf '0/b1' (shape=(2, 64), spec=P('stage', 'model'), mesh=Mesh('replica': 1, "
            "'stage': 1, 'shard': 1, 'seq': 1, 'expert': 1, 'model': 3; Explicit)"
        ),
        "it is laid out as P('stage', 'model') on Mesh('replica': 2,",
    ):
        assert part in message, message
    # an orbax-style target whose sharding cannot hold the array evenly
    bad = {
        "w": jax.ShapeDtypeStruct((10, 4), np.float32, sharding=NamedSharding(three, P("model")))
    }
    with pytest.raises(
        tj.errors.LayoutError,
        match=r"dim 0 of size 10 .* \('model',\) of total size 3.*leaf 'w' \(shape=\(10, 4\)",
    ):
        tj.PTC.from_shardings(bad)


def test_a_target_on_devices_this_process_lacks_is_refused_before_anything_moves(six):
    _, _, src = six
    state = tj.place(trained_nnx_state(), src)
    expected = host_copy(state)
    elsewhere = src.relayout(src.config, [8, 9, 10, 11])  # planned by id: another host's devices
    plan = tj.make_plan(src, elsewhere)  # planning needs no devices
    with pytest.raises(tj.errors.LayoutError) as error:
        tj.reshard(state, plan)
    message = str(error.value)
    for part in (
        "the target PTC names devices [8, 9, 10, 11] that it does not have",
        "nothing was moved",
        (
            "leaf '0/b1' (shape=(2, 64), spec=P('stage', 'model') -> P('stage', 'model'), "
            "mesh=Mesh('replica': 2, 'stage': 1, 'shard': 1, 'seq': 1, 'expert': 1, 'model': 2; "
            "Explicit) over [0, 1, 2, 3] -> Mesh('replica': 2,"
        ),
        "over [8, 9, 10, 11])",
    ):
        assert part in message, message
    assert_untouched(state, expected, src)
    with pytest.raises(tj.errors.LayoutError, match=r"names devices \[8, 9, 10, 11\]"):
        tj.place(trained_nnx_state(), elsewhere)


def test_two_ptcs_of_different_trees_are_refused_naming_both_leaves_specs_and_meshes(six):
    _, _, src = six
    state = tj.place(trained_nnx_state(), src)
    expected = host_copy(state)
    other = tj.PTC.of(linen(), RULES, C(fsdp=2), range(2))
    with pytest.raises(tj.errors.PlanError) as error:
        tj.make_plan(src, other)
    message = str(error.value)
    for part in (
        "the source PTC (44 leaves on Mesh('replica': 2, 'stage': 1,",
        (
            "the target PTC (19 leaves on Mesh('pipe': 1, 'data': 1, 'fsdp': 2, 'tensor': 1; "
            "Auto) over devices 0..1) differ"
        ),
        "44 leaves are in the source, not in the target: '0/b1' float32[2, 64] spec=P('stage', "
        "'model'), ",
        "19 leaves are in the target, not in the source: 'opt_state/0/count' int32[] spec=P(), ",
    ):
        assert part in message, message
    # a plan whose source is another tree than the state
    plan = tj.make_plan(other, other.relayout(C(data=2), range(2)))
    with pytest.raises(
        tj.errors.PlanError,
        match=r"in the state, not in the PTC: '0/b1' float32\[2, 64\] spec=P\('stage', 'model'\)"
        r".* in the PTC, not in the state: 'opt_state/0/count' int32\[\] spec=P\(\)",
    ):
        tj.reshard(state, plan)
    assert_untouched(state, expected, src)
