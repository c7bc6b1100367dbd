"""Pipelined vs unpipelined train step time, and what the planner predicted for each layout.

One process, one model, one global batch: the full train step (forward, backward, AdamW) of the
reference GPT on 8 fake CPU devices, for an unpipelined baseline and for GPipe layouts over the
``pipe`` axis, stepped round robin (one step of each layout per round, so that the noise of a shared
machine hits all alike). Medians of ``--repeats`` rounds after two warm-up rounds; the ratio is each
layout's step time ÷ the baseline's (< 1: faster than the baseline). On CPU the fake devices share
two cores, so a pipeline cannot overlap stages in wall time: the ratio measures the schedule's
overhead (bubble ticks, microbatch loop, permutes, rematerialisation), not a GPU speed-up.

    python benchmarks/pipeline_step.py [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax_models import (
    GPT,
    LOGICAL_RULES,
    GPTConfig,
    batch_at,
    loss_fn,
    profile,
    stdlib_corpus,
)

C = tj.ParallelConfig
MODEL = GPTConfig(seq_len=128, d_model=128, n_layers=8, n_heads=4, d_ff=512)
BATCH = 32
BASELINE = ("data=8 (no pipeline, plain scan)", C(data=8), 1, False)
LAYOUTS = [
    BASELINE,
    ("data=8 (through pipeline(), remat)", C(data=8), 1, True),
    ("pipe=2,data=4 mb=4", C(pipe=2, data=4), 4, True),
    ("pipe=2,data=4 mb=8", C(pipe=2, data=4), 8, True),
    ("pipe=4,data=2 mb=8", C(pipe=4, data=2), 8, True),
    ("pipe=8 mb=8", C(pipe=8), 8, True),
    ("pipe=2,data=2,tensor=2 mb=4", C(pipe=2, data=2, tensor=2), 4, True),
]


def _step(graphdef, ptc, microbatches, pipelined):
    mesh = ptc.mesh()
    kwargs = {"mesh": mesh, "microbatches": microbatches} if pipelined else {}
    loss_of = functools.partial(loss_fn, **kwargs)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_of)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    batch = NamedSharding(mesh, P(("data", "fsdp")))
    return jax.jit(
        step,
        in_shardings=(ptc.shardings(mesh), batch),
        out_shardings=(ptc.shardings(mesh), NamedSharding(mesh, P())),
        donate_argnums=0,
    ), batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    corpus = stdlib_corpus(2**22)
    cpu = tj.planner.Cluster.uniform(
        8, tj.planner.DeviceType("cpu", 2 * 2**30, 5e9, 10e9), per_node=8
    )
    prof = profile(MODEL)
    runs = []
    for _name, config, microbatches, pipelined in LAYOUTS:
        with nnx.use_eager_sharding(False):
            model = GPT(MODEL, rngs=nnx.Rngs(0))
            nodes = (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param))
        graphdef, state = nnx.split(nodes)
        ptc = tj.PTC.of(state, LOGICAL_RULES, config, jax.devices())
        step, batch_sharding = _step(graphdef, ptc, microbatches, pipelined)
        runs.append([step, batch_sharding, tj.place(state, ptc), [], None])
    # round robin: one step of every layout per round, so machine noise hits all layouts alike
    for i in range(args.repeats + 2):
        batch = batch_at(corpus, i, BATCH, MODEL.seq_len, 0)
        for run in runs:
            step, batch_sharding, state, times, _ = run
            placed = jax.device_put(batch, batch_sharding)
            tic = time.perf_counter()
            run[2], loss = step(state, placed)
            loss.block_until_ready()
            times.append(time.perf_counter() - tic)
            run[4] = float(loss)
    rows = []
    for (name, config, microbatches, _), run in zip(LAYOUTS, runs):
        stages = tj.pipelining.Stages.even(MODEL.n_layers, config.pipe)
        predicted = tj.planner.estimate(cpu, prof, BATCH, config, microbatches, stages).step_time
        rows.append(
            {
                "layout": name,
                "ms": 1e3 * statistics.median(run[3][2:]),
                "predicted_ms": 1e3 * predicted,
                "loss": run[4],
            }
        )
        print(f"{name:40s} {rows[-1]['ms']:9.1f} ms  (model {rows[-1]['predicted_ms']:.1f} ms)")
    base = rows[0]["ms"]
    print(
        "\n| layout | step ms | ratio to baseline | planner's estimate ms |\n|---|---:|---:|---:|"
    )
    for row in rows:
        row["ratio"] = row["ms"] / base
        cells = (
            row["layout"],
            f"{row['ms']:.1f}",
            f"{row['ratio']:.2f}",
            f"{row['predicted_ms']:.1f}",
        )
        print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
