"""The executor's two paths vs ``jax.device_put`` of the whole tree, over the core change matrix.

All three execute the same plan on the same GPT + AdamW state, in one process run, taking turns in
every round (a warm-up round first), so the machine's noise falls on all alike: the executor's
host path (``executor="host"``: NumPy copies of CPU buffers), its device path (``"device"``: JAX
slices and ``device_put`` of every piece to its target, the path GPUs take), and one
``jax.device_put`` (``method="device_put"``). Medians of ``--repeats`` rounds; the ratios per row
are device_put time ÷ each path's time (> 1: that path is faster). Donation is off so every round
starts from the same source state.

    python benchmarks/reshard_methods.py [--model medium] [--repeats 5] [--allocate] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import optax
from flax import nnx

import tenplex_jax as tj
from tenplex_jax_models import GPT, LOGICAL_RULES, GPTConfig

C = tj.ParallelConfig
MODELS = {
    "small": GPTConfig.small(),
    # ~25M params: large enough that copies, not dispatch, dominate on CPU
    "medium": GPTConfig(seq_len=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048),
}
MATRIX = [
    ("dp 8->4", C(data=8), range(8), C(data=4), range(4)),
    ("dp 4->6 on 2..7", C(data=4), range(4), C(data=6), range(2, 8)),
    ("tp 2->4", C(data=4, tensor=2), range(8), C(data=2, tensor=4), range(8)),
    ("fsdp 4->2", C(data=2, fsdp=4), range(8), C(data=4, fsdp=2), range(8)),
    ("dp2,tp4 -> dp3,tp2", C(data=2, tensor=4), range(8), C(data=3, tensor=2), range(6)),
    ("disjoint", C(fsdp=2, tensor=2), range(4), C(fsdp=2, tensor=2), range(4, 8)),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--allocate", action="store_true", help="reorder target devices with tj.allocate first"
    )
    args = parser.parse_args(argv)
    with nnx.use_eager_sharding(False):
        model = GPT(MODELS[args.model], rngs=nnx.Rngs(0))
        state = nnx.state((model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))
    devices = jax.devices()
    rows = []
    for name_, src_cfg, src_devs, dst_cfg, dst_devs in MATRIX:
        src = tj.PTC.of(state, LOGICAL_RULES, src_cfg, [devices[i] for i in src_devs])
        dst = tj.PTC.of(state, LOGICAL_RULES, dst_cfg, [devices[i] for i in dst_devs])
        dst = tj.allocate(src, dst) if args.allocate else dst
        placed = tj.place(state, src)
        plan = tj.make_plan(src, dst)
        strategies = {
            "host": {"executor": "host"},
            "device": {"executor": "device"},
            "device_put": {"method": "device_put"},
        }
        runs = {name: [] for name in strategies}
        for round_ in range(args.repeats + 1):  # round 0 warms up dispatch and compile caches
            for name, kwargs in strategies.items():
                start = time.perf_counter()
                out, _ = tj.reshard(placed, plan, donate=False, **kwargs)
                if round_:
                    runs[name].append(time.perf_counter() - start)
                del out
        times = {name: statistics.median(r) for name, r in runs.items()}
        row = {
            "change": name_,
            "state_mib": round(src.nbytes / 2**20, 2),
            "moved_mib": round(plan.bytes_moved / 2**20, 2),
            "kept_mib": round(plan.bytes_kept / 2**20, 2),
            "median_seconds": times,
            "device_put_over_host": times["device_put"] / times["host"],
            "device_put_over_device": times["device_put"] / times["device"],
        }
        rows.append(row)
        print(
            f"{name_:22s} moved {row['moved_mib']:8.2f} MiB kept {row['kept_mib']:8.2f} MiB  "
            + "  ".join(f"{k} {v * 1e3:7.1f} ms" for k, v in times.items())
            + f"  device_put/host {row['device_put_over_host']:5.2f}"
            f"  device_put/device {row['device_put_over_device']:5.2f}",
            flush=True,
        )
    geomean = {
        path: statistics.geometric_mean(r[f"device_put_over_{path}"] for r in rows)
        for path in ("host", "device")
    }
    print(
        f"geometric mean over {len(rows)} changes of device_put time / path time: "
        + ", ".join(f"{path} {g:.2f}" for path, g in geomean.items())
    )
    if args.out:
        with open(args.out, "w") as f:
            result = {"model": args.model, "allocate": args.allocate, "jax": jax.__version__}
            json.dump({**result, "rows": rows, "geomean_ratio": geomean}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
