"""The state transformer: shard-by-shard equality over a matrix of changes on both executor paths
(the host path and the device path GPUs take, forced on CPU), bytes, donation, errors."""

from __future__ import annotations

import collections
import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tests.helpers import (
    MATRIX,
    RULES,
    assert_shards_equal,
    host_copy,
    minimum_bytes,
    poison,
    train_state,
)

C = tj.ParallelConfig
PATHS = ("host", "device")
IDS = [m[0] for m in MATRIX]


def laid_out(config, devices, seed=0):
    """A tiny GPT + AdamW state, one optimizer step in (so the moments are not zero), laid out."""
    model, optimizer = train_state(seed=seed)
    grads = jax.tree.map(lambda p: 1e-2 * np.ones_like(p), nnx.state(model, nnx.Param))
    optimizer.update(model, grads)
    state = nnx.state((model, optimizer))
    devices = [jax.devices()[i] for i in devices]
    ptc = tj.PTC.of(state, RULES, config, devices)
    return tj.place(state, ptc), ptc, (model, optimizer)


def target(ptc, config, devices):
    return ptc.relayout(config, [jax.devices()[i] for i in devices])


def run_row(row, executor, method="plan"):
    """Reshard a row of MATRIX; (plan, new state, report, the expected host copy)."""
    _, src_cfg, src_devs, dst_cfg, dst_devs, *failed = row
    failed = failed[0] if failed else ()
    state, src, _ = laid_out(src_cfg, src_devs)
    expected = host_copy(state)
    poison(state, failed)
    dst = tj.allocate(src, target(src, dst_cfg, dst_devs))
    plan = tj.make_plan(src, dst, failed=failed)
    new, report = tj.reshard(state, plan, method=method, executor=executor, donate=not failed)
    return plan, new, report, expected


KINDS_SEEN = collections.defaultdict(set)  # executor path -> shard kinds the matrix executed


@pytest.mark.parametrize("executor", PATHS)
@pytest.mark.parametrize("row", MATRIX, ids=IDS)
def test_both_paths_reshard_every_change_bit_identical_shard_by_shard(row, executor):
    plan, new, report, expected = run_row(row, executor)
    assert_shards_equal(new, expected, plan.dst)
    # measured from the copied buffers, not read from the plan; the plan's bytes are the minimum
    assert (report.bytes_moved, report.bytes_kept) == (plan.bytes_moved, plan.bytes_kept)
    assert plan.bytes_moved == minimum_bytes(plan.src, plan.dst, row[5] if len(row) > 5 else ())
    # the forced path built every shard (the GPT state holds no key, which goes to the device)
    assert set(report.kinds) == {executor} and report.kinds[executor] == plan.kinds
    KINDS_SEEN[executor] |= set(report.kinds[executor])


@pytest.mark.parametrize("executor", PATHS)
def test_the_matrix_executes_keep_split_move_and_merge_on_both_paths(executor):
    if len(KINDS_SEEN[executor]) < 4:  # run alone: execute the matrix here
        for row in MATRIX:
            KINDS_SEEN[executor] |= set(run_row(row, executor)[2].kinds[executor])
    assert KINDS_SEEN[executor] >= {"keep", "split", "move", "merge"}


@pytest.mark.parametrize("row", [MATRIX[1], MATRIX[4], MATRIX[-2]], ids=[IDS[1], IDS[4], IDS[-2]])
def test_device_put_method_gives_the_same_shards(row):
    plan, new, _, expected = run_row(row, "auto", method="device_put")
    assert_shards_equal(new, expected, plan.dst)


@pytest.mark.parametrize("executor", PATHS)
def test_merging_pieces_from_several_devices_onto_one(executor):
    """P(None, "tensor") from tensor=4 to tensor=2: both target shards are merges of two pieces on
    two devices. The device path once concatenated them where they lay, and JAX refused ("Received
    incompatible devices for jitted computation")."""
    with nnx.use_eager_sharding(False):
        w = np.arange(64, dtype=np.float32).reshape(8, 8)
        state = nnx.State({"w": nnx.Param(w, out_sharding=(None, "mlp"))})
    src = tj.PTC.of(state, (("mlp", "tensor"),), C(tensor=4), jax.devices()[:4])
    state = tj.place(state, src)
    plan = tj.make_plan(src, src.relayout(C(tensor=2), jax.devices()[:2]))
    assert [s.kind for s in plan.leaves[0].shards] == ["merge", "merge"]
    new, report = tj.reshard(state, plan, executor=executor)
    assert_shards_equal(new, [w], plan.dst)
    # device 0 keeps its own columns 0..1 and receives 2..3; device 1 receives 4..5 and 6..7
    assert report.bytes_moved == plan.bytes_moved == w.nbytes * 3 // 4
    assert report.bytes_kept == plan.bytes_kept == w.nbytes // 4


