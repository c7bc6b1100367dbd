"""The simulator's network model against this machine: predicted vs measured reshard times.

The network model (``tenplex_jax.simulator.network``) is given one number measured here, a memcpy
into fresh pages (what a reshard writes), single-threaded (a device's link and its on-device copy)
and with one thread per core (the host memory all fake CPU devices share). It then predicts, from
each plan alone (``device_traffic``: local copies, sends between devices), the seconds of every row
of the reshard matrix of ``tenplex-jax bench`` (``benchmarks/reshard.py``'s ``MATRIX``), which this
script times with ``tj.reshard`` in the same run (medians of ``--repeats`` after a warm-up).

    python -m tenplex_jax_benchmarks.simulate_validation [--model gpt100m] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import statistics
import time

import numpy as np


def memcpy_fresh(nbytes: int, repeats: int, threads: int = 1) -> float:
    """Bytes/s of ``threads`` concurrent ``np.copyto``s into fresh buffers, ``nbytes`` in all."""
    part = nbytes // threads // 4
    sources = [np.ones(part, dtype=np.float32) for _ in range(threads)]
    runs = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats + 1):
            targets = [np.empty_like(s) for s in sources]
            tic = time.perf_counter()
            list(pool.map(lambda st: np.copyto(st[1], st[0]), zip(sources, targets)))
            runs.append(time.perf_counter() - tic)
    return part * 4 * threads / statistics.median(runs[1:])


def cpu_network(single: float, aggregate: float, devices: int = 8):
    """One host of ``devices`` fake CPU devices: each copies at ``single`` bytes/s, all together at
    ``aggregate`` (their memory is the host's)."""
    from tenplex_jax.planner import GIB, Cluster, DeviceType
    from tenplex_jax.simulator import Network

    cpu = DeviceType(
        "cpu",
        memory=2 * GIB,
        flops=5e9,
        link_bandwidth=single,
        memory_bandwidth=single,
        host_bandwidth=single,
        host_memory=True,
    )
    cluster = Cluster(
        "this machine",
        (cpu,),
        (0,) * devices,
        (0,) * devices,
        single,
        host_memory_bandwidth=aggregate,
    )
    return Network(cluster)


def run(model: str = "gpt100m", repeats: int = 5, log=print) -> dict:
    import jax

    import tenplex_jax as tj
    from tenplex_jax.simulator import device_traffic
    from tenplex_jax_benchmarks.reshard import MATRIX
    from tenplex_jax_models import LOGICAL_RULES, build_state

    cores = os.cpu_count() or 1
    _, state, _ = build_state(model, lr=1e-3)
    nbytes = min(sum(x.nbytes for x in jax.tree.leaves(state)) // 4, 512 * 2**20)
    single = memcpy_fresh(nbytes, repeats)
    aggregate = memcpy_fresh(nbytes, repeats, threads=cores)
    network = cpu_network(single, aggregate)
    rows = []
    for change in MATRIX:
        src = tj.PTC.of(state, LOGICAL_RULES, change.src, change.src_devices, allow_replicate=True)
        dst = tj.allocate(src, src.relayout(change.dst, change.dst_devices))
        plan = tj.make_plan(src, dst)
        placed = tj.place(state, src)
        jax.block_until_ready(placed)
        runs = []
        for _ in range(repeats + 1):
            tic = time.perf_counter()
            out, _ = tj.reshard(placed, plan, donate=False)
            jax.block_until_ready(out)
            runs.append(time.perf_counter() - tic)
            del out
        del placed
        measured = statistics.median(runs[1:])
        estimate = network.seconds(device_traffic(plan, network))
        rows.append(
            {
                "change": change.name,
                "bytes_moved": plan.bytes_moved,
                "measured_seconds": measured,
                "predicted_seconds": estimate.seconds,
                "bottleneck": estimate.bottleneck,
                "ratio": measured / estimate.seconds if estimate.seconds else math.inf,
                "runs_seconds": runs[1:],
            }
        )
        log(
            f"  {change.name:36s} measured {measured * 1e3:8.1f} ms  predicted "
            f"{estimate.seconds * 1e3:8.1f} ms  measured/predicted {rows[-1]['ratio']:5.2f}  "
            f"({estimate.bottleneck})"
        )
    ratios = [r["ratio"] for r in rows]
    return {
        "kind": "simulate_validation",
        "model": model,
        "repeats": repeats,
        "cores": cores,
        "memcpy_fresh_single_bytes_per_s": single,
        "memcpy_fresh_aggregate_bytes_per_s": aggregate,
        "rows": rows,
        "ratio_geomean": math.exp(statistics.fmean(map(math.log, ratios))),
        "within_2x": sum(0.5 <= r <= 2 for r in ratios),
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    result = run(args.model, args.repeats)
    print(
        f"memcpy into fresh pages: {result['memcpy_fresh_single_bytes_per_s'] / 1e9:.2f} GB/s on "
        f"one thread, {result['memcpy_fresh_aggregate_bytes_per_s'] / 1e9:.2f} GB/s on "
        f"{result['cores']}; measured/predicted geometric mean {result['ratio_geomean']:.2f}, "
        f"{result['within_2x']} of {len(result['rows'])} rows within 2x"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "simulate_validation.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
