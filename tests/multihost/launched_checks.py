"""Run by tests/multihost/test_launch.py under ``tenplex-jax launch --nprocs 1``: the paths an
ElasticJob takes only in a launched process. Writes what it saw to RUN_DIR/checks.json."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tenplex_jax as tj


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    dataset = tj.DatasetPTC(np.arange(96, dtype=np.float32).reshape(24, 4), global_batch=8)
    seen = {"processes": jax.process_count()}
    try:
        tj.ElasticJob((), dataset, devices=jax.devices())
    except tj.errors.LayoutError as error:
        seen["devices_refused"] = str(error)
    with tj.ElasticJob((), dataset, checkpoint_dir=out / "ckpt") as job:
        seen["launched"], seen["kind"] = job.launched, type(job).__name__
        state = job.start(lambda: {"w": jnp.zeros((4,), jnp.float32)})
        try:
            job.preempt([0])
        except tj.errors.LayoutError as error:
            seen["preempt_refused"] = str(error)

        def step(state, batch):  # the weighted sum of the batch's rows, accumulated
            total = jnp.sum(batch.data * batch.weights[:, None], axis=0)
            return {"w": state["w"] + total}, {"loss": jnp.sum(total)}

        compiled = job.jit(step)
        while job.step < 2:
            state, batch = job.next(state)
            state, _ = compiled(state, batch)
        job.finish(state)
        seen["w"] = np.asarray(state["w"]).tolist()
        seen["step"] = job.step
    (out / "checks.json").write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
