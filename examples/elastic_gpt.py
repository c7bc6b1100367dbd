"""Train the reference GPT as an elastic job: alone, or as the processes of ``tenplex-jax launch``.

    python examples/elastic_gpt.py --steps 40                 # one process, 8 fake CPU devices
    tenplex-jax launch --nprocs 4 --devices-per-proc 2 --commit-every 5 \\
        examples/elastic_gpt.py --steps 40                    # the same script, 4 processes
    XLA_FLAGS=--xla_cpu_max_isa=AVX tenplex-jax launch --nprocs 4 --devices-per-proc 2 \\
        examples/elastic_gpt.py --bitwise --layouts "8=data=2,tensor=4; 4=pipe=2,tensor=2"

The loop is an ordinary JAX training loop over ``tj.ElasticJob``. Alone, the job runs on this
process's devices, and ``job.preempt`` / ``job.fail`` / ``job.offer`` (or SIGTERM) reshard it
between steps. Launched, every process runs this script; ``job.start`` lays the state out over
this generation's devices: built on the first start, else pulled from the tensor stores (each
process reads only its own shards) or, when no copy of some shard survived, from the orbax
checkpoint; ``job.next`` commits to the stores in the background. The dataset PTC resumes at the
restored step, and gradient units make the gradients bitwise independent of the data-parallel
size, so a job that loses a process trains the same bits as one that never did.

Kill a worker (``kill -9 PID``, the PIDs are in the launcher's "generation" line) and the launcher
starts a new generation on the processes left; ``echo 2 > RUN_DIR/resize`` asks for a planned
resize (no step lost); SIGTERM to the launcher stops the job after a commit. Process 0 prints a
line per step.

``--bitwise`` runs the job with ``JobOptions(bitwise=True)`` (docs/bitwise.md): alone, the script
sets the XLA flags it needs; launched, the launcher's environment must hold them, as JAX has
started when the script runs. ``--layouts`` gives the layout of each device count instead of the
planner's.

``--pause-after 3,6`` holds a launched job once at the boundary after each of those steps (its
commits finished) until RUN_DIR/resume-STEP exists, so that a test, a benchmark or a person can
kill a process at a known step; each process marks RUN_DIR/paused-STEP-p<id> while it waits.
``--pause-only P`` holds process P alone: the others go on into the next step, whose
collectives wait for P, and mark RUN_DIR/passed-STEP-p<id> once they have dispatched it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# alone: 8 fake CPU devices; launched, the launcher has configured JAX already
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import numpy as np

import tenplex_jax as tj
from tenplex_jax_models import (
    LOGICAL_RULES,
    GPTConfig,
    build_state,
    corpus_samples,
    stdlib_corpus,
    train_step,
)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    model = gpt_config(args.model)
    graphdef, _, cfg = build_state(model, args.lr, args.seed, abstract=True)
    samples = corpus_samples(stdlib_corpus(2**20), cfg.seq_len, args.samples)
    dataset = tj.DatasetPTC(samples, args.batch, seed=args.seed)

    def init():  # the initial state, jitted by job.start straight into its layout
        return build_state(model, args.lr, args.seed)[1]

    if args.bitwise:
        tj.elastic.use_bitwise_flags()
    layouts = parse_layouts(args.layouts)
    with tj.ElasticJob(
        LOGICAL_RULES,
        dataset,
        grad_units=args.grad_units,
        config=layouts.__getitem__ if layouts else None,
        options=tj.elastic.JobOptions(bitwise=args.bitwise),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        steps=args.planned_steps or args.steps,  # what growing onto offered devices is weighed over
    ) as job:
        state = job.start(init)
        # named: a process that joins later (a replacement, a growth) loads the steps stored in
        # the executable cache with nothing traced; new code takes a new name
        step = job.jit(train_step(graphdef), program=f"elastic_gpt {args.model} lr {args.lr} v1")
        say = print if job.process_index == 0 else (lambda *a, **k: None)
        restored = job.restored  # launched: where the state came from, and how fast
        say(
            f"generation {job.generation}: {jax.process_count()} processes, {job.ptc.config}, "
            f"from step {job.step}"
            + ("" if restored is None else f" ({restored.source}, {restored.seconds:.2f} s)"),
            flush=True,
        )
        pauses = {int(s) for s in args.pause_after.split(",") if s}
        while job.step < args.steps:
            boundary = job.step
            state, batch = job.next(state)  # launched: commits here, or ends the generation
            held = boundary in pauses and job.run_dir is not None
            if held and args.pause_only in (None, job.process_index):
                pause(job, boundary)
            state, metrics = step(state, batch)
            if held and args.pause_only not in (None, job.process_index):
                # dispatched: its collectives wait for the process held
                (job.run_dir / f"passed-{boundary}-p{job.process_index}").write_text("")
            loss = float(metrics["loss"])
            say(f"step {job.step:4d}  loss {loss:.4f}  {job.ptc.config}", flush=True)
            if args.log and job.process_index == 0:
                log_step(job, loss, args.log)
        job.finish(state)
        if args.out:
            from jax.experimental import multihost_utils

            host = [
                np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for x in jax.tree.leaves(state)
            ]
            if job.process_index == 0:
                np.savez(args.out, *host)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help="GPT preset (tiny, small, gpt100m) or GPTConfig fields: d_model=256,n_layers=4,...",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--planned-steps",
        type=int,
        default=None,
        help="the run's planned length, over which growing onto offered devices "
        "is weighed (default: --steps)",
    )
    parser.add_argument("--batch", type=int, default=24, help="global batch (fixed across resizes)")
    parser.add_argument("--grad-units", type=int, default=8, help="gradient units")
    parser.add_argument("--samples", type=int, default=100, help="dataset size in samples")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", help="orbax checkpoints (resumed from when present)")
    parser.add_argument("--checkpoint-every", type=int, help="steps between orbax checkpoints")
    parser.add_argument("--log", help="append a JSON line per step here (process 0)")
    parser.add_argument("--out", help="write the final params and optimizer state here (.npz)")
    parser.add_argument("--bitwise", action="store_true", help="JobOptions(bitwise=True)")
    parser.add_argument(
        "--layouts", default="", help="the layout of each device count: '8=data=2,tensor=4; 4=...'"
    )
    parser.add_argument("--pause-after", default="", metavar="STEPS", help="e.g. 3,6")
    parser.add_argument("--pause-only", type=int, metavar="P", help="hold only process P")
    return parser


def log_step(job, loss: float, path: str) -> None:
    """Append the step's record to ``path``: its generation, step, loss, samples and config."""
    record = {
        "generation": job.generation,
        "step": job.step,
        "loss": loss,
        "samples": job.samples.tolist(),
        "config": str(job.ptc.config),
        "time": time.time(),
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def parse_layouts(text: str) -> dict[int, tj.ParallelConfig]:
    """``"8=data=2,tensor=4; 4=tensor=4"`` -> the parallel config of each device count."""
    layouts = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        count, _, config = entry.partition("=")
        layouts[int(count)] = tj.ParallelConfig.parse(config)
    return layouts


def gpt_config(text: str) -> GPTConfig:
    """A preset name, or ``key=value`` overrides of ``GPTConfig`` such as ``d_model=256``."""
    if "=" not in text:
        return GPTConfig.by_name(text)
    fields = dict(part.split("=", 1) for part in text.split(","))
    return GPTConfig(**{key.strip(): int(value) for key, value in fields.items()})


def pause(job, step: int, timeout: float = 300.0) -> None:
    """Once per job, at the boundary after ``step`` steps: wait, with the commits finished,
    until RUN_DIR/resume-STEP exists."""
    marker = job.run_dir / f"paused-{step}-p{job.process_index}"
    if marker.exists():  # an earlier generation paused here already
        return
    job.wait()
    marker.write_text(str(job.generation))
    resume = job.run_dir / f"resume-{step}"
    deadline = time.monotonic() + timeout
    while not resume.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing created {resume} in {timeout:.0f} s")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
