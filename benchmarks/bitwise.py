"""What bitwise training costs, and that it is bitwise, in one process run.

Cost: the step of a bitwise job (``JobOptions(bitwise=True)``: the batch over every mesh axis,
each gradient unit computed whole) against the default job's (the batch over ``data`` and
``fsdp``, tensor-, pipeline- and expert-parallel compute), both with the same gradient units, on
the same model, layout and batches. Per layout of 8 devices (dp, fsdp, tensor, pipe, expert and a
mix): the ratio of XLA's per-device peak memory for the compiled step (arguments + outputs -
donated + temporaries), compiled from abstract values, and the ratio of median step times, in
alternating blocks with one copy of the state alive at a time. The model is a mixture-of-experts
GPT with GPT-2 small's dims and 4 experts of width 768: 114.5M params, AdamW. Its 16 layers are
compiled for memory; the step times run ``--time-layers`` of them (4: the default layout's
tensor-parallel step needs 3.2 GiB per device, 26 GiB for 8 in one process).

Bits: the tiny MoE GPT for 20 steps through 4 layout changes against the same job on one device,
every loss and every leaf of the state.

    python benchmarks/bitwise.py [--seq-len 128] [--steps 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import tenplex_jax as tj  # noqa: E402

tj.elastic.use_bitwise_flags()

import numpy as np  # noqa: E402

from tenplex_jax_models import (  # noqa: E402
    MOE_RULES,
    GPTConfig,
    build_state,
    corpus_samples,
    moe_config,
    stdlib_corpus,
    train_step,
)

E = moe_config
LAYOUTS = [
    ("dp 8", E(data=8)),
    ("fsdp 8", E(fsdp=8)),
    ("dp 2, tensor 4", E(data=2, tensor=4)),
    ("pipe 2, dp 4", E(pipe=2, data=4)),
    ("expert 4, dp 2", E(expert=4, data=2)),
    ("pipe 2, expert 2, tensor 2", E(pipe=2, expert=2, tensor=2)),
]
GRAD_UNITS = 8


def model(seq_len: int, layers: int = 16) -> GPTConfig:
    return dataclasses.replace(
        GPTConfig.gpt100m(), seq_len=seq_len, n_layers=layers, n_experts=4, d_ff=768
    )


def abstract_batch(layout, mesh, axes, seq_len: int) -> tj.Batch:
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))
    tokens = jax.ShapeDtypeStruct((layout.rows, seq_len), np.int32, sharding=rows)
    weights = jax.ShapeDtypeStruct((layout.rows,), np.float32, sharding=rows)
    return tj.Batch({"inputs": tokens, "targets": tokens}, weights, layout, mesh, axes)


def peak_bytes(cfg: GPTConfig, config, batch: int, every_axis: bool) -> int:
    """XLA's per-device peak for the step compiled from abstract values (no state allocated)."""
    graphdef, abstract, _ = build_state(cfg, 1e-4, abstract=True)
    ptc = tj.PTC.of(abstract, MOE_RULES, config, jax.devices()[: config.num_devices])
    mesh = ptc.mesh()
    layout, axes = batch_layout(config, batch, every_axis)
    compiled = pinned_step(graphdef, ptc, mesh).lower(
        ptc.abstract(mesh), abstract_batch(layout, mesh, axes, cfg.seq_len)
    )
    memory = compiled.compile().memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def pinned_step(graphdef, ptc, mesh):
    """The reference GPT's ``train_step`` jitted for ``ptc``'s layout, the state donated."""
    shardings = ptc.shardings(mesh)
    return jax.jit(
        train_step(graphdef),
        in_shardings=(shardings, None),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )


def batch_layout(config, batch: int, every_axis: bool):
    axes = tuple(config.shape) if every_axis else tj.data.BATCH_AXES
    ranks = int(np.prod([config.size(a) for a in axes]))
    return tj.data.BatchLayout(batch, ranks=ranks, grad_units=GRAD_UNITS), axes


class Stepper:
    """One mode's step on one layout: its state, its batches, its compiled step."""

    def __init__(self, cfg: GPTConfig, config, batch: int, every_axis: bool, source):
        graphdef, state, _ = build_state(cfg, 1e-4)
        self.ptc = tj.PTC.of(state, MOE_RULES, config, jax.devices()[: config.num_devices])
        mesh = self.ptc.mesh()
        layout, axes = batch_layout(config, batch, every_axis)
        dataset = tj.DatasetPTC(source, batch)
        self.batches = []
        for i in range(2):
            data, weights, _ = tj.data.device_batch(dataset, i, layout, mesh, axes)
            self.batches.append(tj.Batch(data, weights, layout, mesh, axes))
        self.state = tj.place(state, self.ptc)
        self.step = (
            pinned_step(graphdef, self.ptc, mesh).lower(self.state, self.batches[0]).compile()
        )
        self.count = 0

    def __call__(self) -> float:
        batch = self.batches[self.count % 2]
        self.count += 1
        tic = time.perf_counter()
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - tic

    def close(self) -> None:
        self.state = self.step = self.batches = None


