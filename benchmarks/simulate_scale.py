"""The simulator at scale: goodput and downtime per failure against cluster size, with node
failures at the published rate.

For each cluster size (H100 nodes of 8, ``meshes/h100-4096.toml`` with its node count changed), the
70B-class decoder (``llm-70b``, global batch 1024, as ``tenplex-jax simulate`` has it) trains
through a trace of node failures drawn at MTTF 7.9 hours per 1,024 GPUs, scaling as 1/N (16 times
as often at 16,384 devices as at 1,024), each node repaired (offered back) after 60 minutes, one
fixed seed. Every policy (tenplex, central, checkpoint-restart) runs on the library's default
costs: Young/Daly checkpoints, announced changes compiled ahead, an on-demand compile after every
failure. Per size: each policy's goodput and its mean downtime per failure (from the failure until
training resumes). Everything at 256 devices and beyond is the network model's extrapolation.

    python -m tenplex_jax_benchmarks.simulate_scale [--sizes 256,1024,4096,16384] [--hours 12]
        [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import time
import tomllib

MESHES = pathlib.Path(__file__).resolve().parents[1] / "meshes"
SIZES = (256, 1024, 4096, 16384)
# 12 h: long enough for failures at every size, short enough to run in minutes (RESULTS.md has
# how long each size took)
HOURS = 12.0
MTTF_HOURS, MTTF_DEVICES, REPAIR_MINUTES = 7.9, 1024, 60.0
MODEL, BATCH = "llm-70b", 1024
PUBLISHED = (  # (label, devices, metric, value, source)
    ("TrainMover", 1024, "downtime_seconds", 20.0, "about 20 s of downtime per change"),
    ("FlashRecovery", 4800, "downtime_seconds", 150.0, "about 150 s of recovery per failure"),
    ("ByteRobust", 9600, "goodput", 0.97, "97 % effective training time over three months"),
)
EXTRAPOLATED = (
    "The network model was validated only against this 2-core machine's reshard rows "
    "(`simulate_validation`) and, roughly, the Tenplex paper's 16-GPU rows; every size here "
    "(256 devices and more) is extrapolation. The restart (60 s) and compile (120 s) costs are "
    "assumptions, not measurements, and dominate tenplex's downtime; the storage bandwidth "
    "(10 GB/s per node, 1 TB/s in all) is an assumption of the cluster file. An orbax restore "
    "has every node read each distinct box its devices need from storage, so the storage bytes "
    "grow with the data-parallel degree (no read-once-and-broadcast)."
)


def cluster_of(devices: int):
    """``meshes/h100-4096.toml`` with ``devices // 8`` nodes of 8 H100s."""
    from tenplex_jax.errors import PlanError
    from tenplex_jax.planner import Cluster

    data = tomllib.loads((MESHES / "h100-4096.toml").read_text())
    per_node = data["nodes"][0]["count"]
    if devices < 2 * per_node or devices % per_node:
        raise PlanError(
            f"simulate_scale: a size is a whole number of nodes of {per_node}, at least two "
            f"(a failure never takes the last node), got {devices}"
        )
    data["nodes"][0]["repeat"] = devices // per_node
    data["name"] = f"h100-{devices}"
    return Cluster.from_dict(data)


def downtimes(result, policy: str) -> tuple[list[float], list[float], list[float]]:
    """Per failure: the seconds until ``policy`` trains again, the seconds the failure itself
    was charged, and the training it lost.

    The simulator's clocks queue changes (a change starts when the last one is done), so the
    downtime of a failure that comes during a stall includes the rest of that stall; a failure
    that took only devices the job left idle stops nothing (0 s).
    """
    ready, until, charged, lost = 0.0, [], [], []
    for row in result.events:
        t, cost = row.minute * 60, row.policies[policy]
        ready = max(t, ready) + cost.seconds
        if row.kind != "fail":
            continue
        until.append(0.0 if row.decision == "keep" else ready - t)
        charged.append(cost.seconds)
        lost.append(cost.lost_seconds)
    return until, charged, lost


