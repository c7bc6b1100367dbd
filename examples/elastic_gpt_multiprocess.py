"""Train the reference GPT as an elastic multi-process job under ``tenplex-jax launch``.

    tenplex-jax launch --nprocs 4 --devices-per-proc 2 --commit-every 5 \
        examples/elastic_gpt_multiprocess.py --steps 40

Every process runs this script; ``tj.launch.join()`` connects it to the job (``jax.distributed`` on
127.0.0.1, the tensor stores). ``job.restore`` lays the train state out over this generation's
devices: built on the first start, else pulled from the stores (each process reads only its own
shards) or, when no copy of some shard survived, from the orbax checkpoint. The dataset PTC
resumes at the restored step, and virtual workers make the gradients bitwise independent of the
data-parallel size, so a job that loses a process trains the same bits as one that never did.

Kill a worker (``kill -9 PID``, the PIDs are in the launcher's "generation" line) and the launcher
starts a new generation on the processes left; ``echo 2 > RUN_DIR/resize`` asks for a planned
resize (no step lost); SIGTERM to the launcher stops the job after a commit. Process 0 prints a
line per step and one per restore.

``--pause-after 3,6`` holds the job once after each of those steps (its commits finished) until
RUN_DIR/resume-STEP exists, so that a test, a benchmark or a person can kill a process at a known
step; each process marks RUN_DIR/paused-STEP-p<id> while it waits.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # models/ next to examples/

import tenplex_jax as tj


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help="GPT preset (tiny, small, gpt100m) or GPTConfig fields: d_model=256,n_layers=4,...",
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=24, help="global batch (fixed across resizes)")
    parser.add_argument("--workers", type=int, default=8, help="virtual data-parallel workers")
    parser.add_argument("--samples", type=int, default=100, help="dataset size in samples")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", help="append a JSON line per step here (process 0)")
    parser.add_argument("--out", help="write the final params and optimizer state here (.npz)")
    parser.add_argument("--pause-after", default="", metavar="STEPS", help="e.g. 3,6")
    args = parser.parse_args(argv)

    job = tj.launch.join()  # before JAX starts its backend

    import jax
    import numpy as np

    from models import LOGICAL_RULES, corpus_samples, stdlib_corpus
    from tenplex_jax.demo import build_state, make_train_step

    model = gpt_config(args.model)
    graphdef, abstract, cfg = build_state(model, args.lr, args.seed, abstract=True)
    dataset = tj.DatasetPTC(
        corpus_samples(stdlib_corpus(2**20), cfg.seq_len, args.samples), args.batch, seed=args.seed
    )

    def init():  # the initial state, jitted by job.restore straight into the layout
        return build_state(model, args.lr, args.seed)[1]

    state, ptc, step = job.restore(abstract, LOGICAL_RULES, dataset, init=init)
    layout = tj.BatchLayout(
        args.batch, ranks=ptc.config.data * ptc.config.fsdp, workers=args.workers
    )
    train_step = make_train_step(graphdef, ptc, layout)
    say = print if job.process_index == 0 else (lambda *a, **k: None)
    say(f"generation {job.generation}: {job.num_processes} processes, {ptc.config}, "
        f"restored {json.dumps(job.restored)}", flush=True)  # fmt: skip

    stopped = False
    while step < args.steps:
        batch, weights, samples = tj.device_batch(dataset, step, layout, ptc.mesh())
        dataset.step = step = step + 1
        state, loss = train_step(state, batch, weights)
        loss = float(loss)
        say(f"step {step:4d}  loss {loss:.4f}  {job.num_processes} processes  {ptc.config}",
            flush=True)  # fmt: skip
        if args.log and job.process_index == 0:
            record = {
                "generation": job.generation,
                "step": step,
                "loss": loss,
                "samples": samples.tolist(),
                "config": str(ptc.config),
                "time": time.time(),
            }
            with open(args.log, "a") as f:
                f.write(json.dumps(record) + "\n")
        if job.after_step(state, ptc, step, dataset):
            stopped = True
            break
        if str(step) in args.pause_after.split(",") and job.run_dir is not None:
            pause(job, step)
    if stopped:
        say(f"generation {job.generation} ends at step {step} (committed) for the launcher")
        return 0
    if args.out:
        from jax.experimental import multihost_utils

        host = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for x in jax.tree.leaves(state)]  # fmt: skip
        if job.process_index == 0:
            np.savez(args.out, *host)
    job.finish(state, ptc, step, dataset)
    return 0


def gpt_config(text: str):
    """A preset name, or ``key=value`` overrides of ``GPTConfig`` such as ``d_model=256``."""
    from models import GPTConfig

    if "=" not in text:
        return GPTConfig.by_name(text)
    fields = dict(part.split("=", 1) for part in text.split(","))
    return GPTConfig(**{key.strip(): int(value) for key, value in fields.items()})


def pause(job, step: int, timeout: float = 300.0) -> None:
    """Once per job: wait, with the commits finished, until RUN_DIR/resume-STEP exists."""
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
