"""A process restart with and without the executable cache: what a new process pays before its
first step, on whatever devices JAX finds (a GPU where there is one).

Three fresh processes each run the same :class:`ElasticJob` (the GPT on every local device, the
step from ``job.jit``, ``--steps`` steps from the same initial state and data):

- **cold**: an empty executable cache; the process compiles its step and stores it;
- **cached**: the cache the cold process filled; the process loads the step instead;
- **cold again**: a new empty cache (a second cold run, for the spread between two alike);
- **same process**: the first cache again, and a process that runs the job twice and reports
  the second: a launched survivor's next generation, which loads the step it lowered before
  without tracing it (``elastic/programs.py``).

Each process reports the seconds from its start to JAX's devices (imports, backend), ``job.start``
(the state built into its layout), the first step (compile or load, and the step), and the median
of the later steps; the compile or load alone is the first step minus the later steps' median.
JAX's persistent compilation cache is off in all three. The losses of the three runs must be equal
bit for bit: a loaded executable computes what the compiled one does. On a GPU that needs XLA's
deterministic ops (``--xla_gpu_deterministic_ops``, added to ``XLA_FLAGS`` here): without them two
runs of one program differ from the third step on (measured on an H200: 1e-6 relative, between
two cold runs as much as between a cold and a cached one).

    python -m tenplex_jax_benchmarks.restart [--model gpt100m] [--grad-units 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STARTED = time.perf_counter()


def child(
    model: str, cache: str, steps: int, batch: int, grad_units: int | None, twice: bool = False
) -> dict:
    """One process's run (in this process): its timings, counts and losses; ``twice``: the
    second of two runs in this process."""
    import jax

    devices = jax.devices()
    ready = time.perf_counter() - STARTED
    import tenplex_jax as tj
    from tenplex_jax_models import (
        LOGICAL_RULES,
        build_state,
        corpus_samples,
        stdlib_corpus,
        train_step,
    )

    graphdef, _, cfg = build_state(model, 1e-3, abstract=True)
    samples = corpus_samples(stdlib_corpus(2**22), cfg.seq_len, 4 * batch)
    options = tj.elastic.JobOptions(
        compile_ahead=False, exact_step_times=True, executable_cache=cache
    )
    if twice:
        child(model, cache, steps, batch, grad_units)
    losses, times = [], []
    with tj.ElasticJob(
        LOGICAL_RULES,
        tj.DatasetPTC(samples, batch, seed=0),
        devices=devices,
        grad_units=grad_units,
        options=options,
    ) as job:
        tic = time.perf_counter()
        state = job.start(lambda: build_state(model, 1e-3)[1])
        jax.block_until_ready(state)
        started = time.perf_counter() - tic
        step = job.jit(train_step(graphdef))
        for _ in range(steps):
            state, b = job.next(state)
            tic = time.perf_counter()
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))  # waits for the step
            times.append(time.perf_counter() - tic)
        cache = job.steps_cache
        counts = {
            "config": str(job.ptc.config),
            "compiles": cache.compiles,
            "loads": cache.loads,
            "traced": [c.traced for c in cache.done()],
        }
    return _report(devices, ready, started, times, counts, losses)


def _report(devices, ready: float, started: float, times, counts: dict, losses) -> dict:
    import jax

    later = statistics.median(times[1:])
    return {
        "devices": f"{len(devices)} x {devices[0].device_kind}",
        "platform": devices[0].platform,
        "jax": jax.__version__,
        "config": counts["config"],
        "to_devices_seconds": ready,
        "start_seconds": started,
        "first_step_seconds": times[0],
        "step_seconds": later,
        "compile_or_load_seconds": times[0] - later,
        **{k: counts[k] for k in ("compiles", "loads", "traced")},
        "losses": losses,
    }


def run_restart(model: str, steps: int = 4, batch: int = 24, grad_units: int | None = None) -> dict:
    """The three processes' reports and the ratios cold ÷ cached."""
    runs = {}
    flags = os.environ.get("XLA_FLAGS", "")
    env = os.environ | {"XLA_FLAGS": f"{flags} --xla_gpu_deterministic_ops=true".strip()}
    with tempfile.TemporaryDirectory(prefix="tenplex-restart-") as tmp:
        caches = {"cold": "a", "cached": "a", "cold again": "b", "same process": "a"}
        for name, cache in caches.items():
            command = [sys.executable, "-m", __spec__.name, "--child", "--model", model]
            command += ["--twice"] if name == "same process" else []
            command += ["--steps", str(steps), "--batch", str(batch)]
            command += ["--cache", os.path.join(tmp, cache)]
            if grad_units is not None:
                command += ["--grad-units", str(grad_units)]
            tic = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
            runs[name] = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name]["process_seconds"] = time.perf_counter() - tic
    cold, cached, same = runs["cold"], runs["cached"], runs["same process"]
    if not (cold["compiles"] >= 1 and cached["compiles"] == 0 and cached["loads"] >= 1):
        raise RuntimeError(f"the cached process compiled: {cold} {cached}")
    if same["compiles"] or any(same["traced"]):
        raise RuntimeError(f"the second job in a process compiled or traced: {same}")
    if len({tuple(r["losses"]) for r in runs.values()}) != 1:
        raise RuntimeError(f"the losses differ: {[r['losses'] for r in runs.values()]}")
    to_first = {n: r["start_seconds"] + r["first_step_seconds"] for n, r in runs.items()}
    return {
        "model": model,
        "runs": runs,
        "compile_vs_load": cold["compile_or_load_seconds"] / cached["compile_or_load_seconds"],
        "start_to_first_step_cold_vs_cached": to_first["cold"] / to_first["cached"],
        "process_cold_vs_cached": cold["process_seconds"] / cached["process_seconds"],
        "load_cached_vs_same_process": cached["compile_or_load_seconds"]
        / same["compile_or_load_seconds"],
        "losses_bitwise": True,
    }


def table(row: dict) -> str:
    lines = [
        f"{row['model']} on {row['runs']['cold']['devices']} ({row['runs']['cold']['config']}, "
        f"jax {row['runs']['cold']['jax']})",
        "| process | to devices s | job.start s | first step s | later steps s | compile or "
        "load s | whole process s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in row["runs"].items():
        lines.append(
            f"| {name} | {r['to_devices_seconds']:.2f} | {r['start_seconds']:.2f} | "
            f"{r['first_step_seconds']:.3f} | {r['step_seconds']:.4f} | "
            f"{r['compile_or_load_seconds']:.3f} | {r['process_seconds']:.2f} |"
        )
    lines.append(
        f"compile ÷ load {row['compile_vs_load']:.1f}x; start to first step, cold ÷ cached "
        f"{row['start_to_first_step_cold_vs_cached']:.2f}x; a new process's load ÷ the same "
        f"process's (untraced) {row['load_cached_vs_same_process']:.1f}x; losses bitwise equal"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="GPT preset (tiny, small, gpt100m)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--grad-units", type=int, help="gradient units (default: none)")
    parser.add_argument("--out", help="write the row as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--twice", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        row = child(args.model, args.cache, args.steps, args.batch, args.grad_units, args.twice)
        print(json.dumps(row))
        return 0
    row = run_restart(args.model, args.steps, args.batch, args.grad_units)
    print(table(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