def run_scale(sizes=SIZES, hours: float = HOURS, seed: int = 0, log=print) -> dict:
    from tenplex_jax.simulator import Costs, Policy, Simulation, failure_trace, simulate
    from tenplex_jax_models import llm

    costs = Costs(young_daly=True, mttf_hours=MTTF_HOURS, mttf_devices=MTTF_DEVICES)
    state = llm.abstract_state()
    rows = []
    for devices in sizes:
        tic = time.perf_counter()
        cluster = cluster_of(devices)
        sim = Simulation(cluster, llm.profile(), state, llm.LLM_RULES, BATCH, costs)
        trace = failure_trace(
            cluster.nodes,
            hours * 60,
            MTTF_HOURS,
            MTTF_DEVICES,
            repair_minutes=REPAIR_MINUTES,
            seed=seed,
        )
        result = simulate(sim, trace, tuple(Policy))
        rows.append(size_row(devices, costs, result))
        rows[-1]["simulate_seconds"] = time.perf_counter() - tic
        log(line(rows[-1]))
    return {
        "kind": "simulate_scale",
        "model": MODEL,
        "global_batch": BATCH,
        "cluster": "meshes/h100-4096.toml, node count changed (8 x H100 per node)",
        "hours": hours,
        "seed": seed,
        "mttf_hours": MTTF_HOURS,
        "mttf_devices": MTTF_DEVICES,
        "repair_minutes": REPAIR_MINUTES,
        "costs": dataclasses.asdict(costs),
        "published": [
            {"system": s, "devices": d, "metric": m, "value": v, "what": w}
            for s, d, m, v, w in PUBLISHED
        ],
        "extrapolated": EXTRAPOLATED,
        "rows": rows,
        "seconds": sum(r["simulate_seconds"] for r in rows),
    }


def size_row(devices: int, costs, result) -> dict:
    """One size's row: the trace's failures and offers, and per policy its goodput and
    downtime per failure (:func:`downtimes`)."""
    fails = [r for r in result.events if r.kind == "fail"]
    row = {
        "devices": devices,
        "nodes": devices // 8,
        "mttf_hours": costs.mttf_seconds(devices) / 3600,
        "failures": len(fails),
        "failures_idle_only": sum(r.decision == "keep" for r in fails),
        "offers": sum(r.kind == "offer" for r in result.events),
        "grows": sum(r.decision == "grow" for r in result.events),
        "initial_config": result.initial_config,
        "state_bytes": result.events[0].state_bytes if result.events else None,
        "checkpoint_minutes": result.checkpoint.minutes,
        "checkpoint": result.checkpoint.note,
        "policies": {},
    }
    for p, summary in result.policies.items():
        until, charged, lost = downtimes(result, p)
        first = next((r.policies[p] for r in fails if r.decision != "keep"), None)
        parts = ("seconds", "restart", "compile", "transfer", "restore", "bottleneck")
        row["policies"][p] = {
            "goodput": summary.goodput,
            "downtime_seconds": statistics.fmean(until) if until else None,
            "charged_seconds": statistics.fmean(charged) if charged else None,
            "lost_seconds_per_failure": statistics.fmean(lost) if lost else None,
            "downtimes_seconds": until,
            "first_failure": {k: getattr(first, k) for k in parts} if first else {},
            "stall_seconds": summary.stall_seconds,
            "lost_seconds": summary.lost_seconds,
            "useful_samples": summary.useful_samples,
        }
    row["assumptions"] = dict(result.assumptions)
    return row


def _pct(x) -> str:
    return f"{x:.1%}" if x is not None else "-"


def _sec(x) -> str:
    return f"{x:.0f}" if x is not None else "no failure"


def line(row: dict) -> str:
    good = " ".join(f"{p} {_pct(v['goodput'])}" for p, v in row["policies"].items())
    down = " ".join(f"{_sec(v['downtime_seconds'])}" for v in row["policies"].values())
    return (
        f"  {row['devices']:6d} devices: {row['failures']:3d} failures, goodput {good}; "
        f"downtime/failure {down} s ({row['simulate_seconds']:.0f} s)"
    )


