"""The simulator against the Tenplex paper, like for like: every row of its reconfiguration and
failure-recovery figures, paper ÷ predicted.

**The window.** The artifact times "State transformation took" in ``tenplex-run``'s
``repartition()``: after the save into the tensor stores, before the workers restart. The
prediction is ``tj.simulator.transformation`` (that span on the artifact's route: gets from the
stores, sends, puts into the target nodes' stores); the save, the restart and a failure's
detection are outside it and not compared (the artifact emulates a failure by deleting the
failed workers' saved copies at a scheduled step: it detects nothing).

**The constants.** The hardware is ``meshes/tenplex-16.toml`` (4 nodes × 4 GPUs, one 100 Gb/s
NIC per node, 100 GB/s host memory, PCIe Gen4): stated before any comparison, none fitted. The
artifact's stores are Go HTTP servers holding tensors in memory, so their rate is software, not
hardware, and its window opens with a fixed start (a transformer process launched over ssh per
target device, the checkpoint's structure read from disk). Those two are fitted, on half of the
rows (:data:`FIT_RULE`), and the other half and the failure figure are the validation. The rate
is in the bytes a store copies (``tj.simulator.transformation``'s rules: a get copies the saved
tensor whole, a tensor-parallel change's part of it once more), and the job is Megatron-LM's:
the embedding on the first pipeline stage, the output layer on the last.

    python -m tenplex_jax_benchmarks.simulate_paper [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import numpy as np

# The paper's numbers, seconds, read from the artifact's plotting scripts (kungfu-team/tenplex):
# Fig. 14 "Reconfiguration time with different parallelizations", GPT-3 on the on-premise
# cluster, (M, P, D) = (tensor, pipe, data) from (4, 2, 1) to D (4, 2, 2), P (4, 4, 1), M (8, 2, 1)
# (benchmark/reconfiguration_parallelization/plot.py); Fig. 11 "Failure recovery time (GPT-3
# 2.7B)", (4, 2, 2) -> (4, 2, 1) with 4, 8 or 12 GPUs' saved state deleted
# (benchmark/failure/plot.py; the figure adds 360 s of re-run to the 12-GPU bar, not measured).
PAPER = {
    "D": {
        "tenplex": {"gpt3-1.3b": 8.5, "gpt3-2.7b": 11.5, "gpt3-6.7b": 24.2},
        "central": {"gpt3-1.3b": 27.2, "gpt3-2.7b": 39.0, "gpt3-6.7b": 96.1},
    },
    "P": {
        "tenplex": {"gpt3-1.3b": 4.6, "gpt3-2.7b": 5.9, "gpt3-6.7b": 10.8},
        "central": {"gpt3-1.3b": 4.6, "gpt3-2.7b": 18.2, "gpt3-6.7b": 38.0},
    },
    "M": {
        "tenplex": {"gpt3-1.3b": 7.4, "gpt3-2.7b": 10.5, "gpt3-6.7b": 20.2},
        "central": {"gpt3-1.3b": 20.4, "gpt3-2.7b": 28.5, "gpt3-6.7b": 74.0},
    },
}
PAPER_FAILURE = {4: 23.5, 8: 19.6, 12: 19.6}  # GPUs failed -> seconds, GPT-3 2.7B
FAILURE_MODEL = "gpt3-2.7b"
FAILURE_REPLICAS = 1  # the artifact's setRedundancy(1) before a failure run; none otherwise

CHANGES = {  # change -> (source, target) as (tensor, pipe, data)
    "D": ((4, 2, 1), (4, 2, 2)),
    "P": ((4, 2, 1), (4, 4, 1)),
    "M": ((4, 2, 1), (8, 2, 1)),
}
FAILURE_CHANGE = ((4, 2, 2), (4, 2, 1))
MODELS = ("gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b")
POLICIES = ("tenplex", "central")
TESTBED_TOML = "meshes/tenplex-16.toml"
BATCH = 128  # the artifact's -batch-sizes 128
FIT_RULE = (
    "a reconfiguration row is fitted when (change index + model index + policy index) is even, "
    "changes D, P, M, models 1.3B, 2.7B, 6.7B, policies tenplex, central: 9 rows fitted, 9 "
    "validated, and the 3 failure rows validated"
)
OUTSIDE = {  # reported apart, never inside the compared window
    "restart_seconds": 5.0,
    "restart_why": "the workers restarted after the window (this project's issue-31 assumption "
    "for PyTorch + NCCL on 16 GPUs; the artifact does not report it)",
    "detect_seconds": 0.0,
    "detect_why": "the artifact deletes the failed workers' saved copies at a scheduled step: "
    "nothing is detected",
}


def _config(t: tuple[int, int, int]):
    import tenplex_jax as tj

    tensor, pipe, data = t
    return tj.ParallelConfig(tensor=tensor, pipe=pipe, data=data)


def fitted(key: tuple[str, str, str]) -> bool:
    """Whether a reconfiguration row (change, model, policy) is in the fitting half."""
    change, model, policy = key
    return (list(CHANGES).index(change) + MODELS.index(model) + POLICIES.index(policy)) % 2 == 0


def windows(store_bandwidth: float | None, start_seconds: float) -> list[dict]:
    """Every row's :class:`tj.simulator.Window` on the testbed, each node's store moving
    ``store_bandwidth`` bytes/s of gets and puts (None: no limit, the hardware alone)."""
    import tenplex_jax as tj
    from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of

    cluster = tj.planner.Cluster.load(pathlib.Path(__file__).resolve().parents[1] / TESTBED_TOML)
    costs = tj.simulator.Costs(
        store_get_bandwidth=store_bandwidth, store_put_bandwidth=store_bandwidth
    )
    rows = []
    for model in MODELS:
        state = build_state(model, lr=1e-3, abstract=True)[1]
        sim = tj.simulator.Simulation(
            cluster, profile_of(model), state, LOGICAL_RULES, BATCH, costs
        )
        for change, (src, dst) in CHANGES.items():
            for policy in POLICIES:
                w = tj.simulator.transformation(
                    sim,
                    _config(src),
                    _config(dst),
                    central=policy == "central",
                    start_seconds=start_seconds,
                )
                paper = PAPER[change][policy][model]
                rows.append(
                    _row(f"{change} {policy}", model, w, paper, fitted((change, model, policy)))
                )
        if model == FAILURE_MODEL:
            src, dst = FAILURE_CHANGE
            for failed, paper in PAPER_FAILURE.items():
                w = tj.simulator.transformation(
                    sim,
                    _config(src),
                    _config(dst),
                    failed_devices=failed,
                    replicas=FAILURE_REPLICAS,
                    start_seconds=start_seconds,
                )
                rows.append(_row(f"failure {failed} GPUs", model, w, paper, False))
    return rows


def _row(name: str, model: str, w, paper: float, fit: bool) -> dict:
    return {
        "row": name,
        "model": model,
        "fitted": fit,
        "paper": paper,
        "predicted": w.seconds,
        "start": w.start,
        "transfer": w.transfer,
        "bottleneck": w.bottleneck,
        "state_bytes": w.state_bytes,
        "store_bytes_max": max(w.store_bytes),
        "network_bytes": w.network_bytes,
        "paper_over_predicted": paper / w.seconds,
        "within_2x": 0.5 <= paper / w.seconds <= 2.0,
    }


def fit(hardware: list[dict]) -> dict:
    """The start and the store rate that minimise the squared log ratios of the fitting rows:
    each row's window is ``start + max(hardware transfer, busiest store's bytes / rate)``."""
    rows = [r for r in hardware if r["fitted"]]
    paper = np.array([r["paper"] for r in rows])
    hw = np.array([r["transfer"] for r in rows])
    store = np.array([r["store_bytes_max"] for r in rows])
    rates = np.geomspace(0.2e9, 50e9, 801)[:, None, None]  # bytes/s
    starts = np.linspace(0.0, 10.0, 1001)[None, :, None]  # seconds
    predicted = starts + np.maximum(hw, store / rates)
    loss = (np.log(paper / predicted) ** 2).sum(-1)
    i, j = np.unravel_index(np.argmin(loss), loss.shape)
    return {
        "store_bandwidth": float(rates[i, 0, 0]),
        "start_seconds": float(starts[0, j, 0]),
        "rms_log_ratio": float(math.sqrt(loss[i, j] / len(rows))),
        "rows": len(rows),
    }


def run(log=print) -> dict:
    hardware = windows(None, 0.0)
    constants = fit(hardware)
    log(
        f"fitted on {constants['rows']} rows: store {constants['store_bandwidth'] / 1e9:.2f} GB/s "
        f"a node, start {constants['start_seconds']:.2f} s"
    )
    rows = windows(constants["store_bandwidth"], constants["start_seconds"])
    for r, h in zip(rows, hardware):
        r["hardware_only"] = h["predicted"]
        r["hardware_only_ratio"] = h["paper_over_predicted"]
        log(
            f"  {r['row']:22s} {r['model']:10s} paper {r['paper']:5.1f} s predicted "
            f"{r['predicted']:6.2f} s ratio {r['paper_over_predicted']:5.2f} "
            f"{'fit' if r['fitted'] else 'validation'}"
        )
    validated = [r for r in rows if not r["fitted"]]
    return {
        "kind": "simulate_paper",
        "testbed": TESTBED_TOML,
        "fit_rule": FIT_RULE,
        "constants": constants,
        "outside_the_window": OUTSIDE,
        "rows": rows,
        "within_2x": {
            "all": sum(r["within_2x"] for r in rows),
            "validation": sum(r["within_2x"] for r in validated),
            "rows": len(rows),
            "validation_rows": len(validated),
        },
    }


def markdown(result: dict) -> str:
    """The table: every row, paper ÷ predicted, fitted or validated, within 2× or not."""
    c, w = result["constants"], result["within_2x"]
    lines = [
        "# The simulator against the Tenplex paper, like for like (issue 51)",
        "",
        "`python -m tenplex_jax_benchmarks.simulate_paper`: the artifact's window (after the "
        "save, before the restart) on `" + result["testbed"] + "`, Megatron-LM's pipeline edges. "
        f"Fitted: each node's store copies {c['store_bandwidth'] / 1e9:.2f} GB/s for its gets and "
        "puts (a get copies the saved tensor whole, then what it serves), and the window starts "
        f"with {c['start_seconds']:.2f} s ({result['fit_rule']}). Outside the window, not "
        f"compared: restart {result['outside_the_window']['restart_seconds']:g} s, detection "
        f"{result['outside_the_window']['detect_seconds']:g} s.",
        "",
        f"Within 2×: {w['all']} of {w['rows']} rows; {w['validation']} of "
        f"{w['validation_rows']} validation rows.",
        "",
        "| row | model | paper s | predicted s (start + transfer) | paper ÷ predicted | within 2× "
        "| half | bottleneck | hardware alone: predicted s, ratio |",
        "|---|---|---:|---:|---:|---|---|---|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['row']} | {r['model']} | {r['paper']:g} | {r['predicted']:.2f} "
            f"({r['start']:.2f} + {r['transfer']:.2f}) | {r['paper_over_predicted']:.2f} | "
            f"{'yes' if r['within_2x'] else '**no**'} | "
            f"{'fit' if r['fitted'] else 'validation'} | {r['bottleneck']} | "
            f"{r['hardware_only']:.2f}, {r['hardware_only_ratio']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    result = run()
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paper.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "paper.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
