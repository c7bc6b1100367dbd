"""Loop overhead: what tenplex_jax puts in a training loop against a plain jitted loop.

The tenplex_jax loop is the elastic loop between resizes: ``tj.ElasticJob`` owns the layout (the
state placed by its PTC), the dataset PTC and the step compiled for the layout; each step is
``job.next`` (pending events, then the global batch placed per device with padding weights) and
the job's step (the gradient from ``batch.value_and_grad``). It runs in plain data-parallel mode
(``grad_units=None``) and without compile-ahead, so that no background compile competes with the
timed steps; gradient units, which buy bitwise device independence with extra compute, are
measured in their own section of RESULTS.md. The plain loop is what a JAX user writes on the same
mesh: shardings from ``nnx.get_partition_spec`` under the same logical-axis rules, one ``jax.jit``
of ``nnx.value_and_grad`` of the mean loss, the same global batches put with ``jax.device_put``.
Both loops alternate in blocks of steps, so the machine's noise falls on both alike; the overhead
is the ratio of their median step times, minus one.
"""

from __future__ import annotations

import statistics
import time

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj


def run_loop_overhead(model_cfg, config: tj.ParallelConfig, batch: int, blocks: int, steps: int):
    """Median step seconds of both loops over ``blocks`` alternating blocks of ``steps`` steps."""
    import optax

    from tenplex_jax_models import (
        GPT,
        LOGICAL_RULES,
        corpus_samples,
        loss_fn,
        param_count,
        stdlib_corpus,
        train_step,
    )

    def build():
        with nnx.use_eager_sharding(False):
            gpt = GPT(model_cfg, rngs=nnx.Rngs(0))
            nodes = {
                "model": gpt,
                "optimizer": nnx.Optimizer(gpt, optax.adamw(1e-3), wrt=nnx.Param),
            }
        return nnx.split(nodes)

    samples = corpus_samples(stdlib_corpus(), model_cfg.seq_len, num_samples=batch * steps)
    dataset = tj.DatasetPTC(samples, batch, seed=0)
    devices = jax.devices()[: config.num_devices]
    plain_layout = tj.data.BatchLayout(batch, ranks=1)
    batches = [dataset.batch(i, plain_layout)[0] for i in range(steps)]  # the same global batches

    # tenplex_jax: the elastic loop on a fixed set of devices
    graphdef, state = build()
    job = tj.ElasticJob(
        LOGICAL_RULES,
        dataset,
        devices=devices,
        config=lambda n: config,
        options=tj.elastic.JobOptions(compile_ahead=False),
    )
    tenplex_state = job.start(state)
    tenplex_step = job.jit(train_step(graphdef))

    def tenplex_loop(state):
        job.dataset.step = 0  # every block replays the plain loop's global batches
        times = []
        for _ in range(steps):
            tic = time.perf_counter()
            state, b = job.next(state)
            state, metrics = tenplex_step(state, b)
            float(metrics["loss"])
            times.append(time.perf_counter() - tic)
        return state, times

    # plain JAX: the same model and mesh, shardings straight from NNX's metadata
    plain_graphdef, plain_state = build()
    mesh = config.make_mesh(devices)
    with nnx.logical_axis_rules(LOGICAL_RULES):
        specs = nnx.get_partition_spec(plain_state)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    plain_state = jax.device_put(plain_state, shardings)
    batch_sharding = NamedSharding(mesh, P(tj.data.BATCH_AXES))

    def plain_train_step(state, batch):
        nodes = nnx.merge(plain_graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(nodes["model"], batch)
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), loss

    plain_step = jax.jit(
        plain_train_step,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )

    def plain_loop(state):
        times = []
        for b in batches:
            tic = time.perf_counter()
            state, loss = plain_step(state, jax.device_put(b, batch_sharding))
            float(loss)
            times.append(time.perf_counter() - tic)
        return state, times

    tenplex_times, plain_times = [], []
    with job:  # its compile threads stop at the end
        tenplex_state, _ = tenplex_loop(tenplex_state)  # warm-up: compile both
        plain_state, _ = plain_loop(plain_state)
        for block in range(blocks):
            order = (tenplex_loop, plain_loop) if block % 2 == 0 else (plain_loop, tenplex_loop)
            for loop in order:
                if loop is tenplex_loop:
                    tenplex_state, times = loop(tenplex_state)
                    tenplex_times += times
                else:
                    plain_state, times = loop(plain_state)
                    plain_times += times
    tenplex_s, plain_s = statistics.median(tenplex_times), statistics.median(plain_times)
    return {
        "kind": "loop",
        "change": "loop overhead",
        "loop": "ElasticJob between resizes (job.next + job.jit step, plain DP)",
        "config": str(config),
        "params": param_count(state),
        "global_batch": batch,
        "seq_len": model_cfg.seq_len,
        "steps_each": len(tenplex_times),
        "median_seconds": {"tenplex": tenplex_s, "plain": plain_s},
        "overhead": tenplex_s / plain_s - 1,
    }