def test_prng_keys_take_the_device_path_and_the_host_path_refuses_them():
    """Key arrays are not plain memory: "auto" moves them on the device path (sliced and merged
    like any leaf); forcing the host path is refused before anything moves."""
    keys = jax.random.split(jax.random.key(3), 8)
    with nnx.use_eager_sharding(False):
        state = nnx.State({"keys": nnx.Variable(keys, out_sharding=("mlp",))})
    src = tj.PTC.of(state, (("mlp", "tensor"),), C(tensor=4), jax.devices()[:4])
    state = tj.place(state, src)
    expected = host_copy(state)
    plan = tj.make_plan(src, src.relayout(C(tensor=2), jax.devices()[2:4]))
    assert set(plan.kinds) == {"merge"}
    with pytest.raises(tj.errors.PlanError, match=r"executor='host'.*key<fry>.*'keys'"):
        tj.reshard(state, plan, executor="host")
    assert_shards_equal(state, expected, src)  # refused before anything moved
    new, report = tj.reshard(state, plan)
    assert_shards_equal(new, expected, plan.dst)
    assert (report.bytes_moved, report.bytes_kept) == (plan.bytes_moved, plan.bytes_kept)
    assert report.kinds == {"device": collections.Counter(merge=2)}


def test_the_host_paths_copy_threads_end_with_the_call():
    before = {t.ident for t in threading.enumerate()}
    *_, report, _ = run_row(MATRIX[2], "host")  # tp 2 -> 4: many shards, copied on a pool
    assert sum(report.kinds["host"].values()) > 1
    assert not [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name.startswith("tenplex-copy")
    ]


