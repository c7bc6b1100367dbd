"""The Tenplex artifact's window (``tj.simulator.transformation``) and the like-for-like table
against the paper (``benchmarks/simulate_paper.py``): no devices, abstract states."""

from __future__ import annotations

import dataclasses

import pytest

import tenplex_jax as tj
from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.simulator.artifact import PipelineEdges
from tenplex_jax._src.simulator.costs import Costs
from tenplex_jax._src.simulator.results import PolicyCost
from tenplex_jax_benchmarks import simulate_paper
from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of
from tests.helpers import sim_cluster

C = tj.ParallelConfig
GROW = (C(tensor=4, pipe=2), C(tensor=4, pipe=2, data=2))


@pytest.fixture(scope="module")
def gpt():
    """GPT small's abstract state and profile (built once)."""
    return build_state("small", lr=1e-3, abstract=True)[1], profile_of("small")


def _sim(gpt, **costs) -> tj.simulator.Simulation:
    state, profile = gpt
    return tj.simulator.Simulation(
        sim_cluster(4, 4), profile, state, LOGICAL_RULES, global_batch=64, costs=Costs(**costs)
    )


def test_a_policy_costs_window_is_the_transformation_alone():
    cost = PolicyCost(detect=15.0, commit=3.0, transfer=2.0, restart=5.0, compile=7.0)
    assert cost.seconds == 32.0 and cost.window == 2.0
    assert PolicyCost(detect=15.0, restore=4.0, restart=5.0).window == 4.0


def test_the_window_excludes_restart_detection_and_the_save(gpt):
    rates = {"store_get_bandwidth": 1e9, "store_put_bandwidth": 1e9}
    quick = tj.simulator.transformation(_sim(gpt, restart_seconds=0.0, **rates), *GROW)
    slow = _sim(gpt, restart_seconds=60.0, detect_seconds=30.0, compile_seconds=99.0, **rates)
    assert tj.simulator.transformation(slow, *GROW) == quick
    started = tj.simulator.transformation(slow, *GROW, start_seconds=2.5)
    assert started.seconds == pytest.approx(quick.seconds + 2.5)
    assert quick.bottleneck.startswith("store") and quick.transfer > 0
    # the library's own policy pays its commit and restart outside the window
    change = tj.simulator.fixed_change(slow, *GROW)
    tenplex = change.policies["tenplex"]
    assert tenplex.window == tenplex.transfer < tenplex.seconds - 60.0


def test_central_gets_and_puts_every_byte_at_node_0(gpt):
    sim = _sim(gpt, store_get_bandwidth=1e9, store_put_bandwidth=1e9)
    spread = tj.simulator.transformation(sim, *GROW)
    central = tj.simulator.transformation(sim, *GROW, central=True)
    assert central.store_bytes[0] > 0 and not any(central.store_bytes[1:])
    assert sum(central.store_bytes) == pytest.approx(sum(spread.store_bytes))
    assert central.transfer > spread.transfer


def test_failed_devices_are_read_from_replicas_or_refused(gpt):
    sim = _sim(gpt, store_get_bandwidth=1e9, store_put_bandwidth=1e9)
    shrink = (C(tensor=4, pipe=2, data=2), C(tensor=4, pipe=2))
    whole = tj.simulator.transformation(sim, *shrink, replicas=1)
    failed = tj.simulator.transformation(sim, *shrink, replicas=1, failed_devices=4)
    assert failed.network_bytes > whole.network_bytes  # node 0's share comes from node 1
    with pytest.raises(PlanError, match="in no store"):
        tj.simulator.transformation(sim, *shrink, failed_devices=4)


def test_the_fit_sees_only_the_fitting_half():
    rows = [
        {"fitted": i % 2 == 0, "paper": 2.0 + i, "transfer": 0.1, "store_bytes_max": 1e9 * (i + 1)}
        for i in range(8)
    ]
    constants = simulate_paper.fit(rows)
    moved = [r if r["fitted"] else dict(r, paper=1000.0) for r in rows]
    assert simulate_paper.fit(moved) == constants
    assert constants["rows"] == 4


