"""How long the planner takes as the device count grows, for one and two device types.

The planner must answer for 4096 devices in under a second. Times are medians of ``--repeats`` calls
of ``tj.planner.choose`` for the gpt100m profile, global batch twice the device count, objective
time; each
row also shows how many layouts were evaluated and the choice.

    python benchmarks/planner_scale.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import tenplex_jax as tj
from tenplex_jax_models import GPTConfig, profile

H100 = tj.planner.DeviceType("h100", 80 * 2**30, 400e12, 450e9, 4.0)
A100 = tj.planner.DeviceType("a100", 40 * 2**30, 150e12, 300e9, 1.8)


def mixed(n: int) -> tj.planner.Cluster:
    """Half H100 nodes, half A100 nodes, 8 devices a node."""
    kinds = tuple(0 if i < n // 2 else 1 for i in range(n))
    return tj.planner.Cluster(
        f"{n} mixed", (H100, A100), kinds, tuple(i // 8 for i in range(n)), 25e9
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = profile(GPTConfig.gpt100m())
    print(
        "| cluster | devices | layouts evaluated | planner ms | choice |\n|---|---:|---:|---:|---|"
    )
    for n in (8, 64, 512, 4096):
        for cluster in (tj.planner.Cluster.uniform(n, H100), mixed(n)):
            times = []
            for _ in range(args.repeats):
                tic = time.perf_counter()
                choice = tj.planner.choose(cluster, model, 2 * n)
                times.append(time.perf_counter() - tic)
            print(
                f"| {cluster.name} | {n} | {choice.evaluated} | "
                f"{1e3 * statistics.median(times):.0f} | {choice.best.label()} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
