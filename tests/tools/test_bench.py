"""The benchmarks' invariants on the tiny GPT, fast: bytes, memory, the central strategy.

The benchmark suite itself (``tenplex-jax bench``) reports speed and memory as ratios measured in
one run; timings are never asserted here. What must hold whatever the machine does: the executor
copies exactly the plan's minimal bytes, a gather-to-one strategy moves no fewer, and a donating
reshard leaves exactly the target layout's buffers alive.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax_benchmarks import plan_llm, plan_scaling, reshard
from tenplex_jax_benchmarks.memory import MemorySampler, current, settle
from tenplex_jax_benchmarks.suite import GOALS
from tests.helpers import RULES, abstract_state, train_state

# one change of each kind, the tiny GPT's state: the rows the suite times on the 114.5M-param GPT
ROWS = [c for c in reshard.MATRIX if c.kind in ("tp", "pp", "mixed", "disjoint")]


@pytest.fixture(scope="module")
def state():
    from flax import nnx

    return nnx.state(train_state())


# a benchmark row end to end: four strategies, orbax's among them
@pytest.mark.parametrize("change", ROWS, ids=[c.name for c in ROWS])
def test_a_reshard_row_copies_the_plan_minimum_and_frees_the_old_buffers(change, state):
    row = reshard.run_change(change, state, RULES, repeats=1, memcpy=1e9, log=lambda *_: None)
    assert set(row["median_seconds"]) == set(reshard.STRATEGIES)
    assert row["min_bytes"] > 0 and row["copied_bytes"] == row["min_bytes"]
    assert row["bytes_ratio"] == 1.0 and row["central_bytes"] >= row["min_bytes"]
    # a donating reshard, rebound: what stays alive is the target layout's buffers, no more
    assert row["leaked_bytes"] == 0 and row["live_after_bytes"] > 0
    assert row["peak_bytes"] >= max(row["steady_before_bytes"], row["steady_after_bytes"])
    ratios = [*row["speedup"].values(), row["bandwidth_ratio"], row["central_over_min"]]
    assert all(math.isfinite(x) and x > 0 for x in ratios), row


def test_a_reshard_that_keeps_a_buffer_alive_is_seen_as_a_leak(state):
    """The leak check is not vacuous: without donation the old layout's buffers stay alive."""
    change = ROWS[-1]  # disjoint: every old buffer should go
    src = tj.PTC.of(state, RULES, change.src, change.src_devices)
    plan = tj.make_plan(src, src.relayout(change.dst, change.dst_devices))
    baseline = reshard.live_arrays()
    placed = tj.place(state, src)
    new, _ = tj.reshard(placed, plan, donate=False)
    kept_alive = reshard.live_buffer_bytes(since=baseline)
    assert kept_alive == reshard._replicated_bytes(src) + reshard._replicated_bytes(plan.dst)
    del placed, new


def test_the_memory_sampler_sees_a_peak_that_is_gone_by_the_end_of_the_block() -> None:
    """Measured against the reading while the transient is held and the rest after it, not against
    a reading before: the process's other threads (an earlier test's buffers, freed after their
    arrays) may lower the baseline while the block runs."""
    nbytes = 64 << 20
    others = nbytes // 2  # what the process's other threads may take or give back meanwhile
    settle()
    with MemorySampler() as sampler:
        transient = np.ones(nbytes, np.uint8)  # every page written: resident
        held = current()
        deadline = time.monotonic() + 30
        while sampler.peak < held - others and time.monotonic() < deadline:
            time.sleep(1e-3)  # until the sampling thread has read it
        del transient
    after = settle()
    assert sampler.peak - after >= nbytes - others, (sampler.peak, held, after)


def test_plan_scaling_plans_one_shard_per_leaf_and_target_device() -> None:
    sizes = (8, 16), (10, 25)
    rows = plan_scaling.run_plan_scaling(*sizes, repeats=1, log=lambda _: None, model="tiny")
    assert [(r["devices"], r["tensors"], r["plan_change"]) for r in rows] == [
        (n, t, change) for n in sizes[0] for t in sizes[1] for change in ("reshape", "shrink")
    ]
    for row in rows:
        targets = row["devices"] if row["plan_change"] == "reshape" else row["devices"] // 2
        assert row["target_shards"] == row["tensors"] * targets, row
        assert row["bytes_moved"] > 0 and len(row["runs_seconds"]) == 1