def test_every_row_of_both_figures_is_in_the_table(monkeypatch):
    keys = {
        (change, model, policy)
        for change in simulate_paper.CHANGES
        for model in simulate_paper.MODELS
        for policy in simulate_paper.POLICIES
    }
    assert len(keys) == 18  # D, P, M x 1.3B, 2.7B, 6.7B x tenplex, central
    assert all(simulate_paper.PAPER[c][p][m] > 0 for c, m, p in keys)
    assert sum(map(simulate_paper.fitted, keys)) == 9  # half fitted, half validated

    window = tj.simulator.Window(
        start=1.0, transfer=1.0, bottleneck="x", state_bytes=1, store_bytes=(1.0,), network_bytes=0
    )
    monkeypatch.setattr(tj.simulator, "transformation", lambda *a, **k: window)
    monkeypatch.setattr(simulate_paper, "MODELS", ("small",))  # quick to build
    monkeypatch.setattr(
        simulate_paper,
        "PAPER",
        {c: {p: {"small": 4.0} for p in simulate_paper.POLICIES} for c in simulate_paper.CHANGES},
    )
    monkeypatch.setattr(simulate_paper, "FAILURE_MODEL", "small")
    rows = simulate_paper.windows(None, 0.0)
    names = [r["row"] for r in rows]
    assert names == [
        f"{c} {p}" for c in simulate_paper.CHANGES for p in simulate_paper.POLICIES
    ] + [f"failure {n} GPUs" for n in simulate_paper.PAPER_FAILURE]
    assert all(r["paper_over_predicted"] == r["paper"] / 2.0 for r in rows)
    assert [r["within_2x"] for r in rows] == [r["paper"] <= 4.0 for r in rows]
    assert not any(r["fitted"] for r in rows if r["row"].startswith("failure"))
    assert dataclasses.asdict(window)["seconds"] == 2.0


def _plan(gpt, source, target):
    """The window's plan of a change on GPT small, Megatron-LM's edges applied."""
    from tenplex_jax._src.simulator.artifact import _on_stages
    from tenplex_jax._src.simulator.fixed import _layout

    sim = _sim(gpt)
    old, new = _layout(sim, source), _layout(sim, target)
    plan = tj.make_plan(old.ptc, tj.allocate(old.ptc, new.ptc))
    return plan, _on_stages(plan, PipelineEdges())


def test_megatron_keeps_the_embedding_first_and_the_head_last(gpt):
    from tenplex_jax._src.simulator.artifact import _stage_of

    change = (C(tensor=4), C(tensor=4, pipe=2))  # GPT small has 2 layers
    every, staged = _plan(gpt, *change)
    stage = _stage_of(staged.dst)
    on = {leaf.path: {stage[s.device] for s in leaf.shards} for leaf in staged.leaves}
    assert on["model/tok_embed"] == on["model/pos_embed"] == {0}
    assert on["optimizer/opt_state/0/mu/tok_embed"] == {0}
    assert on["model/unembed"] == on["model/final_norm_scale"] == {1}
    assert on["model/w1"] == {0, 1}  # a layer leaf: every stage its own layers
    everywhere = {leaf.path: {stage[s.device] for s in leaf.shards} for leaf in every.leaves}
    assert everywhere["model/tok_embed"] == {0, 1}  # this library's GPT: every stage
    sim = _sim(gpt, store_get_bandwidth=1e9, store_put_bandwidth=1e9)
    megatron = tj.simulator.transformation(sim, *change)
    library = PipelineEdges(first=(), last=())
    assert sum(megatron.store_bytes) < sum(
        tj.simulator.transformation(sim, *change, edges=library).store_bytes
    )


def test_a_get_of_part_of_a_saved_tensor_copies_the_whole_tensor(gpt):
    from tenplex_jax._src.simulator.artifact import _store_work

    def ratio(source, target, path):
        plan = _plan(gpt, source, target)[1]
        pieces = [
            p.nbytes for leaf in plan.leaves for s in leaf.shards for p in s.pieces
        ]  # the pulls' order
        work = _store_work(plan)
        i = 0
        for leaf in plan.leaves:
            n = sum(len(s.pieces) for s in leaf.shards)
            if leaf.path == path:
                return {float(w / b) for w, b in zip(work[i : i + n], pieces[i : i + n])}
            i += n

    # the tensor degree doubles: a half of each saved tensor, cut out of a copy of it whole
    assert ratio(C(tensor=2, pipe=2), C(tensor=4, pipe=2), "model/w1") == {4.0}
    assert ratio(C(tensor=2, pipe=2), C(tensor=4, pipe=2), "model/ln1_scale") == {2.0}
    # the pipeline degree doubles: whole layers, a tensor a layer, so whole gets
    assert ratio(C(tensor=2), C(tensor=2, pipe=2), "model/w1") == {2.0}


def test_a_replicated_put_is_forwarded_by_the_targets_store(gpt):
    sim = _sim(gpt, store_get_bandwidth=1e9, store_put_bandwidth=1e9)
    shrink = (C(tensor=4, pipe=2, data=2), C(tensor=4, pipe=2))
    plain = tj.simulator.transformation(sim, *shrink)
    replicated = tj.simulator.transformation(sim, *shrink, replicas=1)
    put = sum(
        p.nbytes for leaf in _plan(gpt, *shrink)[1].leaves for s in leaf.shards for p in s.pieces
    )
    # the target's store: body read, written to itself and the next store, read back (4 b);
    # the next store reads it once (b); without replicas the target's store reads it once
    assert sum(replicated.store_bytes) - sum(plain.store_bytes) == pytest.approx(4 * put)
