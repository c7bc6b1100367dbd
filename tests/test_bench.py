"""``tenplex-jax bench --quick`` completes and computes every row and ratio (never a timing)."""

from __future__ import annotations

import json
import math

from tenplex_jax_benchmarks import reshard
from tenplex_jax_benchmarks.suite import GOALS
from tenplex_jax._cli import main


def test_quick_bench_writes_every_row_and_finite_ratios(tmp_path) -> None:
    # in-process: conftest's 8 fake CPU devices are what the suite configures anyway
    # the recovery row launches multi-process jobs (a minute); tests/test_launch.py covers them
    assert (
        main(["bench", "--quick", "--repeats", "1", "--no-recovery", "--out", str(tmp_path)]) == 0
    )
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["rows"]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("memcpy") == 1 and kinds.count("loop") == 1
    assert kinds.count("compile_ahead") == 1
    changes = [r["change"] for r in rows if r["kind"] == "reshard"]
    assert changes == [c.name for c in reshard.MATRIX]
    assert {(r["devices"], r["tensors"]) for r in rows if r["kind"] == "plan"} == {
        (8, 10), (8, 100), (64, 10), (64, 100)
    }  # fmt: skip
    for row in rows:
        if row["kind"] != "reshard":
            continue
        assert set(row["median_seconds"]) == set(reshard.STRATEGIES), row["change"]
        ratios = [*row["speedup"].values(), row["bandwidth_ratio"], row["central_over_min"]]
        ratios += [row["peak_ratio"], row["state_peak_ratio"]]
        assert all(math.isfinite(x) and x > 0 for x in ratios), row
        # the executor copies exactly the plan's minimum, and the plan's minimum is a minimum
        assert row["min_bytes"] > 0 and row["copied_bytes"] == row["min_bytes"]
        assert row["bytes_ratio"] == 1.0 and row["central_bytes"] >= row["min_bytes"]
        assert row["peak_bytes"] >= max(row["steady_before_bytes"], row["steady_after_bytes"])
    loop = next(r for r in rows if r["kind"] == "loop")
    assert math.isfinite(loop["overhead"]) and loop["steps_each"] > 0
    stall = next(r for r in rows if r["kind"] == "compile_ahead")
    assert stall["runs"]["compile_ahead"][0]["compile"] == "cached"  # ready before the notice
    assert stall["runs"]["on_demand"][0]["compile"] == "compiled"
    assert math.isfinite(stall["stall_ratio"]) and stall["stall_ratio"] > 0
    store = next(r for r in rows if r["kind"] == "store")
    assert kinds.count("store") == 1 and store["bytes"] > 0
    assert all(math.isfinite(x) and x > 0 for x in store["vs_memcpy"].values())
    assert set(results["verdicts"]) == set(GOALS)
    assert all(math.isfinite(v["measured"]) for v in results["verdicts"].values())
    for name in ("reshard.png", "plan_scaling.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| goal |" in (tmp_path / "summary.md").read_text()


def test_central_strategy_moves_at_least_the_plan_minimum() -> None:
    import tenplex_jax as tj
    from tests.helpers import RULES, abstract_state

    state = abstract_state()
    C = tj.ParallelConfig
    for src_cfg, dst_cfg, dst_ids in [
        (C(data=2, tensor=4), C(data=3, tensor=2), range(2, 8)),
        (C(fsdp=4), C(fsdp=4), range(4, 8)),
    ]:
        src = tj.PTC.of(state, RULES, src_cfg, range(src_cfg.num_devices))
        dst = tj.allocate(src, tj.PTC.of(state, RULES, dst_cfg, dst_ids))
        central = reshard.central_bytes(src, dst)
        assert central >= tj.make_plan(src, dst).bytes_moved
    # one device to another: the centre is either end, and it moves the state once, as the plan does
    src = tj.PTC.of(state, RULES, C(), [0])
    dst = tj.PTC.of(state, RULES, C(), [1])
    assert reshard.central_bytes(src, dst) == src.nbytes == tj.make_plan(src, dst).bytes_moved
    # an identity change moves nothing, while gathering to one device still moves the state
    src = tj.PTC.of(state, RULES, C(fsdp=4), range(4))
    assert tj.make_plan(src, src).bytes_moved == 0 < reshard.central_bytes(src, src)
