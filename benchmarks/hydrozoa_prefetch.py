"""Hydrozoa's data-prefetch thread, measured: one virtual worker (VW) training the GPT from a
dataset held in a tensor store (each sample one read over a socket on 127.0.0.1, as a worker
reads from remote storage), with and without ``WorkerOptions(prefetch=True)``.

Without it the VW reads and places each wave's minibatches after it claims the wave, while its
devices wait; with it a thread claims the next wave ahead (the ledger's lease ahead) once the
push before has committed, and reads and places it while the devices compute the current wave
and the push thread sends the last. The runs alternate (off, on, off, on, ...) so that a load
on the machine falls on both alike; each run's samples/s is its samples over the time from its
first wave's start to its last wave's end. Written: every run, the median of each mode and
their ratio, the load average, the prefetcher's hits and its thread's seconds.

    python -m tenplex_jax_benchmarks.hydrozoa_prefetch [--repeats 3] [--minibatches 48]
        [--out benchmarks/results/issue52/hydrozoa_prefetch.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import threading

import numpy as np


class StoredWindows:
    """A dataset source whose sample ``i`` is read from a tensor store: window ``i`` of the
    corpus (``seq_len + 1`` tokens), one ``get`` of its box per sample, a client per thread."""

    def __init__(self, address: str, path: str, shape: tuple[int, int]):
        self.address, self.path, self.shape = address, path, shape
        self._local = threading.local()

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        from tenplex_jax._src.multihost.store.client import StoreClient

        if not hasattr(self._local, "client"):
            self._local.client = StoreClient(self.address)
        window = self._local.client.get(self.path, box=((i, i + 1), (0, self.shape[1])))[0]
        return {"inputs": window[:-1], "targets": window[1:]}


def run(repeats: int, minibatches: int, nm: int, minibatch: int, model: str, log=print) -> dict:
    import jax

    import tenplex_jax as tj
    from tenplex_jax._src.elastic.steps import StepCache
    from tenplex_jax.multihost.store import StoreProcess
    from tenplex_jax.wsp import ParameterServer, weights_of
    from tenplex_jax_models import wsp as job_parts
    from tenplex_jax_models.data import stdlib_corpus

    parts = job_parts.job(2, model=model, minibatch=minibatch)
    seq = parts["dataset"].load(np.zeros(1, np.int64))["inputs"].shape[1]
    corpus = stdlib_corpus()
    n = min(4096, corpus.shape[0] // (seq + 1))
    windows = corpus[: n * (seq + 1)].reshape(n, seq + 1).astype(np.int32)
    state = parts["init"]()
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-prefetch-"))
    stores = [StoreProcess.start(root / "data")]  # the dataset's; each run's PS: 2 more
    runs = []
    try:
        data = stores[0].address
        with ParameterServer([data]) as put:  # (a client of the data store)
            put.clients[0].put("data/windows", windows)
        parts["dataset"] = tj.DatasetPTC(
            StoredWindows(data, "data/windows", windows.shape), minibatch, seed=0
        )
        sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
        steps = StepCache(parts["train_step"], sample, jax.devices()[:2], donate=False)
        for r in range(2 * repeats):
            prefetch = bool(r % 2)
            stores += [StoreProcess.start(root / f"run{r}-{i}") for i in range(2)]
            addresses = [s.address for s in stores[-2:]]
            with ParameterServer(addresses) as ps:
                ps.create(weights_of(state), total=minibatches)
                vw = job_parts.virtual_worker(
                    parts,
                    f"vw{r}",
                    [0, 1],
                    addresses,
                    state,
                    minibatches=nm,
                    steps=steps,
                    prefetch=prefetch,
                )
                records = vw.run()
                ledger = ps.history()
            assert sorted(ledger.trained()) == list(range(minibatches)), "not exactly once"
            samples = sum(len(rec.samples) for rec in records)
            seconds = max(rec.ended for rec in records) - min(rec.started for rec in records)
            pre = vw.prefetcher
            row = {
                "prefetch": prefetch,
                "samples": samples,
                "seconds": seconds,
                "samples_per_second": samples / seconds,
                "hits": None if pre is None else pre.hits,
                "misses": None if pre is None else pre.misses,
                "prefetch_thread_seconds": None if pre is None else pre.seconds,
                "compute_seconds": sum(rec.compute_seconds for rec in records),
                "push_wait_seconds": sum(rec.push_wait_seconds for rec in records),
                "peak_bytes_per_device": vw.memory.peak,
            }
            runs.append(row)
            log(
                f"run {r}: prefetch={prefetch} {row['samples_per_second']:.1f} samples/s "
                f"({samples} samples in {seconds:.2f} s, hits {row['hits']})"
            )
    finally:
        for store in stores:
            store.stop()
    median = {
        mode: statistics.median(x["samples_per_second"] for x in runs if x["prefetch"] == mode)
        for mode in (False, True)
    }
    return {
        "benchmark": "hydrozoa_prefetch",
        "model": model,
        "minibatch": minibatch,
        "minibatches": minibatches,
        "nm": nm,
        "devices": 2,
        "jax": jax.__version__,
        "loadavg": os.getloadavg(),
        "runs": runs,
        "samples_per_second_without": median[False],
        "samples_per_second_with": median[True],
        "ratio_with_over_without": median[True] / median[False],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--minibatches", type=int, default=48)
    parser.add_argument("--nm", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=32)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    out = run(args.repeats, args.minibatches, args.nm, args.minibatch, args.model)
    print(
        f"prefetch: {out['samples_per_second_with']:.1f} samples/s with, "
        f"{out['samples_per_second_without']:.1f} without: "
        f"{out['ratio_with_over_without']:.2f}x (load {out['loadavg'][0]:.1f})"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
