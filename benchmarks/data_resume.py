"""What a new process needs to resume the data after a change: the dataset PTC's position, and
the time to find its rows of the next global batch, at several dataset sizes.

Tenplex serves each worker its re-partitioned dataset through a virtual file system. A launched
JAX job does not move samples at a change: global batch ``k`` is a pure function of the dataset,
the seed, the global batch and ``k``, so a process that joins reads the :class:`DataState` (a
few integers in the manifest) and computes which sample indices its rows hold; it reads those
samples from the source by index, as every process does at every step. This measures, per
dataset size ``N``: the state's bytes as saved, and the seconds from nothing to the first
batch's indices (a new ``DatasetPTC``, ``restore``, ``indices`` of the next batch, which
permutes the epoch: ``O(N)``), against the seconds of a steady batch's indices.

    python -m tenplex_jax_benchmarks.data_resume [--sizes 1e5,1e6,1e7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

import tenplex_jax as tj


class _Indexable:
    """A source of ``n`` samples with no bytes behind it: the dataset PTC only needs a length
    and integer indexing to compute an order (the samples are read later, by index)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        return np.zeros(np.shape(index), np.int32)


def run(sizes, global_batch: int = 512, repeats: int = 3) -> list[dict]:
    rows = []
    for n in sizes:
        source = _Indexable(int(n))
        trained = tj.DatasetPTC(source, global_batch, seed=7, fingerprint=f"n={n}")
        trained.step = 1000
        saved = json.dumps(trained.state().to_json())
        resume, steady = [], []
        for _ in range(repeats):
            tic = time.perf_counter()
            fresh = tj.DatasetPTC(source, global_batch, seed=7, fingerprint=f"n={n}")
            fresh.restore(tj.data.DataState.from_json(json.loads(saved)))
            first = fresh.indices(fresh.step)[0]
            resume.append(time.perf_counter() - tic)
            tic = time.perf_counter()
            fresh.indices(fresh.step + 1)
            steady.append(time.perf_counter() - tic)
        np.testing.assert_array_equal(first, trained.indices(1000)[0])  # the same rows
        rows.append(
            {
                "samples": int(n),
                "state_bytes": len(saved),
                "resume_seconds": min(resume),
                "steady_seconds": min(steady),
            }
        )
        print(
            f"  N={int(n):>11,}: state {len(saved)} B, resume {min(resume) * 1e3:8.2f} ms, "
            f"steady batch {min(steady) * 1e6:6.1f} us",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1e5,1e6,1e7,1e8")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = run([float(s) for s in args.sizes.split(",")])
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
