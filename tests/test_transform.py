"""The state transformer: shard-by-shard equality over a matrix of changes, bytes, donation, errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tests.helpers import RULES, assert_shards_equal, host_copy, train_state

C = tj.ParallelConfig
# (name, source config, source devices, target config, target devices)
MATRIX = [
    ("dp 8->4", C(data=8), range(8), C(data=4), range(4)),
    ("dp 4->6 on 2..7", C(data=4), range(4), C(data=6), range(2, 8)),
    ("tp 2->4", C(data=4, tensor=2), range(8), C(data=2, tensor=4), range(8)),
    ("fsdp 4->2", C(data=2, fsdp=4), range(8), C(data=4, fsdp=2), range(8)),
    ("dp2,tp4 -> dp3,tp2", C(data=2, tensor=4), range(8), C(data=3, tensor=2), range(6)),
    ("disjoint", C(data=2, tensor=2), range(4), C(fsdp=2, tensor=2), range(4, 8)),
    ("mixed with pipe", C(pipe=2, data=2, tensor=2), range(8), C(fsdp=4, tensor=2), range(8)),
    ("grow 2->8 reversed", C(fsdp=2), range(2), C(data=2, fsdp=2, tensor=2), range(7, -1, -1)),
]


def laid_out(config, devices, seed=0):
    """A tiny GPT + AdamW state, one optimizer step in (so the moments are not zero), laid out."""
    model, optimizer = train_state(seed=seed)
    grads = jax.tree.map(lambda p: 1e-2 * np.ones_like(p), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    state = nnx.state((model, optimizer))
    devices = [jax.devices()[i] for i in devices]
    ptc = tj.PTC.of(state, RULES, config, devices)
    return tj.place(state, ptc), ptc, (model, optimizer)


def target(state, config, devices):
    return tj.PTC.of(state, RULES, config, [jax.devices()[i] for i in devices])


@pytest.mark.parametrize("method", tj.executor.METHODS)
@pytest.mark.parametrize(
    "name,src_cfg,src_devs,dst_cfg,dst_devs", MATRIX, ids=[m[0] for m in MATRIX]
)
def test_reshard_is_bit_identical_shard_by_shard(
    name, src_cfg, src_devs, dst_cfg, dst_devs, method
):
    state, src, _ = laid_out(src_cfg, src_devs)
    expected = host_copy(state)
    dst = target(state, dst_cfg, dst_devs)
    plan = tj.make_plan(src, dst)
    new, report = tj.reshard(state, plan, method=method)
    assert_shards_equal(new, expected, dst)
    if method == "plan":  # measured from the copied buffers, not read from the plan
        assert (report.bytes_moved, report.bytes_kept) == (plan.bytes_moved, plan.bytes_kept)


def test_a_plan_that_keeps_every_shard_copies_nothing_and_reuses_buffers():
    state, src, _ = laid_out(C(data=2, tensor=4), range(8))
    plan = tj.make_plan(src, target(state, C(data=2, tensor=4), range(8)))
    pointers = [
        s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(state) for s in x.addressable_shards
    ]
    new, report = tj.reshard(state, plan)
    assert report.bytes_moved == plan.bytes_moved == 0
    assert [
        s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(new) for s in x.addressable_shards
    ] == pointers


def test_donation_frees_replaced_leaves_and_keeps_shared_ones():
    state, src, _ = laid_out(C(data=2, tensor=4), range(8))
    plan = tj.make_plan(src, target(state, C(data=3, tensor=2), range(2, 8)))
    old = jax.tree.leaves(state)
    new, _ = tj.reshard(state, plan, donate=True)
    for array, leaf in zip(old, plan.leaves):
        reused = any(s.kind == "keep" for s in leaf.shards)
        assert array.is_deleted() != reused, leaf.path
    assert all(not x.is_deleted() for x in jax.tree.leaves(new))
    with pytest.raises(tj.errors.PlanError, match="deleted array"):
        tj.reshard(state, plan)  # the old state was consumed


def test_donating_a_placed_state_leaves_the_callers_input_alive():
    model, optimizer = train_state()
    before = jax.device_put(nnx.state((model, optimizer)), jax.devices()[0])  # already on a device
    expected = host_copy(before)
    ptc = tj.PTC.of(before, RULES, C(), jax.devices()[:1])  # the layout it already has
    placed = tj.place(before, ptc)
    tj.reshard(placed, tj.make_plan(ptc, target(placed, C(data=4), range(4, 8))), donate=True)
    assert not any(x.is_deleted() for x in jax.tree.leaves(before))
    for got, want in zip(host_copy(before), expected):
        np.testing.assert_array_equal(got, want)


def test_without_donation_the_old_state_stays_valid():
    state, src, _ = laid_out(C(fsdp=4, tensor=2), range(8))
    expected = host_copy(state)
    plan = tj.make_plan(src, target(state, C(data=2, tensor=2), range(4, 8)))
    tj.reshard(state, plan, donate=False)
    assert_shards_equal(state, expected, src)


def test_wrong_tree_or_wrong_layout_is_refused_and_the_state_is_untouched():
    state, src, nodes = laid_out(C(data=2, tensor=4), range(8))
    expected = host_copy(state)
    plan = tj.make_plan(src, target(state, C(data=4, tensor=2), range(8)))
    with pytest.raises(
        tj.errors.PlanError, match=r"tree does not match.*at leaf 0: state 'b1' vs PTC '0/b1'"
    ):
        tj.reshard(nnx.state(nodes[0]), plan)  # the model alone, not model + optimizer
    other, other_ptc, _ = laid_out(C(fsdp=8), range(8), seed=1)
    with pytest.raises(tj.errors.PlanError, match=r"not laid out as the plan's source PTC says.*leaf '0/"):
        tj.reshard(other, plan)
    assert_shards_equal(state, expected, src)
    assert_shards_equal(other, host_copy(other), other_ptc)
    new, _ = tj.reshard(state, plan)  # still usable after the refusals
    assert_shards_equal(new, expected, plan.dst)


def test_reshard_accepts_nnx_graph_nodes():
    model, optimizer = train_state()
    src = tj.PTC.of((model, optimizer), RULES, C(data=8), jax.devices())
    nnx.update((model, optimizer), tj.place((model, optimizer), src))
    expected = host_copy(nnx.state((model, optimizer)))
    dst = tj.PTC.of((model, optimizer), RULES, C(fsdp=2, tensor=2), jax.devices()[:4])
    new, _ = tj.reshard((model, optimizer), tj.make_plan(src, dst))
    nnx.update((model, optimizer), new)
    assert_shards_equal(nnx.state((model, optimizer)), expected, dst)


@pytest.mark.parametrize(
    "name,src_cfg,src_devs,dst_cfg,dst_devs", MATRIX, ids=[m[0] for m in MATRIX]
)
def test_reshard_onto_an_allocated_device_order(name, src_cfg, src_devs, dst_cfg, dst_devs):
    state, src, _ = laid_out(src_cfg, src_devs)
    expected = host_copy(state)
    dst = tj.allocate(src, target(state, dst_cfg, dst_devs))
    plan = tj.make_plan(src, dst)
    new, report = tj.reshard(state, plan)
    assert_shards_equal(new, expected, dst)
    assert [d.id for d in plan.dst.mesh().devices.flat] == list(dst.device_ids)
    assert (report.bytes_moved, report.bytes_kept) == (plan.bytes_moved, plan.bytes_kept)


@pytest.mark.parametrize("name", ["dp 4->6 on 2..7", "fsdp 4->2", "disjoint"])
def test_new_shards_own_their_memory_unless_kept(name):
    """A moved or split shard is a copy, never a view of the old buffer that donation frees."""
    _, src_cfg, src_devs, dst_cfg, dst_devs = next(row for row in MATRIX if row[0] == name)
    state, ptc, _ = laid_out(src_cfg, src_devs)
    plan = tj.make_plan(ptc, target(state, dst_cfg, dst_devs))
    old = {
        shard.data.unsafe_buffer_pointer()
        for array in jax.tree.leaves(state)
        for shard in array.addressable_shards
    }
    new, _ = tj.reshard(state, plan, donate=False)
    for array, leaf in zip(jax.tree.leaves(new), plan.leaves):
        kinds = {s.device: s.kind for s in leaf.shards}
        for shard in array.addressable_shards:
            shared = shard.data.unsafe_buffer_pointer() in old
            assert shared == (kinds[shard.device.id] == "keep"), (leaf.path, shard.device)
