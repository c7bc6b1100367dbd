"""A new executable's first run against its later ones: GPT small on 8 fake CPU devices.

``python -m tenplex_jax_benchmarks.first_run compile|load DIR [plain|warm_zeros]``: the small GPT's
step for data=8, 6, 4, 7, 2, then 6 and 8 again, each compiled (``compile``: stored in the
executable cache ``DIR``) or loaded from ``DIR`` (``load``, after a ``compile`` run), as the elastic
loop does (``StepCache``, the state donated). Each layout runs 4 steps; per step, the call until it
returns (dispatch) and until its results are ready. ``warm_zeros`` runs each new executable once on
zeros first, as ``JobOptions.warm_up`` does. Prints one line per layout.
"""

from __future__ import annotations

import os
import sys
import time


def main(mode: str, directory: str, variant: str = "plain") -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np

    import tenplex_jax as tj
    from tenplex_jax._src.batch import Batch, device_batch
    from tenplex_jax._src.data import BatchLayout
    from tenplex_jax._src.elastic.executables import ExecutableCache
    from tenplex_jax._src.elastic.steps import StepCache
    from tenplex_jax._src.executor import place
    from tenplex_jax_models import (
        LOGICAL_RULES,
        build_state,
        corpus_samples,
        stdlib_corpus,
        train_step,
    )

    graphdef, state, cfg = build_state("small", 3e-3, 0)
    dataset = tj.DatasetPTC(corpus_samples(stdlib_corpus(), cfg.seq_len, 1000), 24, seed=0)
    devices = jax.devices()
    sample = jax.tree.map(np.asarray, dataset.load(np.zeros(1, np.int64)))
    executables = ExecutableCache(directory)
    cache = StepCache(train_step(graphdef), sample, devices, ("data",), executables)

    def layout(n):
        return BatchLayout(24, ranks=n, grad_units=8)

    def ptc_of(n):
        return tj.PTC.of(state, LOGICAL_RULES, tj.ParallelConfig(data=n), list(range(n)))

    def batch_for(n, step):
        mesh = ptc_of(n).mesh(devices[:n])
        data, weights, _ = device_batch(dataset, step, layout(n), mesh, ("data",))
        return Batch(data, weights, layout(n), mesh, ("data",))

    current, step = place(state, ptc_of(8)), 0
    for n in (8, 6, 4, 7, 2, 6, 8):
        target = ptc_of(n)
        new = StepCache.key(target, layout(n)) not in cache
        compiled = cache.get(target, layout(n), ahead=False).result()
        if new and variant == "warm_zeros":
            compiled = cache.warm_up(target, layout(n), compiled)
        current = jax.block_until_ready(
            jax.device_put(current, target.shardings(target.mesh(devices[:n])))
        )
        runs = []
        for _ in range(4):
            batch, step = batch_for(n, step), step + 1
            tic = time.perf_counter()
            current, metrics = compiled.executable(current, batch)
            dispatched = time.perf_counter()
            jax.block_until_ready((current, metrics))
            done = time.perf_counter()
            runs.append((round((dispatched - tic) * 1e3, 1), round((done - tic) * 1e3, 1)))
        warm = compiled.warm_up_seconds
        print(
            f"data={n} new={new} loaded={compiled.loaded} warm_up_ms="
            f"{None if warm is None else round(warm * 1e3, 1)} runs (dispatch ms, total ms): "
            f"{runs} load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    cache.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