def test_an_unknown_executor_is_refused_before_anything_moves():
    state, src, _ = laid_out(C(data=2), range(2))
    plan = tj.make_plan(src, target(src, C(data=4), range(4)))
    with pytest.raises(ValueError, match=r"executor must be one of \('auto', 'host', 'device'\)"):
        tj.reshard(state, plan, executor="gpu")
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_a_plan_that_keeps_every_shard_copies_nothing_and_reuses_buffers():
    state, src, _ = laid_out(C(data=2, tensor=4), range(8))
    plan = tj.make_plan(src, target(src, C(data=2, tensor=4), range(8)))
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
    plan = tj.make_plan(src, target(src, C(data=3, tensor=2), range(2, 8)))
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
    tj.reshard(placed, tj.make_plan(ptc, target(ptc, C(data=4), range(4, 8))), donate=True)
    assert not any(x.is_deleted() for x in jax.tree.leaves(before))
    for got, want in zip(host_copy(before), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("committed", [False, True])
def test_placing_never_shares_a_buffer_with_the_callers_state(committed):
    """Replicated leaves (the optimizer's step and count) placed onto a mesh that includes the
    device holding them: the caller's arrays must survive a donating reshard of the placed state."""
    model, optimizer = train_state()
    given = nnx.state((model, optimizer))  # built on the default device, uncommitted
    if committed:
        given = jax.device_put(given, jax.devices()[0])
    expected = host_copy(given)
    ptc = tj.PTC.of(given, RULES, C(fsdp=2, tensor=2), jax.devices()[:4])
    placed = tj.place(given, ptc)
    tj.reshard(placed, tj.make_plan(ptc, target(ptc, C(data=4), range(4, 8))), donate=True)
    assert not any(x.is_deleted() for x in jax.tree.leaves(given))
    for got, want in zip(host_copy(given), expected):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("executor", PATHS)
@pytest.mark.parametrize("donate", [True, False])
def test_the_memory_of_deleted_leaves_goes_back_to_the_system_in_windows(
    monkeypatch, executor, donate
):
    """Host path, donating: each time the deleted leaves add up to the look-ahead window (an
    eighth of the state, or the largest leaf), freed host memory is given back, after the
    deletions; never without donation, nor on the device path (its memory is the device's)."""
    from tenplex_jax._src import executor as module
    from tenplex_jax._src import libc

    state, src, _ = laid_out(C(fsdp=2, tensor=2), range(4))
    expected = host_copy(state)
    plan = tj.make_plan(src, target(src, C(fsdp=2, tensor=2), range(4, 8)))  # nothing kept
    old = jax.tree.leaves(state)
    sizes = [sum(s.data.nbytes for s in array.addressable_shards) for array in old]
    calls = []
    monkeypatch.setattr(
        libc, "release_host_memory", lambda: calls.append(sum(a.is_deleted() for a in old))
    )
    new, _ = tj.reshard(state, plan, executor=executor, donate=donate)
    assert_shards_equal(new, expected, plan.dst)
    window = max([plan.dst.nbytes // 8] + [module._new_bytes(leaf) for leaf in plan.leaves])
    want, freed = [], 0
    for deleted, size in enumerate(sizes, start=1):
        freed += size
        if freed >= window:
            want.append(deleted)
            freed = 0
    assert len(want) >= 2  # the rule is exercised more than once on this state
    assert calls == (want if donate and executor == "host" else [])


def test_without_donation_the_old_state_stays_valid():
    state, src, _ = laid_out(C(fsdp=4, tensor=2), range(8))
    expected = host_copy(state)
    plan = tj.make_plan(src, target(src, C(data=2, tensor=2), range(4, 8)))
    tj.reshard(state, plan, donate=False)
    assert_shards_equal(state, expected, src)


def test_wrong_tree_or_wrong_layout_is_refused_and_the_state_is_untouched():
    state, src, nodes = laid_out(C(data=2, tensor=4), range(8))
    expected = host_copy(state)
    plan = tj.make_plan(src, target(src, C(data=4, tensor=2), range(8)))
    with pytest.raises(
        tj.errors.PlanError,
        match=r"tree does not match.* leaves are in the state, not in the PTC: 'b1' float32\[.*"
        r" leaves are in the PTC, not in the state: '0/b1' float32\[",
    ):
        tj.reshard(nnx.state(nodes[0]), plan)  # the model alone, not model + optimizer
    other, other_ptc, _ = laid_out(C(fsdp=8), range(8), seed=1)
    with pytest.raises(
        tj.errors.PlanError, match=r"not laid out as the plan's source PTC says.*leaf '0/"
    ):
        tj.reshard(other, plan)
    # the same config and specs on the devices in another order: the check that skips the
    # per-device boxes for the PTC's own sharding must still see the other mesh
    permuted, permuted_ptc, _ = laid_out(C(data=2, tensor=4), reversed(range(8)))
    with pytest.raises(
        tj.errors.PlanError, match=r"not laid out as the plan's source PTC says.*leaf '0/"
    ):
        tj.reshard(permuted, plan)
    assert_shards_equal(state, expected, src)
    assert_shards_equal(other, host_copy(other), other_ptc)
    assert_shards_equal(permuted, host_copy(permuted), permuted_ptc)
    new, _ = tj.reshard(state, plan)  # still usable after the refusals
    assert_shards_equal(new, expected, plan.dst)


def test_reshard_accepts_nnx_graph_nodes():
    model, optimizer = train_state()
    src = tj.PTC.of((model, optimizer), RULES, C(data=8), jax.devices())
    nnx.update((model, optimizer), tj.place((model, optimizer), src))
    expected = host_copy(nnx.state((model, optimizer)))
    dst = src.relayout(C(fsdp=2, tensor=2), jax.devices()[:4])
    new, _ = tj.reshard((model, optimizer), tj.make_plan(src, dst))
    nnx.update((model, optimizer), new)
    assert_shards_equal(nnx.state((model, optimizer)), expected, dst)


def test_reshard_onto_an_allocated_device_order():
    """allocate permutes the target's mesh order; the executor builds the new mesh in that order."""
    state, src, _ = laid_out(C(data=4, tensor=2), range(8))
    expected = host_copy(state)
    dst = tj.allocate(src, target(src, C(data=2, tensor=4), range(8)))
    assert dst.device_ids != tuple(range(8))  # the allocation is not the given order
    plan = tj.make_plan(src, dst)
    new, report = tj.reshard(state, plan)
    assert_shards_equal(new, expected, dst)
    assert [d.id for d in plan.dst.mesh().devices.flat] == list(dst.device_ids)
    assert report.bytes_moved == plan.bytes_moved == 0  # tp 2 -> 4 in place: all local splits


@pytest.mark.parametrize("executor", PATHS)
@pytest.mark.parametrize("name", ["dp 4->6 on 2..7", "fsdp 4->2", "disjoint"])
def test_new_shards_own_their_memory_unless_kept(name, executor):
    """A moved or split shard is a copy, never a view of the old buffer that donation frees."""
    _, src_cfg, src_devs, dst_cfg, dst_devs = next(row for row in MATRIX if row[0] == name)
    state, ptc, _ = laid_out(src_cfg, src_devs)
    plan = tj.make_plan(ptc, target(ptc, dst_cfg, dst_devs))
    old = {
        shard.data.unsafe_buffer_pointer()
        for array in jax.tree.leaves(state)
        for shard in array.addressable_shards
    }
    new, _ = tj.reshard(state, plan, donate=False, executor=executor)
    for array, leaf in zip(jax.tree.leaves(new), plan.leaves):
        kinds = {s.device: s.kind for s in leaf.shards}
        for shard in array.addressable_shards:
            shared = shard.data.unsafe_buffer_pointer() in old
            assert shared == (kinds[shard.device.id] == "keep"), (leaf.path, shard.device)


@pytest.mark.parametrize("where", ["pool", "inline"])
@pytest.mark.parametrize("ahead", [0, 3])
@pytest.mark.parametrize("row", [MATRIX[2], MATRIX[4], MATRIX[5]], ids=[IDS[2], IDS[4], IDS[5]])
def test_host_copies_cut_into_chunks_and_run_ahead_stay_exact(row, ahead, where, monkeypatch):
    """The host path cuts every piece into chunks along its first dim longer than 1 and copies
    the next leaves while one is finished; forced small here (the tiny GPT's pieces are far below
    the real CHUNK_BYTES), every shard must still be exact and every donated leaf freed, whether
    the copy pool's threads or the calling thread copy them."""
    from tenplex_jax._src import executor

    monkeypatch.setattr(executor, "CHUNK_BYTES", 24)
    monkeypatch.setattr(executor, "AHEAD", ahead)
    monkeypatch.setattr(executor, "INLINE_BYTES", 0 if where == "pool" else 2**40)
    cut = []
    chunks = executor._chunks
    monkeypatch.setattr(executor, "_chunks", lambda s, d: cut.append(s.nbytes) or chunks(s, d))
    threads = set()
    run = executor._Task.run
    monkeypatch.setattr(
        executor._Task, "run", lambda task: threads.add(threading.current_thread()) or run(task)
    )
    name, src_cfg, src_devs, dst_cfg, dst_devs, *_ = row
    state, src, _ = laid_out(src_cfg, src_devs)
    expected = host_copy(state)
    plan = tj.make_plan(src, tj.allocate(src, target(src, dst_cfg, dst_devs)))
    old = jax.tree.leaves(state)
    new, report = tj.reshard(state, plan, executor="host")
    assert_shards_equal(new, expected, plan.dst)
    assert (report.bytes_moved, report.bytes_kept) == (plan.bytes_moved, plan.bytes_kept)
    assert max(cut) > 24  # some piece was cut
    if where == "inline" or (os.cpu_count() or 1) == 1:  # one core: no pool
        assert threads == {threading.main_thread()}
    else:
        assert threads and all(t.name.startswith("tenplex-copy") for t in threads)
    freed = [
        a.is_deleted()
        for a, leaf in zip(old, plan.leaves)
        if not any(s.kind == "keep" for s in leaf.shards)
    ]
    assert all(freed) and (freed or name != "disjoint")  # disjoint: every old leaf is freed


def test_small_chunks_are_packed_into_tasks_of_up_to_chunk_bytes(monkeypatch):
    """Many small pieces make a few pool tasks, not one each: every task holds at most
    CHUNK_BYTES (or one chunk), and together they copy every byte of the plan once."""
    from tenplex_jax._src import executor

    monkeypatch.setattr(executor, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(executor, "INLINE_BYTES", 0)
    tasks, chunks = [], []
    run, cut = executor._Task.run, executor._chunks
    monkeypatch.setattr(executor._Task, "run", lambda task: tasks.append(task) or run(task))

    def recording(src, dst):
        parts = list(cut(src, dst))
        chunks.extend(parts)
        return parts

    monkeypatch.setattr(executor, "_chunks", recording)
    state, src, _ = laid_out(C(pipe=2, data=2, tensor=2), range(8))
    expected = host_copy(state)
    plan = tj.make_plan(src, tj.allocate(src, target(src, C(fsdp=4, tensor=2), range(8))))
    new, report = tj.reshard(state, plan, executor="host")
    assert_shards_equal(new, expected, plan.dst)
    assert all(t.nbytes <= 4096 or len(t.copies) == 1 for t in tasks)
    assert len(chunks) > 2 * len(tasks)  # packed
    assert sum(t.nbytes for t in tasks) == sum(s.nbytes for s, _ in chunks)
    assert sum(t.moved for t in tasks) == report.bytes_moved == plan.bytes_moved


def test_chunks_cut_along_the_first_dim_longer_than_one(monkeypatch):
    from tenplex_jax._src import executor

    monkeypatch.setattr(executor, "CHUNK_BYTES", 64)
    src = np.arange(3 * 40, dtype=np.float32).reshape(1, 3, 40)[:, :, 8:32]  # strided view
    dst = np.zeros((1, 3, 24), np.float32)
    parts = list(executor._chunks(src, dst))
    assert len(parts) == 3 and all(s.shape == (1, 1, 24) for s, _ in parts)
    for s, d in parts:
        np.copyto(d, s)
    np.testing.assert_array_equal(dst, src)
