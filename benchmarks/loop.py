"""Loop overhead: what tenplex_jax puts in a training loop against a plain jitted loop.

The tenplex_jax loop is the elastic loop between resizes: ``tj.ElasticJob`` owns the layout (the
state placed by its PTC), the dataset PTC and the step compiled for the layout; each step is
``job.next`` (pending events, then the global batch placed per device with padding weights) and
the job's step. The plain loop is what a JAX user writes on the same mesh: the same step
function under one ``jax.jit`` with the shardings ``nnx.get_partition_spec`` gives under the same
logical-axis rules, and the same global batches put with ``jax.device_put`` (as a ``tj.Batch`` of
the job's batch layout, which the step's ``batch.value_and_grad`` reads). So the two loops run
the same program on the same arrays; what differs is the loop around it. Both wait for each
step's loss, as a loop that logs it does.

Four variants, each its own pair of loops:
- ``grad_units``: None (plain data parallelism) or a number of gradient units (the bitwise
  mode's virtual workers: the same step, its gradient summed unit by unit);
- ``compile_ahead``: off, or *running*: a layout announced with ``job.expect`` compiles on the
  job's background thread through the timed blocks of both loops (a new one is announced
  whenever the last is ready), so the overhead is measured with compile-ahead's tracing,
  lowering and compiling beside the steps. The share of blocks that ran beside a compile is
  recorded.

Both loops alternate in blocks of steps, so the machine's noise, and a background compile, fall
on both alike. The overhead is the median over the pairs of adjacent blocks of the ratio of
their median step times, minus one: a load that comes and goes on a shared machine shifts both
blocks of a pair, not the ratio (``overhead_pooled``, the ratio of the medians over all steps,
is kept beside it).
"""

from __future__ import annotations

import itertools
import statistics
import time

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj


def _announcements(devices: int):
    """Device sets for ``job.expect``, each a layout not compiled before: every subset of the
    devices, fewest left out first."""
    for left in range(1, devices):
        yield from itertools.combinations(range(devices), devices - left)


def run_loop_overhead(
    model_cfg,
    config: tj.ParallelConfig,
    batch: int,
    blocks: int,
    steps: int,
    *,
    grad_units: int | None = None,
    compile_ahead: bool = False,
):
    """Median step seconds of both loops over ``blocks`` alternating blocks of ``steps`` steps."""
    import optax

    from tenplex_jax_models import (
        GPT,
        LOGICAL_RULES,
        corpus_samples,
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

    # tenplex_jax: the elastic loop on a fixed set of devices
    graphdef, state = build()
    job = tj.ElasticJob(
        LOGICAL_RULES,
        dataset,
        devices=devices,
        grad_units=grad_units,
        config=lambda n: config if n == len(devices) else tj.ParallelConfig(data=n),
        options=tj.elastic.JobOptions(compile_ahead=compile_ahead),
    )
    tenplex_state = job.start(state)
    tenplex_step = job.jit(train_step(graphdef))
    layout, axes = job.layout, tuple(job.options.batch_axes)

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

    # plain JAX: the same step and mesh, shardings straight from NNX's metadata
    plain_graphdef, plain_state = build()
    mesh = config.make_mesh(devices)
    with nnx.logical_axis_rules(LOGICAL_RULES):
        specs = nnx.get_partition_spec(plain_state)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    plain_state = jax.device_put(plain_state, shardings)
    batch_sharding = NamedSharding(mesh, P(axes))
    host = [dataset.batch(i, layout)[:2] for i in range(steps)]  # the same global batches
    plain_step = jax.jit(
        train_step(plain_graphdef),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )

    def plain_loop(state):
        times = []
        for data, weights in host:
            tic = time.perf_counter()
            data, weights = jax.device_put((data, weights), batch_sharding)
            state, metrics = plain_step(state, tj.Batch(data, weights, layout, mesh, axes))
            float(metrics["loss"])
            times.append(time.perf_counter() - tic)
        return state, times

    announce = _announcements(len(devices))
    expected = None
    beside, tenplex_times, plain_times, pairs = 0, [], [], []
    with job:  # its compile threads stop at the end
        tenplex_state, _ = tenplex_loop(tenplex_state)  # warm-up: compile both
        plain_state, _ = plain_loop(plain_state)
        for block in range(blocks):
            order = (tenplex_loop, plain_loop) if block % 2 == 0 else (plain_loop, tenplex_loop)
            medians = {}
            for loop in order:
                if compile_ahead and (expected is None or job.is_compiled(expected)):
                    expected = next(announce)
                    job.expect(expected)
                if loop is tenplex_loop:
                    tenplex_state, times = loop(tenplex_state)
                    tenplex_times += times
                else:
                    plain_state, times = loop(plain_state)
                    plain_times += times
                medians[loop] = statistics.median(times)
                beside += compile_ahead and not job.is_compiled(expected)
            pairs.append(medians[tenplex_loop] / medians[plain_loop])
    tenplex_s, plain_s = statistics.median(tenplex_times), statistics.median(plain_times)
    return {
        "kind": "loop",
        "change": "loop overhead",
        "loop": "ElasticJob between resizes (job.next + job.jit step)",
        "config": str(config),
        "grad_units": grad_units,
        "compile_ahead": "running" if compile_ahead else "off",
        "blocks_beside_a_compile": f"{beside}/{2 * blocks}" if compile_ahead else None,
        "params": param_count(state),
        "global_batch": batch,
        "seq_len": model_cfg.seq_len,
        "steps_each": len(tenplex_times),
        "median_seconds": {"tenplex": tenplex_s, "plain": plain_s},
        "overhead_pooled": tenplex_s / plain_s - 1,
        "overhead_by_pair": [r - 1 for r in pairs],
        "overhead": statistics.median(pairs) - 1,
    }


def describe(row: dict) -> str:
    """One line of a loop row."""
    units = f"{row['grad_units']} units" if row["grad_units"] else "plain DP"
    ahead = row["compile_ahead"]
    if row["blocks_beside_a_compile"]:
        ahead += f" ({row['blocks_beside_a_compile']} blocks beside a compile)"
    return (
        f"  {units}, compile-ahead {ahead}: tenplex "
        f"{row['median_seconds']['tenplex'] * 1e3:.2f} ms/step, plain "
        f"{row['median_seconds']['plain'] * 1e3:.2f} ms/step, overhead {row['overhead']:+.2%}"
    )
