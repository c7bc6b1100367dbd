"""The simulator's fixed costs, measured from this project's executor and tensor store, and checked.

Three parts, in one run:

1. **Measure and fit.** The executor (``tj.reshard`` on the 8 fake CPU devices) runs changes of
   a state of ``leaves`` float32 leaves with the same bytes cut into few large or many small
   pieces; each time is fitted (least squares) as ``k * bytes_seconds + pieces * piece_seconds
   (+ leaves * leaf_seconds)``, where ``bytes_seconds`` is the network model's own prediction
   from the measured memcpy (``simulate_validation.cpu_network``), so ``k`` says how far the
   bytes term is off and the rest is what it leaves out. A tensor store process on 127.0.0.1
   serves the same bytes as few large or many small objects (``get``, and ``put`` with the disk
   writer idle); ``seconds = bytes / bandwidth + requests * latency_seconds``.
2. **This machine.** The reshard matrix (``benchmarks/reshard.py``'s ``MATRIX``) timed with
   ``tj.reshard`` and predicted three ways: bytes only (``simulate_validation``), the library's
   ``Network(piece_seconds=...)`` (a per-device piece cost that overlaps the bytes), and the
   prototype of an additive per-process term (``pieces * piece_seconds + leaves *
   leaf_seconds`` added to the bytes' time: one process does the host work of every piece).
3. **The Tenplex testbed.** ``fixed_change`` for GPT-3 1.3B / 2.7B / 6.7B, (4,2,1) -> (4,2,2) on
   ``meshes/tenplex-16.toml``, tenplex and central, with the testbed assumptions of
   :data:`TESTBED` and the fitted per-request and per-piece costs, against the paper's seconds;
   and a node failure of the (4,2,2) job against the paper's recovery range.

    python -m tenplex_jax_benchmarks.simulate_calibration [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

# the Tenplex paper's reconfiguration rows (seconds), 4 nodes x 4 GPUs, (4,2,1) -> (4,2,2)
PAPER = {
    "gpt3-1.3b": {"tenplex": 8.5, "central": 27.2},
    "gpt3-2.7b": {"tenplex": 11.5, "central": 39.0},
    "gpt3-6.7b": {"tenplex": 24.2, "central": 96.1},
}
PAPER_RECOVERY = (19.6, 23.5)

# assumptions about the paper's testbed, beyond meshes/tenplex-16.toml (NIC 100 Gb/s per node,
# PCIe Gen4 25 GB/s to the host, 20 GB/s peer to peer, host memory 100 GB/s): seconds that the
# network model does not derive. None of them is fitted to the paper's rows.
TESTBED = {
    # PyTorch + NCCL workers re-launched on 16 GPUs: process start, CUDA context, NCCL
    # communicators, model construction (this project's own local launcher restarts 3 CPU
    # processes in 1.6 s; GPU runtime and communicator start-up add a few seconds)
    "restart_seconds": 5.0,
    # the change is announced (a scale-out); a failure: PyTorch has no step to compile
    "compile_seconds": 0.0,
    # a store process per node serves at the rate measured here on one core (the testbed's
    # store is one process per node too), in place of the toml's 100 GB/s host memory
    "store_bandwidth_from": "store get, fitted",
}

FIXED_CHANGES = (  # (name, source config, target config, device counts) of the executor fit
    ("move fsdp4 0..3 -> 4..7", dict(fsdp=4), range(4), dict(fsdp=4), range(4, 8)),
    ("shrink fsdp8 -> fsdp3", dict(fsdp=8), range(8), dict(fsdp=3), range(3)),
    ("grow fsdp2 -> fsdp8", dict(fsdp=2), range(2), dict(fsdp=8), range(8)),
)
RULES = (("rows", "fsdp"), ("cols", "tensor"))


def _median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - tic)
    return statistics.median(runs[1:]), runs[1:]


def _lstsq(rows: list[dict], columns: tuple[str, ...], target: str) -> dict[str, float]:
    a = np.array([[r[c] for c in columns] for r in rows], dtype=float)
    b = np.array([r[target] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    fitted = a @ coef
    worst = float(np.max(np.maximum(b / fitted, fitted / b)))
    return dict(zip(columns, map(float, coef))) | {"worst_ratio": worst}


def measure_executor(network, repeats: int, log=print) -> list[dict]:
    """``tj.reshard`` of synthetic states: the same bytes as 8, 64 or 512 leaves, per change."""
    import flax.linen as nn
    import jax

    import tenplex_jax as tj
    from tenplex_jax.simulator import device_traffic

    rows = []
    for total in (48 << 20, 192 << 20):
        for leaves in (8, 64, 512):
            n = total // leaves // 4096
            n -= n % 24  # divisible by every fsdp size used
            state = {
                f"w{i:04d}": nn.LogicallyPartitioned(
                    np.ones((n, 1024), np.float32), names=("rows", "cols")
                )
                for i in range(leaves)
            }
            for name, src_cfg, src_ids, dst_cfg, dst_ids in FIXED_CHANGES:
                src = tj.PTC.of(state, RULES, tj.ParallelConfig(**src_cfg), src_ids)
                dst = tj.allocate(src, src.relayout(tj.ParallelConfig(**dst_cfg), dst_ids))
                plan = tj.make_plan(src, dst)
                placed = tj.place(state, src)
                jax.block_until_ready(placed)

                def once(placed=placed, plan=plan):
                    out, _ = tj.reshard(placed, plan, donate=False)
                    jax.block_until_ready(out)

                measured, runs = _median_seconds(once, repeats)
                del placed
                traffic = device_traffic(plan, network)
                rows.append(
                    {
                        "change": name,
                        "bytes": int(n * 1024 * 4 * leaves),
                        "leaves": _moved_leaves(plan),
                        "pieces": int(traffic.pieces.sum()),
                        "pieces_max_device": int(traffic.pieces.max()),
                        "bytes_seconds": network.seconds(traffic).seconds,
                        "measured_seconds": measured,
                        "runs_seconds": runs,
                    }
                )
                r = rows[-1]
                log(
                    f"  executor {name:24s} {r['bytes'] >> 20:4d} MiB {leaves:4d} leaves "
                    f"{r['pieces']:5d} pieces: {measured * 1e3:7.1f} ms (bytes alone "
                    f"{r['bytes_seconds'] * 1e3:6.1f} ms)"
                )
    return rows


def _moved_leaves(plan) -> int:
    """Leaves with a shard that is not kept (a new array built, an old one freed)."""
    return sum(any(s.kind != "keep" for s in leaf.shards) for leaf in plan.leaves)


def measure_store(repeats: int, log=print) -> list[dict]:
    """One client and one store process on 127.0.0.1: ``count`` objects of the same bytes, put
    (the disk writer idle before each round, as ``benchmarks/store.py`` times a put) and got."""
    from tenplex_jax.multihost import store

    rows = []
    with tempfile.TemporaryDirectory(prefix="tenplex-calibration-") as root:
        proc = store.StoreProcess.start(f"{root}/s", memory_bytes=1 << 30)
        try:
            with store.StoreClient(proc.address) as client:
                for total in (16 << 20, 64 << 20):
                    for count in (4, 64, 512):
                        arrays = [
                            np.full((total // count // 4,), i, np.float32) for i in range(count)
                        ]

                        def put(arrays=arrays):
                            for i, a in enumerate(arrays):
                                client.put(f"c/{i}", a)

                        def get(count=count):
                            for i in range(count):
                                client.get(f"c/{i}")

                        puts = []
                        for _ in range(repeats + 1):
                            client.flush()
                            tic = time.perf_counter()
                            put()
                            puts.append(time.perf_counter() - tic)
                        client.flush()
                        got, get_runs = _median_seconds(get, repeats)
                        client.delete("c/")
                        for op, seconds, runs in (
                            ("put", statistics.median(puts[1:]), puts[1:]),
                            ("get", got, get_runs),
                        ):
                            rows.append(
                                {
                                    "op": op,
                                    "bytes": total,
                                    "requests": count,
                                    "measured_seconds": seconds,
                                    "runs_seconds": runs,
                                }
                            )
                            log(
                                f"  store {op} {total >> 20:3d} MiB as {count:4d} objects: "
                                f"{seconds * 1e3:7.1f} ms"
                            )
        finally:
            proc.stop()
    return rows


def fit(executor: list[dict], stored: list[dict]) -> dict:
    """Least-squares fits of the fixed costs (see the module docstring)."""
    out = {
        "executor_pieces": _lstsq(executor, ("bytes_seconds", "pieces"), "measured_seconds"),
        "executor_pieces_leaves": _lstsq(
            executor, ("bytes_seconds", "pieces", "leaves"), "measured_seconds"
        ),
    }
    for op in ("get", "put"):
        rows = [r for r in stored if r["op"] == op]
        f = _lstsq(rows, ("bytes", "requests"), "measured_seconds")
        out[f"store_{op}"] = {
            "bandwidth_bytes_per_s": 1 / f["bytes"],
            "latency_seconds": f["requests"],
            "worst_ratio": f["worst_ratio"],
        }
    return out


def validate_machine(network, fitted: dict, model: str, repeats: int, log=print) -> list[dict]:
    """The reshard matrix timed and predicted: bytes only, the library's overlapping piece cost,
    and the prototype's additive per-process piece and leaf costs."""
    import jax

    import tenplex_jax as tj
    from tenplex_jax.simulator import Network, device_traffic
    from tenplex_jax_benchmarks.reshard import MATRIX
    from tenplex_jax_models import LOGICAL_RULES, build_state

    two = fitted["executor_pieces"]
    three = fitted["executor_pieces_leaves"]
    library = Network(network.cluster, piece_seconds=max(two["pieces"], 0.0))
    _, state, _ = build_state(model, lr=1e-3)
    rows = []
    for change in MATRIX:
        src = tj.PTC.of(state, LOGICAL_RULES, change.src, change.src_devices, allow_replicate=True)
        dst = tj.allocate(src, src.relayout(change.dst, change.dst_devices))
        plan = tj.make_plan(src, dst)
        placed = tj.place(state, src)
        jax.block_until_ready(placed)

        def once(placed=placed, plan=plan):
            out, _ = tj.reshard(placed, plan, donate=False)
            jax.block_until_ready(out)

        measured, runs = _median_seconds(once, repeats)
        del placed
        traffic = device_traffic(plan, network)
        bytes_s = network.seconds(traffic).seconds
        pieces, leaves = int(traffic.pieces.sum()), _moved_leaves(plan)
        predicted = {
            "bytes_only": bytes_s,
            "library_piece_seconds": library.seconds(device_traffic(plan, library)).seconds,
            "additive_pieces": bytes_s + pieces * two["pieces"],
            "additive_pieces_leaves": bytes_s + pieces * three["pieces"] + leaves * three["leaves"],
        }
        rows.append(
            {
                "change": change.name,
                "bytes_moved": plan.bytes_moved,
                "pieces": pieces,
                "leaves": leaves,
                "measured_seconds": measured,
                "runs_seconds": runs,
                "predicted_seconds": predicted,
                "ratio": {k: measured / v for k, v in predicted.items()},
            }
        )
        log(
            f"  {change.name:36s} measured {measured * 1e3:7.1f} ms; measured/predicted "
            + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1]["ratio"].items())
        )
    return rows


