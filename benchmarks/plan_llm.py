"""Plan time for a 70B-class decoder's whole train state, abstract, on 128 device ids.

The state is ``tenplex_jax_models.llm``'s, shaped like Llama 2 70B (69.0B parameters): bf16
params, fp32 AdamW moments (mu, nu) and the step count, about 690 GB, held as ``ShapeDtypeStruct``
leaves in NNX variables that carry logical axis names, so nothing is allocated.

The change is the issue's: from a MaxText-style 5-axis mesh ``(data 2, stage 4, fsdp 4, expert 2,
tensor 2)`` (layers over ``stage``, ``embed`` over ``fsdp`` and ``expert``, heads, MLP and vocab
over ``tensor``) to ``(data 4, fsdp 16, tensor 2)`` with rules of its own axes, on the same 128
device ids (16 hosts of 8). Timed: ``tj.make_plan`` on the given device order and on the order
``tj.allocate`` picks, and ``allocate`` itself (medians of ``--repeats``). Checked: the plan's
bytes equal the minimum any plan must move (every target box less what its own device already
holds), computed here independently of the planner.

    python -m tenplex_jax_benchmarks.plan_llm [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

from jax.sharding import AbstractMesh

import tenplex_jax as tj
from tenplex_jax_models.llm import abstract_state, params

SOURCE = {"data": 2, "stage": 4, "fsdp": 4, "expert": 2, "tensor": 2}
TARGET = {"data": 4, "fsdp": 16, "tensor": 2}
SOURCE_RULES = (
    ("layers", "stage"),
    ("embed", ("fsdp", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)
TARGET_RULES = (
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)
HOST_DEVICES = 8


def ptcs() -> tuple[tj.PTC, tj.PTC]:
    """(source, target) PTCs over abstract meshes on device ids 0..127, 8 per host."""
    ids = range(math.prod(SOURCE.values()))
    hosts = [i // HOST_DEVICES for i in ids]
    mesh = lambda sizes: AbstractMesh(tuple(sizes.values()), tuple(sizes))
    src = tj.PTC.of(abstract_state(), SOURCE_RULES, mesh(SOURCE), ids, hosts=hosts)
    dst = src.relayout(mesh(TARGET), ids, hosts=hosts, rules=TARGET_RULES)
    return src, dst


def minimum_bytes(src: tj.PTC, dst: tj.PTC) -> int:
    """Every target box less what its own device holds of it in the source: the bytes any plan
    must move between devices."""
    total = 0
    for s, d in zip(src.leaves, dst.leaves):
        held = src.boxes(s)
        for device, box in dst.boxes(d).items():
            own = held.get(device)
            kept = 0
            if own is not None:
                kept = math.prod(
                    max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(own, box)
                )
            total += (math.prod(hi - lo for lo, hi in box) - kept) * d.itemsize
    return total


def run(repeats: int = 5, log=print) -> dict:
    """One row: plan and allocate seconds (medians), shards, bytes moved against the minimum."""
    tic = time.perf_counter()
    src, dst = ptcs()
    build = time.perf_counter() - tic
    timed: dict[str, list[float]] = {"make_plan": [], "allocate": [], "make_plan_allocated": []}
    for _ in range(repeats):
        tic = time.perf_counter()
        plan = tj.make_plan(src, dst)
        timed["make_plan"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        allocated = tj.allocate(src, dst)
        timed["allocate"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        best = tj.make_plan(src, allocated)
        timed["make_plan_allocated"].append(time.perf_counter() - tic)
    row = {
        "kind": "plan_llm",
        "change": f"{SOURCE} -> {TARGET} on 128 device ids",
        "params": sum(math.prod(shape) for shape, _ in params().values()),
        "leaves": len(src.leaves),
        "state_bytes": src.nbytes,
        "target_shards": sum(len(leaf.shards) for leaf in plan.leaves),
        "build_ptcs_seconds": build,
        "runs_seconds": timed,
        "median_seconds": {k: statistics.median(v) for k, v in timed.items()},
        "bytes_moved": plan.bytes_moved,
        "bytes_minimum": minimum_bytes(src, dst),
        "bytes_moved_allocated": best.bytes_moved,
        "bytes_minimum_allocated": minimum_bytes(src, allocated),
        "kinds": dict(plan.kinds),
        "kinds_allocated": dict(best.kinds),
    }
    med = row["median_seconds"]
    log(
        f"70B-class state ({row['params'] / 1e9:.1f}B params, {src.nbytes / 1e9:.0f} GB, "
        f"{row['leaves']} leaves, {row['target_shards']:,} target shards): make_plan "
        f"{med['make_plan'] * 1e3:.0f} ms (allocated order {med['make_plan_allocated'] * 1e3:.0f} "
        "ms), "
        f"allocate {med['allocate'] * 1e3:.0f} ms; moved {row['bytes_moved'] / 1e9:.1f} GB = "
        f"minimum {row['bytes_minimum'] / 1e9:.1f} GB (allocated: "
        f"{row['bytes_moved_allocated'] / 1e9:.1f} GB = {row['bytes_minimum_allocated'] / 1e9:.1f})"
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write DIR/plan_llm.json")
    args = parser.parse_args(argv)
    row = run(args.repeats)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan_llm.json").write_text(json.dumps(row, indent=2) + "\n")
    ok = row["bytes_moved"] == row["bytes_minimum"]
    ok = ok and row["bytes_moved_allocated"] == row["bytes_minimum_allocated"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