def test_the_70b_plan_moves_the_minimum_between_meshes_of_other_axes() -> None:
    """The 70B-class decoder state from (data 2, stage 4, fsdp 4, expert 2, tensor 2) to (data 4,
    fsdp 16, tensor 2) on 128 device ids: every byte the plan moves is one it must move, in the
    given and the allocated order (the benchmark times it; nothing is timed here)."""
    row = plan_llm.run(repeats=1, log=lambda _: None)
    assert 65e9 < row["params"] < 75e9 and row["leaves"] == 37
    assert row["target_shards"] == 37 * 128
    assert row["bytes_moved"] == row["bytes_minimum"] > 0
    assert row["bytes_moved_allocated"] == row["bytes_minimum_allocated"] <= row["bytes_moved"]
    src, dst = plan_llm.ptcs()
    assert src.config.names == ("data", "stage", "fsdp", "expert", "tensor")
    assert src.leaf("params/w_up").spec == jax.sharding.PartitionSpec(
        "stage", ("fsdp", "expert"), "tensor"
    )
    assert dst.leaf("params/w_up").spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def test_central_strategy_moves_at_least_the_plan_minimum() -> None:
    state = abstract_state()
    C = tj.ParallelConfig
    for src_cfg, dst_cfg, dst_ids in [
        (C(data=2, tensor=4), C(data=3, tensor=2), range(2, 8)),
        (C(fsdp=4), C(fsdp=4), range(4, 8)),
    ]:
        src = tj.PTC.of(state, RULES, src_cfg, range(src_cfg.num_devices))
        dst = tj.allocate(src, src.relayout(dst_cfg, dst_ids))
        central = reshard.central_bytes(src, dst)
        assert central >= tj.make_plan(src, dst).bytes_moved
    # one device to another: the centre is either end, and it moves the state once, as the plan does
    src = tj.PTC.of(state, RULES, C(), [0])
    dst = src.relayout(C(), [1])
    assert reshard.central_bytes(src, dst) == src.nbytes == tj.make_plan(src, dst).bytes_moved
    # an identity change moves nothing, while gathering to one device still moves the state
    src = tj.PTC.of(state, RULES, C(fsdp=4), range(4))
    assert tj.make_plan(src, src).bytes_moved == 0 < reshard.central_bytes(src, src)


def test_every_goal_of_the_suite_is_a_ratio_with_a_direction():
    assert set(GOALS) >= {"bytes_ratio", "peak_ratio", "bandwidth_ratio", "orbax_speedup"}
    assert all(isinstance(v, float) and v > 0 for v in GOALS.values())


def test_bench_only_runs_the_named_rows_and_judges_only_their_goals(tmp_path, capsys) -> None:
    """``--only plan,store`` (the two cheapest rows, ``--quick``): results.json holds those rows
    and no other, the verdicts only the goals they measure, and the summary is written."""
    import json

    from tenplex_jax._src import cli

    assert cli.main(["bench", "--quick", "--only", "plan,store", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {row["kind"] for row in results["rows"]} == {"plan", "store"}
    assert results["only"] == ["plan", "store"]
    assert set(results["verdicts"]) == {"plan_seconds"}
    assert len([r for r in results["rows"] if r["kind"] == "plan"]) == 8  # 2 x 2 sizes x 2 changes
    summary = (tmp_path / "summary.md").read_text()
    assert "make_plan ms" in summary and "Tensor store" in summary and "plan_seconds" in summary
    assert "Loop overhead" not in summary and "| change | moved MiB" not in summary
    assert (tmp_path / "plan_scaling.png").exists() and not (tmp_path / "reshard.png").exists()
    assert "wrote" in capsys.readouterr().out


def test_bench_only_refuses_an_unknown_row_with_the_valid_names(capsys) -> None:
    from tenplex_jax._src import cli

    assert cli.main(["bench", "--only", "reshard,stal"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown row 'stal'" in err
    assert all(name in err for name in ("reshard", "loop", "stall", "plan", "store", "recovery"))
    assert cli.main(["bench", "--only", "reshard:sp"]) == 2
    assert "unknown row 'reshard:sp'" in capsys.readouterr().err
    assert cli.main(["bench", "--only", " , "]) == 2
    assert "no row named" in capsys.readouterr().err
    assert cli.main(["bench", "--only", "recovery", "--no-recovery"]) == 2
    assert "--no-recovery" in capsys.readouterr().err


def test_bench_only_picks_rows_and_changes_whatever_quick_says(monkeypatch) -> None:
    """A recovery row named runs with ``--quick`` (which otherwise leaves it out); ``reshard:KIND``
    runs that one change of the matrix."""
    from tenplex_jax._src import cli
    from tenplex_jax_benchmarks import suite

    seen = []
    monkeypatch.setattr(suite, "configure_jax", lambda: "cpu")
    monkeypatch.setattr(suite, "run", seen.append)  # the options the command line builds
    assert cli.main(["bench", "--quick", "--only", "recovery,reshard:mixed"]) == 0
    assert cli.main(["bench", "--quick"]) == 0
    named, default = seen
    assert named.wants("recovery") and named.wants("reshard") and not named.wants("loop")
    assert [c.kind for c in named.changes()] == ["mixed"]
    assert [c.kind for c in reshard.MATRIX] == list(suite.RESHARD_KINDS)  # every change nameable
    assert not default.wants("recovery") and default.wants("loop")
    assert default.changes() == reshard.MATRIX
    full = suite.BenchOptions(only=("reshard", "stall"))
    assert [r for r in suite.ROWS if full.wants(r)] == ["reshard", "stall"]
    assert full.changes() == reshard.MATRIX


def test_the_parameter_server_floors_time_each_crossing_that_hands_over_the_bytes() -> None:
    from tenplex_jax_benchmarks import ps_floor

    # memory_floors raises if a crossing it times copies out other bytes than the piece's
    row = ps_floor.run(megabytes=1, repeats=1, log=lambda *a: None)
    crossings = (
        "loopback TCP socket",
        "read from shared memory",
        "new shared mapping, copied out",
        "kept shared mapping, copied out",
    )
    assert set(row["floors_over_memcpy"]) == {
        f"{op}, {name}" for op in ("push", "pull") for name in crossings
    }
    assert all(s > 0 for s in row["seconds"].values())