def validate_paper(fitted: dict, piece_seconds: float, log=print) -> dict:
    """``fixed_change`` for the paper's three models on the testbed: tenplex and central, and a
    node failure of the (4,2,2) job, against the paper's seconds."""
    from tenplex_jax._src.cli.simulate import DEFAULT_BATCH
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.ptc import ParallelConfig
    from tenplex_jax._src.simulator.costs import Costs
    from tenplex_jax._src.simulator.fixed import fixed_change
    from tenplex_jax._src.simulator.replay import Simulation
    from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of

    get = fitted["store_get"]
    latency = statistics.fmean([get["latency_seconds"], fitted["store_put"]["latency_seconds"]])
    base = Cluster.load(pathlib.Path(__file__).resolve().parent.parent / "meshes/tenplex-16.toml")
    clusters = {
        "toml host memory": base,
        "store-bound": dataclasses.replace(
            base, host_memory_bandwidth=get["bandwidth_bytes_per_s"]
        ),
    }
    variants = {
        "bytes only (no fixed costs)": (clusters["toml host memory"], 0.0, 0.0, 0.0),
        "fixed costs, toml host memory": (
            clusters["toml host memory"],
            TESTBED["restart_seconds"],
            latency,
            piece_seconds,
        ),
        "fixed costs, store-bound host": (
            clusters["store-bound"],
            TESTBED["restart_seconds"],
            latency,
            piece_seconds,
        ),
    }
    c = ParallelConfig
    rows = []
    for variant, (cluster, restart, lat, piece) in variants.items():
        costs = Costs(
            restart_seconds=restart,
            compile_seconds=TESTBED["compile_seconds"],
            latency_seconds=lat,
            piece_seconds=piece,
            executable_cache=True,
        )
        for model in PAPER:
            state = build_state(model, lr=1e-3, abstract=True)[1]
            sim = Simulation(
                cluster, profile_of(model), state, LOGICAL_RULES, DEFAULT_BATCH[model], costs
            )
            change = fixed_change(sim, c(tensor=4, pipe=2), c(tensor=4, pipe=2, data=2))
            fail = fixed_change(
                sim, c(tensor=4, pipe=2, data=2), c(tensor=4, pipe=2), "fail", failed_nodes={3}
            )
            row = {"variant": variant, "model": model, "state_bytes": change["state_bytes"]}
            for policy in ("tenplex", "central"):
                p = change["policies"][policy]
                row[policy] = {
                    k: p[k]
                    for k in ("seconds", "commit", "transfer", "latency", "restart", "bottleneck")
                }
                row[policy]["paper"] = PAPER[model][policy]
                row[policy]["ratio"] = PAPER[model][policy] / p["seconds"]
            f = fail["policies"]["tenplex"]
            row["recovery"] = {
                k: f[k] for k in ("seconds", "transfer", "latency", "restart", "fallback")
            }
            rows.append(row)
            log(
                f"  {variant:30s} {model:10s} tenplex {row['tenplex']['seconds']:6.2f} s "
                f"(paper/pred {row['tenplex']['ratio']:.2f}), central "
                f"{row['central']['seconds']:6.2f} s ({row['central']['ratio']:.2f}), "
                f"recovery {row['recovery']['seconds']:6.2f} s"
            )
    growth = {}
    for variant in variants:
        by = {r["model"]: r for r in rows if r["variant"] == variant}
        growth[variant] = {
            p: by["gpt3-6.7b"][p]["seconds"] / by["gpt3-1.3b"][p]["seconds"]
            for p in ("tenplex", "central")
        }
    growth["paper"] = {
        p: PAPER["gpt3-6.7b"][p] / PAPER["gpt3-1.3b"][p] for p in ("tenplex", "central")
    }
    return {
        "latency_seconds": latency,
        "piece_seconds": piece_seconds,
        "store_bandwidth_bytes_per_s": get["bandwidth_bytes_per_s"],
        "testbed": TESTBED,
        "rows": rows,
        "growth_6.7b_over_1.3b": growth,
    }


