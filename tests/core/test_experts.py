"""Expert parallelism: the mixture-of-experts GPT trains through resizes that change the
expert-parallel degree together with the data, FSDP and tensor degrees.

The step is the one ``ElasticJob`` runs: gradient units over the batch axes ``data`` and ``fsdp``
(data-parallel changes are bitwise), while ``expert`` and ``tensor`` stay model axes, so each device
computes its own experts and XLA sums their outputs over the expert ranks. A change of the expert or
tensor degree regroups those sums, so the resized run agrees with a fixed one to float32 rounding,
not bit for bit; up to the first such change it agrees bit for bit.

The comparison holds for every routing because the runs make no discrete choice that rounding can
flip: every token goes to every expert (``top_k`` = the experts, room for every token), so routing
is the same in every layout and the router's weights are continuous gates. And the optimizer is
SGD with momentum, linear in the gradients, so rounding stays rounding: AdamW divides a gradient
by its running RMS, and where a gradient nearly cancels (a rare byte's embedding row) rounding
becomes a visible part of that coordinate's step (7.5e-5 against a change of 1.8e-2 on one
machine). The tolerance: losses within 1e-6 relative; in every leaf of the params and momenta, at
most 1e-3 of the largest change training made to the leaf plus 16 float32 spacings of its largest
value (what storing the rounded result can add).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax_models import (
    MOE_RULES,
    GPTConfig,
    build_state,
    corpus_samples,
    make_train_step,
    moe_config,
    stdlib_corpus,
)
from tests.helpers import assert_shards_equal, host_copy, minimum_bytes

E = moe_config
BATCH = 16
BATCH_AXES = ("data", "fsdp")
LOSS_RTOL = 1e-6
TOLERANCE = 1e-3  # of the change training made to a leaf
SPACINGS = 16  # float32 spacings of the leaf's largest value
# the schedule: expert=4,data=2 on 8 -> expert=2,tensor=2 on 4 -> expert=4,fsdp=2 on 8
SCHEDULE = {
    0: (E(expert=4, data=2), range(8)),
    2: (E(expert=2, tensor=2), range(4)),
    4: (E(expert=4, fsdp=2), range(8)),
}
STEPS = 5  # one step on the last layout
CHANGE = 2  # the first change of the expert and tensor degrees: bitwise equal up to here
GRAD_UNITS = 8
# every token to every expert, with room for all: no routing choice for rounding to flip
EXPERTS = GPTConfig.moe_tiny().n_experts
MODEL = dataclasses.replace(GPTConfig.moe_tiny(), top_k=EXPERTS, capacity_factor=1.0)


@functools.cache
def source():
    return corpus_samples(stdlib_corpus(2**20), seq_len=32, num_samples=64)


def build():
    """(graphdef, state) of the MoE GPT and SGD with momentum: ``{"model", "optimizer"}``."""
    return build_state(MODEL, 0.1, optimizer="momentum")[:2]


STEPS_BY_LAYOUT: dict = {}  # a layout's jitted step, shared by the runs that use it


def compiled(graphdef, ptc, layout):
    key = (ptc.config, ptc.device_ids, layout)
    if key not in STEPS_BY_LAYOUT:
        STEPS_BY_LAYOUT[key] = make_train_step(graphdef, ptc, layout, batch_axes=BATCH_AXES)
    return STEPS_BY_LAYOUT[key]


def train(schedule: dict, steps: int):
    """(losses, final state on the host, (plan, report) per reshard, the state on the host at
    ``CHANGE``). Every reshard is checked shard by shard at once (the next step donates it)."""
    graphdef, state = build()
    dataset = tj.DatasetPTC(source(), BATCH, seed=1)
    ptc, losses, reshards, first = None, [], [], None
    for i in range(steps):
        if i == CHANGE:
            first = host_copy(state)
        if i in schedule:
            config, ids = schedule[i]
            devices = [jax.devices()[d] for d in ids]
            if ptc is None:
                ptc = tj.PTC.of(state, MOE_RULES, config, devices)
                state = tj.place(state, ptc)
            else:
                new = tj.allocate(ptc, ptc.relayout(config, devices))
                plan = tj.make_plan(ptc, new)
                before = host_copy(state)
                state, report = tj.reshard(state, plan)
                assert_shards_equal(state, before, plan.dst)  # params, momenta, counters
                reshards.append((plan, report))
                ptc = new
            ranks = np.prod([config.size(a) for a in BATCH_AXES])
            layout = tj.data.BatchLayout(BATCH, ranks=int(ranks), grad_units=GRAD_UNITS)
            step = compiled(graphdef, ptc, layout)
        batch, weights, _ = tj.data.device_batch(
            dataset, dataset.step, layout, ptc.mesh(), BATCH_AXES
        )
        dataset.step += 1
        state, loss = step(state, batch, weights)
        losses.append(float(loss))
    return losses, host_copy(state), reshards, first


def paths(state) -> list[str]:
    """The leaves' paths of ``state``, in ``host_copy``'s order (built when a test asks, not when
    the file is collected: every worker collects it)."""
    return [leaf.path for leaf in tj.PTC.of(state, MOE_RULES, SCHEDULE[0][0], range(8)).leaves]


@pytest.fixture(scope="module")
def runs():
    return train(SCHEDULE, STEPS), train({0: SCHEDULE[0]}, STEPS)


def test_experts_are_sharded_over_the_expert_axis_in_every_layout():
    state = build_state(MODEL, 0.1, abstract=True, optimizer="momentum")[1]
    for config, ids in SCHEDULE.values():
        ptc = tj.PTC.of(state, MOE_RULES, config, ids)
        assert ptc.leaf("model/w1").spec == jax.sharding.PartitionSpec(
            "pipe", "expert", "fsdp", "tensor"
        )
        per_device = {box[1] for box in ptc.boxes(ptc.leaf("model/w1")).values()}
        assert len(per_device) == config.size("expert")  # each expert rank holds other experts


def test_every_expert_resize_is_shard_by_shard_equal_and_moves_the_minimum(runs):
    (_, _, reshards, _), _ = runs
    assert [str(plan.dst.config) for plan, _ in reshards] == [
        "expert=2,tensor=2",
        "fsdp=2,expert=4",
    ]
    for plan, report in reshards:  # each one checked shard by shard as it ran
        assert report.bytes_moved == plan.bytes_moved == minimum_bytes(plan.src, plan.dst)
        assert report.bytes_kept == plan.bytes_kept
        assert plan.bytes_moved > 0  # the experts really changed devices


def test_training_through_expert_resizes_matches_a_fixed_run_within_tolerance(runs):
    (losses, state, _, first), (fixed_losses, fixed_state, _, fixed_first) = runs
    assert losses[:CHANGE] == fixed_losses[:CHANGE]  # the same layout: the same bits
    for got, want in zip(first, fixed_first):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(losses, fixed_losses, rtol=LOSS_RTOL)
    assert losses[-1] < losses[0]  # it trains
    initial = build()[1]
    for path, got, want, start in zip(paths(initial), state, fixed_state, host_copy(initial)):
        if want.dtype.kind != "f":
            np.testing.assert_array_equal(got, want, err_msg=path)  # step counters
            continue
        change = np.max(np.abs(want - start))
        rounding = SPACINGS * np.spacing(np.max(np.abs(want)))
        assert np.max(np.abs(got - want)) <= TOLERANCE * change + rounding, path
