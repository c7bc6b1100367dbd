"""Plans are pure deltas of two PTCs: kinds, sources, byte totals, replica choice."""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax._src import box as boxes
from tenplex_jax._src import plan as plan_module
from tests.helpers import RULES, abstract_state


def one_leaf(config, spec, shape=(8, 8), devices=None, hosts=None):
    leaf = tj.typing.LeafLayout("w", shape, np.dtype(np.float32), P(*spec))
    devices = tuple(range(config.num_devices)) if devices is None else tuple(devices)
    return tj.PTC(config, devices, tuple(hosts or (0,) * len(devices)), (leaf,), "tree")


def test_identity_plan_keeps_everything_and_moves_nothing():
    ptc = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, fsdp=2, tensor=2), range(8))
    plan = tj.make_plan(ptc, ptc)
    assert plan.bytes_moved == 0
    assert set(plan.kinds) == {"keep"}
    # every target shard counted once: kept bytes = sum of the target shard sizes
    assert plan.bytes_kept == sum(
        math.prod(hi - lo for lo, hi in box) * leaf.itemsize
        for leaf in ptc.leaves
        for box in ptc.boxes(leaf).values()
    )


def test_a_change_that_leaves_a_leaf_in_place_moves_none_of_its_bytes():
    # data=8 → data=4 on devices 0..3: replicated leaves stay where they are.
    src = one_leaf(tj.ParallelConfig(data=8), ())
    dst = one_leaf(tj.ParallelConfig(data=4), ())
    plan = tj.make_plan(src, dst)
    assert plan.bytes_moved == 0 and plan.kinds == {"keep": 4}


def test_split_when_the_target_box_is_inside_the_local_shard():
    plan = tj.make_plan(
        one_leaf(tj.ParallelConfig(tensor=2), (None, "tensor")),
        one_leaf(tj.ParallelConfig(tensor=4), (None, "tensor")),
    )
    # device 0 had columns 0:4 and now needs 0:2 (split); device 1 had 4:8 and needs 2:4 (move)
    assert [s.kind for s in plan.leaves[0].shards] == ["split", "move", "move", "move"]
    assert plan.bytes_kept == 8 * 2 * 4 and plan.bytes_moved == 3 * 8 * 2 * 4


def test_merge_concatenates_pieces_from_several_sources():
    plan = tj.make_plan(
        one_leaf(tj.ParallelConfig(tensor=4), (None, "tensor")),
        one_leaf(tj.ParallelConfig(tensor=2), (None, "tensor")),
    )
    shards = plan.leaves[0].shards
    assert [s.kind for s in shards] == ["merge", "merge"]
    assert [p.src_device for p in shards[0].pieces] == [0, 1]
    assert [p.local for p in shards[0].pieces] == [True, False]
    assert [p.box for p in shards[1].pieces] == [((0, 8), (4, 6)), ((0, 8), (6, 8))]


def test_disjoint_devices_move_every_byte():
    src = one_leaf(tj.ParallelConfig(data=2, tensor=2), (None, "tensor"))
    dst = one_leaf(tj.ParallelConfig(data=2, tensor=2), (None, "tensor"), devices=range(4, 8))
    plan = tj.make_plan(src, dst)
    assert plan.bytes_kept == 0 and plan.bytes_moved == 4 * 8 * 4 * 4
    assert set(plan.kinds) == {"move"}


def test_replicas_prefer_same_host_then_spread_the_load():
    # Replicated on 0..3 (hosts 0,0,1,1); targets 4..7 on hosts 1,1,0,0.
    src = one_leaf(tj.ParallelConfig(data=4), (), hosts=(0, 0, 1, 1))
    dst = tj.PTC(tj.ParallelConfig(data=4), (4, 5, 6, 7), (1, 1, 0, 0), src.leaves, "tree")
    senders = [s.pieces[0].src_device for s in tj.make_plan(src, dst).leaves[0].shards]
    assert senders == [2, 3, 0, 1]


def test_replicas_on_one_host_share_the_sending():
    src = one_leaf(tj.ParallelConfig(data=2), ())
    dst = one_leaf(tj.ParallelConfig(data=4), (), devices=range(4, 8))
    plan = tj.make_plan(src, dst)
    assert plan.senders == {0: 2 * 256, 1: 2 * 256}


