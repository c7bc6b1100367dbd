"""Tensor store throughput against a local memcpy of the same bytes, in one run.

Store servers run as subprocesses on 127.0.0.1 (as the launcher runs them), each on a fresh
directory. Timed, per operation, the median of ``repeats`` runs of one array of ``nbytes``:

- ``put``: acknowledged from the memory tier (the default), timed with the disk writer idle;
- ``put_durable``: acknowledged once the file is written, fsynced and renamed;
- ``get``: the whole object, from the memory tier;
- ``get_sub``: a sub-box holding half the rows (the server slices and sends only those bytes);
- ``get_disk``: the whole object from a store whose memory tier is 0 bytes (read from the page
  cache, checksum verified);
- ``replicated_put``: ``ReplicatedStore.put`` with one replica (two stores written in parallel).

Every figure is also given as a ratio to ``np.copyto`` of the same bytes into a buffer whose pages
are mapped (``memcpy``), and into a fresh buffer (``memcpy_fresh``). Run alone with
``python -m benchmarks.store [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import tenplex_jax as tj


def _median_seconds(fn, repeats: int, between=None) -> float:
    """Median seconds of ``fn()``; ``between()`` runs untimed before each call."""
    runs = []
    for i in range(repeats + 1):  # the first call warms up (connections, page faults)
        if between is not None:
            between()
        tic = time.perf_counter()
        fn()
        if i:
            runs.append(time.perf_counter() - tic)
    return statistics.median(runs)


def run(quick: bool = False, repeats: int | None = None, log=print) -> dict:
    """One row: bytes per second per store operation and its ratio to memcpy."""
    nbytes = (32 if quick else 256) << 20
    repeats = repeats or (3 if quick else 5)
    rows = int(nbytes // (1024 * 4))
    array = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    half = ((0, rows // 2), (0, 1024))

    dst = np.empty_like(array)
    seconds = {"memcpy": _median_seconds(lambda: np.copyto(dst, array), repeats)}
    seconds["memcpy_fresh"] = _median_seconds(
        lambda: np.copyto(np.empty_like(array), array), repeats
    )

    with tempfile.TemporaryDirectory(prefix="tenplex-store-bench-") as root:
        procs = []
        try:
            procs = [tj.StoreProcess.start(f"{root}/s{i}", memory_bytes=4 * nbytes) for i in (0, 1)]
            procs.append(tj.StoreProcess.start(f"{root}/disk", memory_bytes=0))
            with (
                tj.StoreClient(procs[0].address) as client,
                tj.StoreClient(procs[2].address) as disk,
                tj.ReplicatedStore([p.address for p in procs[:2]], replicas=1) as replicated,
            ):
                # each put is timed with the disk writer idle (the previous put flushed, untimed):
                # the time to acknowledge; back-to-back puts are bound by the disk instead
                seconds["put"] = _median_seconds(
                    lambda: client.put("b/w", array), repeats, between=client.flush
                )
                seconds["put_durable"] = _median_seconds(
                    lambda: client.put("b/w", array, durable=True), repeats
                )
                seconds["get"] = _median_seconds(lambda: client.get("b/w"), repeats)
                seconds["get_sub"] = _median_seconds(lambda: client.get("b/w", half), repeats)
                disk.put("b/w", array, durable=True)
                seconds["get_disk"] = _median_seconds(lambda: disk.get("b/w"), repeats)
                seconds["replicated_put"] = _median_seconds(
                    lambda: replicated.put(0, "b/r", array), repeats, between=replicated.flush
                )
                if not np.array_equal(client.get("b/w", half), array[: rows // 2]):
                    raise AssertionError("the store returned other bytes than were put")
        finally:
            for proc in procs:
                proc.stop()

    moved = {name: nbytes for name in seconds}
    moved["get_sub"] = nbytes // 2
    bandwidth = {name: moved[name] / s for name, s in seconds.items()}
    row = {
        "kind": "store",
        "bytes": nbytes,
        "repeats": repeats,
        "median_seconds": seconds,
        "bytes_per_s": bandwidth,
        "vs_memcpy": {k: v / bandwidth["memcpy"] for k, v in bandwidth.items()},
        "vs_memcpy_fresh": {k: v / bandwidth["memcpy_fresh"] for k, v in bandwidth.items()},
        "replication_cost": seconds["replicated_put"] / seconds["put"],
    }
    log(
        f"tensor store ({nbytes >> 20} MiB, median of {repeats}): "
        + ", ".join(
            f"{k} {bandwidth[k] / 1e9:.2f} GB/s ({row['vs_memcpy'][k]:.2f}x memcpy)"
            for k in seconds
        )
        + f"; one replica costs {row['replication_cost']:.2f}x a single put"
    )
    return row


def summary_markdown(row: dict) -> str:
    lines = [
        (
            f"Tensor store, {row['bytes'] >> 20} MiB float32, median of {row['repeats']} "
            "(server subprocess on 127.0.0.1):"
        ),
        "",
        "| operation | ms | GB/s | / memcpy | / memcpy into a fresh buffer |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in row["median_seconds"].items():
        lines.append(
            f"| {name} | {s * 1e3:,.1f} | {row['bytes_per_s'][name] / 1e9:.2f} | "
            f"{row['vs_memcpy'][name]:.3f} | {row['vs_memcpy_fresh'][name]:.3f} |"
        )
    lines += ["", f"Replicated put (1 replica) / single put: {row['replication_cost']:.2f}x."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    row = run(args.quick, args.repeats)
    print(summary_markdown(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
