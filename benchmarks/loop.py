"""Loop overhead: what tenplex_jax puts in a training loop against a plain jitted loop.

The elastic training loop does not exist yet; what a tenplex_jax loop runs today, between resizes,
is the demo's path: the train state laid out by a PTC, the jitted step looked up in a cache keyed by
the layout (config, device ids, batch layout), the global batch read from the dataset PTC and
placed per device (``device_batch``), and the gradient from ``batch_value_and_grad`` with padding
weights. It runs in plain data-parallel mode (``workers=None``); virtual workers, which buy bitwise
device independence with extra compute, are measured in their own section of RESULTS.md. The plain
loop is what a JAX user writes on the same mesh: shardings from ``nnx.get_partition_spec`` under the
same logical-axis rules, one ``jax.jit`` of ``nnx.value_and_grad`` of the mean loss, the same global
batches put with ``jax.device_put``. Both loops alternate in blocks of steps, so the machine's noise
falls on both alike; the overhead is the ratio of their median step times, minus one.

When the elastic loop lands, ``tenplex_loop`` below is the function to point at it.
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

    from tenplex_jax_models import GPT, LOGICAL_RULES, corpus_samples, loss_fn, stdlib_corpus
    from tenplex_jax.data import BatchLayout, DatasetPTC
    from tenplex_jax.batch import BATCH_AXES
    from tenplex_jax_models import make_train_step, param_count
    from tenplex_jax.batch import device_batch

    def build():
        with nnx.use_eager_sharding(False):
            gpt = GPT(model_cfg, rngs=nnx.Rngs(0))
            nodes = {
                "model": gpt,
                "optimizer": nnx.Optimizer(gpt, optax.adamw(1e-3), wrt=nnx.Param),
            }
        return nnx.split(nodes)

    samples = corpus_samples(stdlib_corpus(), model_cfg.seq_len, num_samples=batch * steps)
    dataset = DatasetPTC(samples, batch, seed=0)
    devices = jax.devices()[: config.num_devices]
    plain_layout = BatchLayout(batch, ranks=1)
    batches = [dataset.batch(i, plain_layout)[0] for i in range(steps)]  # the same global batches

    # tenplex_jax: PTC layout, step cache keyed by layout, batch placed with the layout's sharding
    graphdef, state = build()
    ptc = tj.PTC.of(state, LOGICAL_RULES, config, devices)
    tenplex_state = tj.place(state, ptc)
    cache: dict = {}

    def tenplex_loop(state):
        times = []
        for i in range(steps):
            tic = time.perf_counter()
            layout = BatchLayout(batch, ranks=ptc.config.data * ptc.config.fsdp, workers=None)
            key = (str(ptc.config), ptc.device_ids, layout)
            if key not in cache:
                cache[key] = make_train_step(graphdef, ptc, layout)
            rows, weights, _ = device_batch(dataset, i, layout, ptc.mesh(), BATCH_AXES)
            state, loss = cache[key](state, rows, weights)
            float(loss)
            times.append(time.perf_counter() - tic)
        return state, times

    # plain JAX: the same step function and mesh, shardings straight from NNX's metadata
    plain_graphdef, plain_state = build()
    mesh = config.make_mesh(devices)
    with nnx.logical_axis_rules(LOGICAL_RULES):
        specs = nnx.get_partition_spec(plain_state)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    plain_state = jax.device_put(plain_state, shardings)
    batch_sharding = NamedSharding(mesh, P(BATCH_AXES))

    def train_step(state, batch):
        nodes = nnx.merge(plain_graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(nodes["model"], batch)
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), loss

    plain_step = jax.jit(
        train_step,
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

    tenplex_state, _ = tenplex_loop(tenplex_state)  # warm-up: compile both
    plain_state, _ = plain_loop(plain_state)
    tenplex_times, plain_times = [], []
    for block in range(blocks):
        first, second = (tenplex_loop, plain_loop) if block % 2 == 0 else (plain_loop, tenplex_loop)
        for loop in (first, second):
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
        "loop": "demo path (PTC layout, step cache, dataset PTC + device_batch, plain DP)",
        "config": str(config),
        "params": param_count(state),
        "global_batch": batch,
        "seq_len": model_cfg.seq_len,
        "steps_each": len(tenplex_times),
        "median_seconds": {"tenplex": tenplex_s, "plain": plain_s},
        "overhead": tenplex_s / plain_s - 1,
    }
