"""The dataset PTC: a fixed global batch sequence, exactly-once epochs, any data-parallel size."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex_jax as tj
from tenplex_jax.data import Remainder


def test_layout_splits_a_batch_unevenly_and_pads_every_rank_to_the_longest():
    layout = tj.data.BatchLayout(64, ranks=3)
    assert layout.counts == (22, 21, 21)
    assert layout.rows == 66
    pos = layout.positions()
    assert sorted(pos[pos >= 0]) == list(range(64))  # every position once, in rank order
    assert [int((pos[layout.rank_rows(r)] < 0).sum()) for r in range(3)] == [0, 1, 1]


def test_grad_units_are_whole_units_spread_over_ranks():
    layout = tj.data.BatchLayout(24, ranks=6, grad_units=8)
    assert (layout.unit, layout.slots, layout.rows) == (3, 2, 36)
    assert layout.counts == (6, 6, 3, 3, 3, 3)
    assert list(layout.unit_rows()) == [0, 1, 2, 3, 4, 6, 8, 10]
    # the units' rows, in unit order, are the global batch in order
    pos = layout.positions().reshape(12, 3)
    np.testing.assert_array_equal(pos[layout.unit_rows()].reshape(-1), np.arange(24))


def test_accumulation_pads_each_rank_to_a_multiple_of_the_microbatches():
    layout = tj.data.BatchLayout(10, ranks=3, accumulate=2)
    assert layout.counts == (4, 3, 3)
    assert layout.slots == 4 and layout.rows == 12


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("max_rows", [1, 3, 7, 64])
def test_a_memory_cap_keeps_the_global_batch_by_accumulating(ranks, max_rows):
    layout = tj.data.BatchLayout.fit(24, ranks, max_rows=max_rows)
    assert layout.global_batch == 24 and layout.microbatch <= max_rows
    assert sum(layout.counts) == 24
    if max_rows >= -(-24 // ranks):
        assert layout.accumulate == 1
    by_units = tj.data.BatchLayout.fit(24, min(ranks, 6), max_rows=max(max_rows, 4), grad_units=6)
    assert by_units.microbatch == 4
    with pytest.raises(tj.errors.DataError, match="max_rows=3; use at least 8 gradient units"):
        tj.data.BatchLayout.fit(24, 2, max_rows=3, grad_units=6)


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        ({"global_batch": 4, "ranks": 5}, "only 4 samples in a global batch"),
        ({"global_batch": 24, "ranks": 9, "grad_units": 8}, "only 8 gradient units"),
        ({"global_batch": 24, "ranks": 2, "grad_units": 5}, "must divide the global batch 24"),
        (
            {"global_batch": 24, "ranks": 2, "grad_units": 8, "accumulate": 2},
            "already run one unit",
        ),
        ({"global_batch": 0, "ranks": 1}, ">= 1"),
    ],
)
def test_bad_layouts_name_the_rule(kwargs, rule):
    with pytest.raises(tj.errors.DataError, match=rule):
        tj.data.BatchLayout(**kwargs)


def test_carry_mode_straddles_epochs_and_sees_each_sample_once_per_epoch():
    ds = tj.DatasetPTC(np.arange(10) * 10, global_batch=4, seed=1)
    stream = np.concatenate([ds.indices(k)[0] for k in range(5)])  # 20 samples = 2 epochs
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert list(ds.indices(2)[1]) == [0, 0, 1, 1]
    assert not np.array_equal(stream[:10], stream[10:])  # a new permutation each epoch
    rows, _weights, samples = ds.batch(0, tj.data.BatchLayout(4, ranks=1))
    np.testing.assert_array_equal(rows, samples * 10)


def test_drop_and_pad_modes_end_every_epoch_on_a_batch_boundary():
    drop = tj.DatasetPTC(np.arange(10), global_batch=4, remainder="drop")
    assert drop.steps_per_epoch == 2
    assert len(set(np.concatenate([drop.indices(k)[0] for k in range(2)]))) == 8
    assert set(drop.indices(2)[1]) == {1}
    pad = tj.DatasetPTC(np.arange(10), global_batch=4, remainder="pad")
    assert [len(pad.indices(k)[0]) for k in range(4)] == [4, 4, 2, 4]
    _rows, weights, samples = pad.batch(2, tj.data.BatchLayout(4, ranks=3))
    assert weights.sum() == 2 and (samples >= 0).sum() == 2
    assert pad.consumed_after(3) == 10 and pad.consumed_after(4) == 14


def run(ds_args, sequence, steps, save_at_resize):
    """Global batches seen by all ranks, in unit order, with layout changes at the given steps."""
    source, batch, seed, remainder = ds_args
    ds = tj.DatasetPTC(source, batch, seed=seed, remainder=remainder)
    layout = None
    batches = []
    for step in range(steps):
        if step in sequence:
            if save_at_resize:  # a resize is a new dataset object restored from the saved record
                saved = ds.state().to_json()
                ds = tj.DatasetPTC(source, batch, seed=seed, remainder=remainder)
                ds.restore(tj.data.DataState.from_json(saved))
            layout = tj.data.BatchLayout(batch, **sequence[step])
        parts = [ds.rank_batch(ds.step, layout, r) for r in range(layout.ranks)]
        ds.step += 1
        rows = np.concatenate([p[0] for p in parts])
        samples = np.concatenate([p[2] for p in parts])
        weights = np.concatenate([p[1] for p in parts])
        assert np.array_equal(weights > 0, samples >= 0)
        np.testing.assert_array_equal(rows[samples >= 0], samples[samples >= 0] * 3)
        batches.append(samples[samples >= 0])
    return batches


@st.composite
def resize_runs(draw):
    batch = draw(st.integers(1, 16))
    n = draw(st.integers(batch, 5 * batch).filter(lambda n: n % batch or n == batch))
    remainder = draw(st.sampled_from(Remainder))
    steps = draw(st.integers(1, 3 * -(-n // batch)))
    points = sorted(draw(st.sets(st.integers(1, max(1, steps - 1)), max_size=4)) | {0})
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    sequence = {}
    for p in points:
        grad_units = draw(st.sampled_from([None, *divisors]))
        units = batch if grad_units is None else grad_units
        ranks = draw(st.integers(1, min(8, units)))
        accumulate = draw(st.integers(1, 3)) if grad_units is None else 1
        sequence[p] = {"ranks": ranks, "grad_units": grad_units, "accumulate": accumulate}
    return (np.arange(n) * 3, batch, draw(st.integers(0, 2**16)), remainder), sequence, steps


@settings(max_examples=60, deadline=None)
@given(resize_runs(), st.booleans())
def test_any_resize_sequence_sees_the_batches_of_a_fixed_run_each_sample_once_per_epoch(
    run_args, save
):
    ds_args, sequence, steps = run_args
    source, batch, _, remainder = ds_args
    n = len(source)
    resized = run(ds_args, sequence, steps, save)
    fixed = run(ds_args, {0: {"ranks": 1}}, steps, False)
    assert len(resized) == len(fixed)
    for got, want in zip(resized, fixed):
        np.testing.assert_array_equal(got, want)  # same global batch, same order
    stream = np.concatenate(resized)
    if remainder == "carry":
        for e in range(len(stream) // n):
            assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
        assert len(set(stream[(len(stream) // n) * n :])) == len(stream) % n  # partial epoch
    else:
        per_epoch = n if remainder == "pad" else (n // batch) * batch
        for e in range(-(-len(stream) // per_epoch)):
            epoch = stream[e * per_epoch : (e + 1) * per_epoch]
            assert len(set(epoch)) == len(epoch)  # never twice in an epoch
            if len(epoch) == per_epoch and remainder == "pad":
                assert sorted(epoch) == list(range(n))  # pad: every sample, exactly once


def test_a_restored_state_resumes_at_the_next_sample_on_another_layout():
    source = np.arange(50)
    ds = tj.DatasetPTC(source, 8, seed=5)
    for _ in range(4):
        ds.next_batch(tj.data.BatchLayout(8, ranks=4))
    saved = json.loads(ds.state().to_json())
    assert saved["consumed"] == 32
    again = tj.DatasetPTC(source, 8, seed=5)
    again.restore(tj.data.DataState(**saved))
    _rows, _weights, samples = again.next_batch(tj.data.BatchLayout(8, ranks=3))
    np.testing.assert_array_equal(samples[samples >= 0], ds.indices(4)[0])


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"source": np.arange(50) + 1}, "fingerprint"),
        ({"global_batch": 4}, "global_batch=8"),
        ({"seed": 6}, "seed=5"),
        ({"remainder": "drop"}, "remainder='carry'"),
    ],
)
def test_restoring_a_state_saved_for_another_order_is_refused_and_consumes_nothing(change, rule):
    ds = tj.DatasetPTC(np.arange(50), 8, seed=5)
    ds.next_batch(tj.data.BatchLayout(8, ranks=2))
    saved = ds.state()
    args = {"source": np.arange(50), "global_batch": 8, "seed": 5, "remainder": "carry"} | change
    other = tj.DatasetPTC(args.pop("source"), **args)
    other.next_batch(tj.data.BatchLayout(other.global_batch, ranks=1))
    with pytest.raises(tj.errors.DataError, match=rule):
        other.restore(saved)
    assert other.step == 1


def test_a_position_inside_a_batch_is_refused():
    ds = tj.DatasetPTC(np.arange(50), 8)
    state = ds.state()
    with pytest.raises(tj.errors.DataError, match="not a global-batch boundary"):
        ds.restore(tj.data.DataState(**{**state.__dict__, "consumed": 13}))
    assert ds.step == 0


def test_bad_datasets_are_refused():
    with pytest.raises(tj.errors.DataError, match="fewer than one global batch of 8"):
        tj.DatasetPTC(np.arange(5), 8)
    with pytest.raises(tj.errors.DataError, match="remainder must be one of"):
        tj.DatasetPTC(np.arange(50), 8, remainder="wrap")
    with pytest.raises(tj.errors.DataError, match="one length"):
        tj.DatasetPTC({"a": np.arange(50), "b": np.arange(40)}, 8)
    with pytest.raises(tj.errors.DataError, match="len"):
        tj.DatasetPTC(iter(range(50)), 8)
    ds = tj.DatasetPTC(np.arange(50), 8)
    with pytest.raises(tj.errors.DataError, match="global batch is fixed"):
        ds.next_batch(tj.data.BatchLayout(16, ranks=2))
    assert ds.step == 0
    with pytest.raises(tj.errors.DataError, match="keys"):
        tj.data.DataState.from_json('{"consumed": 3}')


def test_memmaps_dicts_and_grain_datasets_serve_the_same_batches(tmp_path):
    grain = pytest.importorskip("grain")
    data = np.arange(60 * 3, dtype=np.int32).reshape(60, 3)
    path = tmp_path / "samples.bin"
    data.tofile(path)
    memmap = np.memmap(path, dtype=np.int32, mode="r", shape=(60, 3))
    sources = {
        "array": data,
        "memmap": memmap,
        "dict": {"x": data},
        "grain": grain.MapDataset.source(list(data)).map(lambda x: {"x": x}),
    }
    layout = tj.data.BatchLayout(16, ranks=3, grad_units=4)
    served = {}
    for name, source in sources.items():
        ds = tj.DatasetPTC(source, 16, seed=2, fingerprint="samples-v1")
        rows, _, samples = ds.batch(7, layout)
        served[name] = rows["x"] if isinstance(rows, dict) else rows
        np.testing.assert_array_equal(served[name][samples >= 0], data[samples[samples >= 0]])
    for name in sources:
        np.testing.assert_array_equal(served[name], served["array"])
    # a fingerprint from the content tells datasets apart by default
    assert tj.DatasetPTC(data, 16).fingerprint == tj.DatasetPTC(memmap, 16).fingerprint
    assert tj.DatasetPTC(data, 16).fingerprint != tj.DatasetPTC(data + 1, 16).fingerprint


class RecordingDataset(tj.DatasetPTC):
    """A dataset PTC that records the size of every read."""

    reads: list[int]

    def load(self, indices):
        self.reads = [*getattr(self, "reads", []), len(indices)]
        return super().load(indices)


def test_device_batch_reads_each_ranks_rows_once_and_places_them_on_its_devices():
    data = np.arange(80, dtype=np.int32).reshape(40, 2)
    ds = RecordingDataset(data, 10, seed=4)
    ds.reads = []
    mesh = tj.ParallelConfig(data=3, tensor=2).make_mesh(jax.devices()[:6])
    layout = tj.data.BatchLayout(10, ranks=3)  # 4, 3, 3 samples, each rank padded to 4 rows
    batch, weights, samples = tj.data.device_batch(ds, 2, layout, mesh, ("data",))
    assert ds.reads == [4, 4, 4]  # one read per rank, shared by its 2 tensor-parallel devices
    assert sorted(samples[samples >= 0]) == sorted(ds.indices(2)[0])
    for shard in batch.addressable_shards:
        rows = samples[shard.index[0]]
        np.testing.assert_array_equal(np.asarray(shard.data)[rows >= 0], data[rows[rows >= 0]])
    assert float(np.asarray(weights).sum()) == 10


@pytest.mark.parametrize(
    "change, rule",
    [
        ({"consumed": 16.0}, "integer counts"),
        ({"consumed": -8}, "integer counts"),
        ({"consumed": 10**40}, "below 2\\*\\*62"),
        ({"num_samples": 2**62}, "below 2\\*\\*62"),
        ({"global_batch": 0}, "integer counts"),
        ({"seed": True}, "integer counts"),
        ({"fingerprint": 3}, "string fingerprint"),
        ({"remainder": "wrap"}, "remainder in"),
    ],
)
def test_a_saved_position_with_a_bad_field_is_a_data_error(change, rule):
    ds = tj.DatasetPTC(np.arange(50), 8)
    ds.next_batch(tj.data.BatchLayout(8, ranks=1))
    record = json.loads(ds.state().to_json()) | change
    with pytest.raises(tj.errors.DataError, match=rule):
        tj.data.DataState.from_json(json.dumps(record))
    for text in ("{not json", '"a string"', "[1, 2]", "[" * 100000):
        with pytest.raises(tj.errors.DataError, match="data state"):
            tj.data.DataState.from_json(text)
    # NumPy integers are integers: kept, as Python ints
    state = tj.data.DataState(**{**ds.state().__dict__, "consumed": np.int64(8)})
    assert type(state.consumed) is int and ds.state() == state


@settings(max_examples=60, deadline=None)
@given(
    n=st.one_of(st.integers(1, 300), st.integers(65_000, 140_000)),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_an_epoch_is_a_permutation_computed_by_position_alone(n, seed, epoch):
    """Each epoch's order is a bijection of range(N), the same whether computed whole or a batch
    at a time across the blocks it is cached in, and another for another seed or epoch."""
    batch = 1 + n // 7
    ds = tj.DatasetPTC(np.arange(n), batch, seed=seed, remainder="pad")
    whole = ds.permutation(epoch)
    np.testing.assert_array_equal(np.sort(whole), np.arange(n))
    steps = range(epoch * int(ds.steps_per_epoch), (epoch + 1) * int(ds.steps_per_epoch))
    served = np.concatenate([ds.indices(k)[0] for k in steps])
    np.testing.assert_array_equal(served, whole)
    if n > 20:
        assert not np.array_equal(whole, ds.permutation(epoch + 1))
        other = tj.DatasetPTC(np.arange(n), batch, seed=seed + 1, remainder="pad")
        assert not np.array_equal(whole, other.permutation(epoch))


def test_a_data_state_of_the_whole_epoch_permutation_is_refused_by_name():
    state = json.loads(tj.DatasetPTC(np.arange(10), 4).state().to_json())
    assert state.pop("order") == "feistel"
    with pytest.raises(tj.errors.DataError, match="drew each epoch's order as a whole permutation"):
        tj.data.DataState.from_dict(state)
    with pytest.raises(tj.errors.DataError, match="the order 'feistel'"):
        tj.data.DataState(**state, order="numpy")


@settings(max_examples=40, deadline=None)
@given(
    n=st.one_of(st.integers(1, 300), st.integers(65_000, 70_000)),
    batch=st.integers(1, 40),
    ranks=st.integers(1, 5),
    steps=st.lists(st.integers(0, 5_000), min_size=1, max_size=12),
)
def test_rows_laid_out_ahead_are_those_of_each_batch_alone(n, batch, ranks, steps):
    """``samples`` lays out ``LAID_OUT_STEPS`` global batches at once ("carry"): in any order of
    steps, across epochs and blocks, each is the batch's own indices in the layout's positions,
    and a caller that writes into what it got changes nothing the next call returns."""
    batch, ranks = min(batch, n), min(ranks, batch, n)
    ds = tj.DatasetPTC(np.arange(n), batch, seed=3)
    layout = tj.data.BatchLayout(batch, ranks=ranks)
    pos = layout.positions()
    for step in [*steps, steps[0], steps[0] + 1]:
        samples, weights = ds.samples(step, layout)
        indices = ds.indices(step)[0]
        np.testing.assert_array_equal(samples, np.where(pos >= 0, indices[pos], -1))
        np.testing.assert_array_equal(weights, (pos >= 0).astype(np.float32))
        samples[:], weights[:] = -7, 7.0  # the caller's own copies