def test_mismatched_trees_are_refused():
    a = one_leaf(tj.ParallelConfig(), (), shape=(8, 8))
    b = one_leaf(tj.ParallelConfig(), (), shape=(8, 4))
    with pytest.raises(
        tj.errors.PlanError,
        match=r"source PTC \(1 leaves on Mesh\('pipe': 1, 'data': 1, 'fsdp': 1, 'tensor': 1; "
        r"Auto\) over devices \[0\]\).* differ: 1 leaf is in both with another shape or dtype: 'w' "
        r"is float32\[8, 8\] spec=P\(None, None\) in the source, float32\[8, 4\] spec=P\(None, "
        r"None\) in the target$",
    ):
        tj.make_plan(a, b)
    c = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(), range(1))
    with pytest.raises(
        tj.errors.PlanError,
        match=r"1 leaf is in the source, not in the target: 'w' float32\[8, 8\] spec=P\(None, "
        r"None\); 44 leaves are in the target, not in the source: '0/b1' float32\[2, 64\] "
        r"spec=P\('pipe', 'tensor'\), .*, and 41 more$",
    ):
        tj.make_plan(a, c)


def test_summary_names_configs_groups_and_totals():
    src = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=4), range(8))
    dst = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=3, tensor=2), range(2, 8))
    text = str(tj.make_plan(src, dst))
    assert "data=2,tensor=4 on devices 0..7 -> data=3,tensor=2 on devices 2..7" in text
    assert "1/opt_state/0/mu" in text and "total" in text


CHANGES = st.sampled_from(
    [
        ((8, 1, 1), (4, 1, 1)),
        ((4, 1, 2), (2, 2, 2)),
        ((1, 4, 2), (2, 1, 4)),
        ((2, 1, 4), (3, 1, 2)),
        ((1, 1, 2), (1, 2, 4)),
    ]
)


@settings(max_examples=30, deadline=None)
@given(change=CHANGES, offset=st.integers(0, 2), data=st.data())
def test_every_target_byte_comes_from_exactly_one_source(change, offset, data):
    """Pieces tile each target box exactly; kept + moved = the bytes of all target shards."""
    (sd, sf, stt), (dd, df, dt) = change
    src_cfg = tj.ParallelConfig(data=sd, fsdp=sf, tensor=stt)
    dst_cfg = tj.ParallelConfig(data=dd, fsdp=df, tensor=dt)
    src_devs = data.draw(st.permutations(range(8)))[: src_cfg.num_devices]
    dst_devs = (
        list(range(8))[offset:][: dst_cfg.num_devices]
        if dst_cfg.num_devices + offset <= 8
        else list(range(dst_cfg.num_devices))
    )
    src = tj.PTC.of(abstract_state(), RULES, src_cfg, src_devs, allow_replicate=True)
    dst = tj.PTC.of(abstract_state(), RULES, dst_cfg, dst_devs, allow_replicate=True)
    plan = tj.make_plan(src, dst)
    total = 0
    for leaf in plan.leaves:
        src_boxes = src.boxes(leaf.src)
        for shard in leaf.shards:
            covered = np.zeros([hi - lo for lo, hi in shard.box], dtype=np.int32)
            for piece in shard.pieces:
                assert src_boxes[piece.src_device] == piece.src_box
                assert piece.local == (piece.src_device == shard.device)
                covered[
                    tuple(
                        slice(lo - blo, hi - blo)
                        for (lo, hi), (blo, _) in zip(piece.box, shard.box)
                    )
                ] += 1
            assert (covered == 1).all(), (leaf.path, shard)
            total += covered.size * leaf.dst.itemsize
    assert plan.bytes_moved + plan.bytes_kept == total


def test_allocation_turns_a_tp_change_on_the_same_devices_into_local_splits():
    src = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=4, tensor=2), range(8))
    dst = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=4), range(8))
    assert tj.make_plan(src, dst).bytes_moved > 0
    plan = tj.make_plan(src, tj.allocate(src, dst))
    assert plan.bytes_moved == 0 and set(plan.kinds) == {"keep", "split"}


@settings(max_examples=25, deadline=None)
@given(change=CHANGES, data=st.data())
def test_allocation_never_moves_more_and_only_permutes_devices(change, data):
    (sd, sf, stt), (dd, df, dt) = change
    src_cfg = tj.ParallelConfig(data=sd, fsdp=sf, tensor=stt)
    dst_cfg = tj.ParallelConfig(data=dd, fsdp=df, tensor=dt)
    src = tj.PTC.of(
        abstract_state(),
        RULES,
        src_cfg,
        data.draw(st.permutations(range(8)))[: src_cfg.num_devices],
        hosts=None,
        allow_replicate=True,
    )
    dst_devs = data.draw(st.permutations(range(8)))[: dst_cfg.num_devices]
    dst = tj.PTC.of(abstract_state(), RULES, dst_cfg, dst_devs, allow_replicate=True)
    better = tj.allocate(src, dst)
    assert sorted(better.device_ids) == sorted(dst.device_ids)
    assert better.config == dst.config and better.leaves == dst.leaves
    assert tj.make_plan(src, better).bytes_moved <= tj.make_plan(src, dst).bytes_moved