def run(model: str = "gpt100m", repeats: int = 3, log=print) -> dict:
    from tenplex_jax_benchmarks.simulate_validation import cpu_network, memcpy_fresh

    cores = os.cpu_count() or 1
    nbytes = 256 << 20
    single, aggregate = memcpy_fresh(nbytes, repeats), memcpy_fresh(nbytes, repeats, cores)
    network = cpu_network(single, aggregate)
    log(f"memcpy into fresh pages: {single / 1e9:.2f} GB/s, {aggregate / 1e9:.2f} on {cores}")
    executor = measure_executor(network, repeats, log)
    stored = measure_store(repeats, log)
    fitted = fit(executor, stored)
    log(f"fitted: {json.dumps(fitted)}")
    machine = validate_machine(network, fitted, model, repeats, log)
    paper = validate_paper(fitted, max(fitted["executor_pieces"]["pieces"], 0.0), log)
    return {
        "kind": "simulate_calibration",
        "model": model,
        "repeats": repeats,
        "cores": cores,
        "memcpy_fresh_single_bytes_per_s": single,
        "memcpy_fresh_aggregate_bytes_per_s": aggregate,
        "executor_points": executor,
        "store_points": stored,
        "fitted": fitted,
        "machine": machine,
        "paper": paper,
        "load_average": os.getloadavg(),
    }