def cost_row(name: str, config, cfg: GPTConfig, timed: GPTConfig, batch: int, steps: int, source):
    """Peak memory of both modes on one layout (``cfg``), and their median step times
    (``timed``): one stepper alive at a time, in blocks default, bitwise, default, bitwise (the
    first step of each block not timed)."""
    peaks = {every_axis: peak_bytes(cfg, config, batch, every_axis) for every_axis in (0, 1)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for every_axis in (False, True, False, True):
        stepper = Stepper(timed, config, batch, every_axis, source)
        stepper()
        times[every_axis] += [stepper() for _ in range(steps)]
        stepper.close()
    default, bitwise = (statistics.median(times[m]) for m in (False, True))
    return {
        "layout": name,
        "config": str(config),
        "default_s": default,
        "bitwise_s": bitwise,
        "time_ratio": bitwise / default,
        "default_peak_bytes": peaks[False],
        "bitwise_peak_bytes": peaks[True],
        "memory_ratio": peaks[True] / peaks[False],
    }


def bits(steps: int = 20) -> dict:
    """The tiny MoE GPT through 4 layout changes against one device: equal losses and state?"""
    cfg = GPTConfig.moe_tiny()
    source = corpus_samples(stdlib_corpus(2**20), seq_len=cfg.seq_len, num_samples=64)
    schedule = {
        0: E(expert=4, data=2),
        4: E(expert=2, tensor=2),
        8: E(pipe=2, data=3),
        12: E(fsdp=2, tensor=2, pipe=2),
        16: E(expert=4, data=2),
    }

    def run(schedule):
        graphdef, state, _ = build_state(cfg, 3e-3)
        dataset, ptc, losses = tj.DatasetPTC(source, 16, seed=1), None, []
        for i in range(steps):
            if i in schedule:
                config = schedule[i]
                devices = jax.devices()[: config.num_devices]
                if ptc is None:
                    new = tj.PTC.of(state, MOE_RULES, config, devices)
                else:
                    new = ptc.relayout(config, devices)
                if ptc is None:
                    state = tj.place(state, new)
                else:
                    state, _ = tj.reshard(state, tj.make_plan(ptc, tj.allocate(ptc, new)))
                ptc, mesh = new, new.mesh()
                layout, axes = batch_layout(config, 16, every_axis=True)
                step = pinned_step(graphdef, ptc, mesh)
            data, weights, _ = tj.data.device_batch(dataset, i, layout, mesh, axes)
            state, metrics = step(state, tj.Batch(data, weights, layout, mesh, axes))
            losses.append(float(metrics["loss"]))
        return losses, [np.asarray(x) for x in jax.tree.leaves(state)]

    losses, state = run(schedule)
    alone_losses, alone = run({0: E()})
    return {
        "changes": [str(c) for c in schedule.values()],
        "losses_bitwise": losses == alone_losses,
        "state_bitwise": all(np.array_equal(a, b) for a, b in zip(state, alone)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--time-layers", type=int, default=4, help="layers of the timed model")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    result = {"args": vars(args), "bits": bits()}
    print(f"bits, tiny MoE GPT through {result['bits']['changes']}: {result['bits']}", flush=True)
    cfg, timed = model(args.seq_len), model(args.seq_len, args.time_layers)
    source = corpus_samples(stdlib_corpus(2**22), cfg.seq_len, 64)
    print(
        f"MoE GPT 114.5M (memory; {args.time_layers} of its 16 layers timed), seq {args.seq_len}, "
        f"batch {args.batch}, {GRAD_UNITS} gradient units"
    )
    head = f"{'layout':>28} {'default s':>10} {'bitwise s':>10} {'time':>6} {'memory':>7}"
    print(head, flush=True)
    rows = []
    for name, config in LAYOUTS:
        row = cost_row(name, config, cfg, timed, args.batch, args.steps, source)
        rows.append(row)
        print(
            f"{name:>28} {row['default_s']:10.2f} {row['bitwise_s']:10.2f} "
            f"{row['time_ratio']:6.2f} {row['memory_ratio']:7.2f}",
            flush=True,
        )
    result["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