@settings(max_examples=25, deadline=None)
@given(change=CHANGES, data=st.data())
def test_allocation_keeps_as_many_bytes_as_the_best_device_to_position_assignment(change, data):
    # allocate solves between classes of interchangeable devices and positions; the optimum must be
    # that of the full assignment of every device to every mesh position (Hungarian, by brute force)
    from scipy.optimize import linear_sum_assignment

    (sd, sf, stt), (dd, df, dt) = change
    src_cfg = tj.ParallelConfig(data=sd, fsdp=sf, tensor=stt)
    dst_cfg = tj.ParallelConfig(data=dd, fsdp=df, tensor=dt)
    src_devs = data.draw(st.permutations(range(8)))[: src_cfg.num_devices]
    src = tj.PTC.of(abstract_state(), RULES, src_cfg, src_devs, allow_replicate=True)
    dst_devs = data.draw(st.permutations(range(8)))[: dst_cfg.num_devices]
    dst = tj.PTC.of(abstract_state(), RULES, dst_cfg, dst_devs, allow_replicate=True)
    overlap = np.zeros((len(dst_devs), len(dst_devs)))  # [device, position]
    for s, d in zip(src.leaves, dst.leaves):
        held, wanted = src.boxes(s), list(dst.boxes(d).values())
        for i, device in enumerate(dst_devs):
            if device in held:
                for j, box in enumerate(wanted):
                    part = boxes.intersect(held[device], box)
                    overlap[i, j] += (
                        boxes.size(part) * d.itemsize
                        if all(lo < hi for lo, hi in part) or not part
                        else 0
                    )
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    assert tj.make_plan(src, tj.allocate(src, dst)).bytes_kept == overlap[rows, cols].sum()


def test_leaves_of_one_layout_share_shard_plans_with_consistent_totals():
    # params and their two AdamW moments share layouts: planned once, totals match the shards
    src = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=2, tensor=4), range(8))
    dst = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(data=3, tensor=2), range(2, 8))
    plan = tj.make_plan(src, dst)
    by_layout = {}
    for leaf in plan.leaves:
        key = (leaf.src.shape, leaf.src.spec, leaf.dst.spec)
        assert by_layout.setdefault(key, leaf.shards) is leaf.shards, leaf.path
        assert leaf.bytes_moved == sum(s.bytes_moved for s in leaf.shards), leaf.path
        assert leaf.bytes_kept == sum(s.bytes_kept for s in leaf.shards), leaf.path
        assert leaf.kinds == collections.Counter(s.kind for s in leaf.shards), leaf.path
    assert len(by_layout) < len(plan.leaves)
    # the senders' loads add up to the bytes moved, leaf by leaf
    assert sum(plan.senders.values()) == plan.bytes_moved


class _ReferenceSenders:
    """The sender choice by its definition, one linear scan per piece: a same-host replica with
    the least bytes sent (then sent before, then id), else the least loaded replica of any host."""

    def __init__(self, devices, host, before):
        self.devices, self.host, self.before = list(devices), host, before
        self.sent = {}

    def take(self, target_host, nbytes):
        order = lambda c: (self.sent.get(c, 0), self.before.get(c, 0), c)
        same = [c for c in self.devices if self.host.get(c) == target_host]
        c = min(same or self.devices, key=order)
        self.sent[c] = self.sent.get(c, 0) + nbytes
        return c


@settings(max_examples=30, deadline=None)
@given(change=CHANGES, data=st.data())
def test_senders_are_the_closest_least_loaded_replicas_on_any_hosts(change, data):
    (sd, sf, stt), (dd, df, dt) = change
    src_cfg = tj.ParallelConfig(data=sd, fsdp=sf, tensor=stt)
    dst_cfg = tj.ParallelConfig(data=dd, fsdp=df, tensor=dt)
    hosts = data.draw(st.lists(st.integers(0, 3), min_size=8, max_size=8))
    src_devs = data.draw(st.permutations(range(8)))[: src_cfg.num_devices]
    dst_devs = data.draw(st.permutations(range(8)))[: dst_cfg.num_devices]
    src = tj.PTC.of(
        abstract_state(),
        RULES,
        src_cfg,
        src_devs,
        hosts=[hosts[d] for d in src_devs],
        allow_replicate=True,
    )
    dst = tj.PTC.of(
        abstract_state(),
        RULES,
        dst_cfg,
        dst_devs,
        hosts=[hosts[d] for d in dst_devs],
        allow_replicate=True,
    )
    plan = tj.make_plan(src, dst)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plan_module, "_Senders", _ReferenceSenders)
        reference = tj.make_plan(src, dst)
    assert [leaf.shards for leaf in plan.leaves] == [leaf.shards for leaf in reference.leaves]