def markdown(result: dict) -> str:
    """The table, the published regimes beside it, and what is extrapolated."""
    policies = list(result["rows"][0]["policies"]) if result["rows"] else []
    head = (
        "| devices | job MTTF h | failures | layout | checkpoint min | "
        + " | ".join(f"goodput {p}" for p in policies)
        + " | "
        + " | ".join(f"downtime/failure {p} s" for p in policies)
        + " | simulated in s |"
    )
    lines = [
        f"# Goodput against cluster size: {result['model']} (global batch "
        f"{result['global_batch']}), {result['hours']:g} h of node failures",
        "",
        f"Failures at MTTF {result['mttf_hours']} h per {result['mttf_devices']} GPUs, scaling "
        f"as 1/N; a failed node repaired after {result['repair_minutes']:g} min; seed "
        f"{result['seed']}; cluster {result['cluster']}. Downtime per failure: from the failure "
        "until the policy trains again (the simulator queues changes, so a failure during a "
        "stall waits for it); lost work is not in it.",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in result["rows"]:
        cells = [_pct(v["goodput"]) for v in r["policies"].values()]
        cells += [_sec(v["downtime_seconds"]) for v in r["policies"].values()]
        lines.append(
            f"| {r['devices']} | {r['mttf_hours']:.2f} | {r['failures']} | "
            f"`{r['initial_config']}` | {r['checkpoint_minutes']:.1f} | "
            + " | ".join(cells)
            + f" | {r['simulate_seconds']:.0f} |"
        )
    lines += ["", "Published regimes to compare with (beside the nearest simulated size):", ""]
    for p in result["published"]:
        lines.append(f"- {p['system']}: {p['what']} at {p['devices']:,} GPUs; " + _near(result, p))
    quiet = [r["devices"] for r in result["rows"] if not r["failures"]]
    if quiet:
        lines += ["", f"No failure came in {result['hours']:g} h at {quiet} devices (seed "
                  f"{result['seed']}): their goodput is the checkpoints' and commits' cost alone; "
                  "a longer --hours gives them failures."]  # fmt: skip
    lines += ["", "What is extrapolated: " + result["extrapolated"], "", "Charged per policy:", ""]
    if result["rows"]:
        for p, said in result["rows"][-1]["assumptions"].items():
            lines.append(f"- {p}: " + "; ".join(said) + ".")
    lines += ["", f"Simulated in {result['seconds']:.0f} s in all.", ""]
    return "\n".join(lines)


def _near(result: dict, published: dict) -> str:
    """The simulated size nearest a published point (by ratio), and each policy's number."""
    rows = [r for r in result["rows"] if r["failures"] or published["metric"] == "goodput"]
    if not rows:
        return "no simulated size to compare."
    row = min(rows, key=lambda r: abs(math.log(r["devices"] / published["devices"])))
    show = _pct if published["metric"] == "goodput" else (lambda x: f"{_sec(x)} s")
    said = ", ".join(f"{p} {show(v[published['metric']])}" for p, v in row["policies"].items())
    return f"simulated at {row['devices']:,}: {said}."


def plot(result: dict, path: pathlib.Path) -> None:
    """Goodput against devices (log x), and downtime per failure, one line per policy, with the
    published points."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    devices = [r["devices"] for r in result["rows"]]
    for p in result["rows"][0]["policies"]:
        values = [r["policies"][p] for r in result["rows"]]
        left.plot(devices, [v["goodput"] for v in values], "o-", label=p)
        down = [(d, v["downtime_seconds"]) for d, v in zip(devices, values)]
        down = [(d, s) for d, s in down if s is not None]  # a size with no failure has none
        right.plot([d for d, _ in down], [s for _, s in down], "o-", label=p)
    for p in result["published"]:
        axis = left if p["metric"] == "goodput" else right
        axis.plot(p["devices"], p["value"], "k*", markersize=10)
        axis.annotate(p["system"], (p["devices"], p["value"]), textcoords="offset points",
                      xytext=(5, 5), fontsize=8)  # fmt: skip
    left.set(xscale="log", xlabel="devices", ylabel="goodput", ylim=(0, 1.02))
    right.set(xscale="log", yscale="log", xlabel="devices", ylabel="downtime per failure (s)")
    left.set_title(f"{result['model']}, {result['hours']:g} h, MTTF 7.9 h @ 1,024 GPUs", fontsize=9)
    right.set_title("failure to training again (★ published)", fontsize=9)
    ticks = sorted({*devices, *(p["devices"] for p in result["published"])})
    for axis in (left, right):
        axis.set_xticks(ticks, [f"{d:,}" for d in ticks], rotation=45, fontsize=8)
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.grid(True, which="major", alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected devices as 256,1024,..., got {text!r}"
        ) from None
    if not sizes or any(s < 16 or s % 8 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes are whole nodes of 8, at least 16: {text!r}")
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_sizes, default=SIZES, help="default: 256,1024,4096,16384")
    parser.add_argument("--hours", type=float, default=HOURS, help=f"default: {HOURS:g}")
    parser.add_argument("--seed", type=int, default=0, help="the failures' seed (default: 0)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    result = run_scale(args.sizes, args.hours, args.seed)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "scale.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "scale.md").write_text(text)
        plot(result, args.out / "scale.png")
        print(f"wrote {args.out / 'scale.json'}, scale.md and scale.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