def markdown(result: dict) -> str:
    f = result["fitted"]
    two, three = f["executor_pieces"], f["executor_pieces_leaves"]
    lines = [
        "# Simulator calibration: fixed per-piece and per-request costs",
        "",
        f"`python -m tenplex_jax_benchmarks.simulate_calibration --repeats {result['repeats']}`"
        f" on {result['cores']} cores (load average at the end "
        f"{', '.join(f'{x:.1f}' for x in result['load_average'])}); memcpy into fresh pages "
        f"{result['memcpy_fresh_single_bytes_per_s'] / 1e9:.2f} GB/s on one thread, "
        f"{result['memcpy_fresh_aggregate_bytes_per_s'] / 1e9:.2f} GB/s on all.",
        "",
        "## Fitted values",
        "",
        "| fit | value | worst point (measured vs fit) |",
        "|---|---|---:|",
        f"| executor: k x bytes_seconds + pieces x piece_seconds | k {two['bytes_seconds']:.2f}, "
        f"piece_seconds {two['pieces'] * 1e6:.1f} us | {two['worst_ratio']:.2f}x |",
        f"| executor: ... + leaves x leaf_seconds | k {three['bytes_seconds']:.2f}, "
        f"piece_seconds {three['pieces'] * 1e6:.1f} us, leaf_seconds {three['leaves'] * 1e6:.0f}"
        f" us | {three['worst_ratio']:.2f}x |",
    ]
    for op in ("get", "put"):
        s = f[f"store_{op}"]
        lines.append(
            f"| store {op}: bytes / bandwidth + requests x latency | "
            f"{s['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, latency_seconds "
            f"{s['latency_seconds'] * 1e6:.0f} us | {s['worst_ratio']:.2f}x |"
        )
    lines += [
        "",
        f"## This machine: the reshard matrix ({result['model']}), measured / predicted",
        "",
        "| change | pieces | leaves | measured ms | bytes only | library piece cost | "
        "+ pieces | + pieces + leaves |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["machine"]:
        q = r["ratio"]
        lines.append(
            f"| {r['change']} | {r['pieces']} | {r['leaves']} | "
            f"{r['measured_seconds'] * 1e3:.1f} | {q['bytes_only']:.2f} | "
            f"{q['library_piece_seconds']:.2f} | {q['additive_pieces']:.2f} | "
            f"{q['additive_pieces_leaves']:.2f} |"
        )
    p = result["paper"]
    lines += [
        "",
        "## The Tenplex testbed: GPT-3, (4,2,1) -> (4,2,2) on 4 nodes x 4 GPUs, paper / predicted",
        "",
        "| variant | model | state GB | tenplex s (paper) | paper ÷ pred | central s (paper) | "
        "paper ÷ pred | recovery s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        t, c = r["tenplex"], r["central"]
        lines.append(
            f"| {r['variant']} | {r['model']} | {r['state_bytes'] / 1e9:.1f} | "
            f"{t['seconds']:.2f} ({t['paper']}) | {t['ratio']:.2f} | {c['seconds']:.2f} "
            f"({c['paper']}) | {c['ratio']:.2f} | {r['recovery']['seconds']:.2f} |"
        )
    lines += ["", "Growth 1.3B -> 6.7B (6.7B's seconds ÷ 1.3B's):", ""]
    for variant, g in p["growth_6.7b_over_1.3b"].items():
        lines.append(f"- {variant}: tenplex {g['tenplex']:.2f}x, central {g['central']:.2f}x")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    result = run(args.model, args.repeats)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "calibration.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "calibration.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
