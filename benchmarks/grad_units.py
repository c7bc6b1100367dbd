"""Step time with gradient units vs plain data parallelism, in one process run.

Both train the same GPT + AdamW on the same global batches from a dataset PTC, on the same
layouts; only the gradient differs: plain SPMD over the padded batch, or ``--grad-units`` gradient
units (one gradient per unit, run one at a time, summed in a fixed order; bitwise equal on any
data-parallel size). Per layout: the median step time of ``--steps`` steps after compiling, and the
ratio units ÷ plain (> 1: gradient units cost that much more). The two are stepped in turn, so
the machine's noise hits both alike.

``--compile``: per layout, the XLA compile of each step instead (``--repeats`` fresh lowerings of
each, in turn; the median), and the lowered program's size: its lines, and its open sharding
annotations (``{?}``), which JAX writes on every op of a ``shard_map`` body that leaves some mesh
axis automatic.

    python benchmarks/grad_units.py [--model small] [--batch 24] [--grad-units 8] [--out FILE]
    python benchmarks/grad_units.py --compile [--repeats 3]
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

import numpy as np

import tenplex_jax as tj
from tenplex_jax_models import (
    LOGICAL_RULES,
    build_state,
    corpus_samples,
    make_train_step,
    stdlib_corpus,
)

C = tj.ParallelConfig
LAYOUTS = [
    ("dp 8", C(data=8)),
    ("dp 4", C(data=4)),
    ("dp 3 (uneven)", C(data=3)),
    ("dp 4, fsdp 2", C(data=4, fsdp=2)),
    ("dp 2, fsdp 2, tp 2", C(data=2, fsdp=2, tensor=2)),
    ("dp 2, tp 4", C(data=2, tensor=4)),
]


def job(model: str, config, batch: int, grad_units, batches: int):
    """A fresh jitted step of ``model`` on ``config``, its placed state and its first
    ``batches`` ``(batch, weights)``."""
    graphdef, state, cfg = build_state(model, 1e-3)
    ptc = tj.PTC.of(state, LOGICAL_RULES, config, jax.devices()[: config.num_devices])
    layout = tj.data.BatchLayout(batch, ranks=config.data * config.fsdp, grad_units=grad_units)
    dataset = tj.DatasetPTC(corpus_samples(stdlib_corpus(2**22), cfg.seq_len), batch)
    rows = [tj.data.device_batch(dataset, i, layout, ptc.mesh())[:2] for i in range(batches)]
    return make_train_step(graphdef, ptc, layout), tj.place(state, ptc), rows


def stepper(model: str, config, batch: int, grad_units):
    """A zero-argument function that runs one training step of ``model`` on ``config``."""
    step, state, batches = job(model, config, batch, grad_units, batches=4)
    holder = {"state": state}
    count = iter(range(10**9))

    def run() -> float:
        b, w = batches[next(count) % len(batches)]
        tic = time.perf_counter()
        holder["state"], loss = step(holder["state"], b, w)
        jax.block_until_ready(loss)
        return time.perf_counter() - tic

    return run


def compiled(model: str, config, batch: int, grad_units) -> dict:
    """One fresh lowering of the step and its compile: the seconds and the program's size."""
    step, state, [(b, w)] = job(model, config, batch, grad_units, batches=1)
    lowered = step.lower(state, b, w)
    text = lowered.as_text()
    tic = time.perf_counter()
    lowered.compile()
    return {
        "compile_s": time.perf_counter() - tic,
        "lines": text.count("\n"),
        "open_annotations": sum(
            "sdy.sharding_constraint" in line and "{?}" in line for line in text.splitlines()
        ),
    }


def compile_pair(model: str, config, batch: int, grad_units: int, repeats: int) -> dict:
    """The median compile (plain, by units), compiled in turn; each one's program size."""
    runs = [
        (compiled(model, config, batch, None), compiled(model, config, batch, grad_units))
        for _ in range(repeats)
    ]
    plain, units = runs[-1]
    return {
        "plain_s": statistics.median(r[0]["compile_s"] for r in runs),
        "units_s": statistics.median(r[1]["compile_s"] for r in runs),
        "plain_lines": plain["lines"],
        "units_lines": units["lines"],
        "units_open_annotations": units["open_annotations"],
    }


def finish(rows: list[dict], args, what: str) -> int:
    """Print the rows' geometric mean ratio as ``what``; write them to ``--out``."""
    geo = float(np.exp(np.mean(np.log([r["ratio"] for r in rows]))))
    print(f"{what}: {geo:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "geomean_ratio": geo, "args": vars(args)}, f, indent=2)
    return 0


def main_compile(args) -> int:
    print(f"GPT {args.model}, global batch {args.batch}, {args.grad_units} gradient units: compile")
    print(
        f"{'layout':>22} {'plain s':>8} {'units s':>8} {'units/plain':>12} "
        f"{'lines plain':>12} {'lines units':>12} {'open {?}':>9}"
    )
    rows = []
    for name, config in LAYOUTS:
        row = compile_pair(args.model, config, args.batch, args.grad_units, args.repeats)
        row |= {"layout": name, "config": str(config), "ratio": row["units_s"] / row["plain_s"]}
        rows.append(row)
        print(
            f"{name:>22} {row['plain_s']:8.2f} {row['units_s']:8.2f} {row['ratio']:12.2f} "
            f"{row['plain_lines']:12d} {row['units_lines']:12d} {row['units_open_annotations']:9d}"
        )
    return finish(rows, args, "geometric mean units/plain compile")


def time_pair(model: str, config, batch: int, grad_units: int, steps: int) -> tuple[float, float]:
    """Median step times (plain, by units), the two stepped in turn so noise hits both alike."""
    plain, by_units = stepper(model, config, batch, None), stepper(model, config, batch, grad_units)
    for _ in range(2):  # compile, warm up
        plain(), by_units()
    times = [(plain(), by_units()) for _ in range(steps)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "gpt100m"))
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--grad-units", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--compile", action="store_true", help="time compiles, not steps")
    parser.add_argument("--repeats", type=int, default=3, help="compiles of each (--compile)")
    args = parser.parse_args(argv)
    if args.compile:
        return main_compile(args)
    rows = []
    print(f"GPT {args.model}, global batch {args.batch}, {args.grad_units} gradient units")
    print(f"{'layout':>22} {'plain ms':>9} {'units ms':>11} {'units/plain':>14}")
    for name, config in LAYOUTS:
        plain, by_units = time_pair(args.model, config, args.batch, args.grad_units, args.steps)
        rows.append(
            {
                "layout": name,
                "config": str(config),
                "plain_s": plain,
                "units_s": by_units,
                "ratio": by_units / plain,
            }
        )
        print(f"{name:>22} {plain * 1e3:9.1f} {by_units * 1e3:11.1f} {by_units / plain:14.2f}")
    return finish(rows, args, "geometric mean units/plain")


if __name__ == "__main__":
    sys.exit(main())
