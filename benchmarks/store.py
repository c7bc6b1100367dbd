"""Tensor store throughput against a local memcpy of the same bytes, in one run.

Store servers run as subprocesses on 127.0.0.1 (as the launcher runs them), each on a fresh
directory. Timed, per operation, the median of ``repeats`` runs of one array of ``nbytes``:

- ``put``: acknowledged from the memory tier (the default), timed with the disk writer idle;
- ``put_durable``: acknowledged once the file is written, fsynced and renamed;
- ``get``: the whole object, from the memory tier;
- ``get_sub``: a sub-box holding half the rows (the server slices and sends only those bytes);
- ``get_disk``: the whole object from a store whose memory tier is 0 bytes (read from the page
  cache, checksum verified);
- ``replicated_put``: ``ReplicatedStore.put`` with one replica (two stores written in parallel);
- ``put_unix`` / ``get_unix``: ``put`` and ``get`` over the server's Unix socket instead of TCP.

Every figure is also given as a ratio to ``np.copyto`` of the same bytes into a buffer whose pages
are mapped (``memcpy``), and into a fresh buffer (``memcpy_fresh``). Run alone with
``python -m tenplex_jax_benchmarks.store [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from tenplex_jax.multihost import store


def _interleaved_runs(ops: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each ``(fn, between)`` in ``ops``, ``repeats`` rounds after a warm-up round.

    The operations alternate within each round, so the machine's noise falls on all alike;
    ``between()`` runs untimed before its ``fn()``."""
    runs = {name: [] for name in ops}
    for round_ in range(repeats + 1):
        for name, (fn, between) in ops.items():
            if between is not None:
                between()
            tic = time.perf_counter()
            fn()
            if round_:
                runs[name].append(time.perf_counter() - tic)
    return runs


def _measure(root: str, array: np.ndarray, half, nbytes: int, repeats: int) -> dict:
    """Each store operation's seconds, ``repeats`` rounds taking turns, on servers in ``root``."""
    dst = np.empty_like(array)
    procs = []
    try:
        procs = [
            store.StoreProcess.start(
                f"{root}/s{i}", memory_bytes=4 * nbytes, unix_socket=f"{root}/s{i}.sock"
            )
            for i in (0, 1)
        ]
        procs.append(store.StoreProcess.start(f"{root}/disk", memory_bytes=0))
        with (
            store.StoreClient(procs[0].address) as client,
            store.StoreClient(procs[1].unix_address) as unix,
            store.StoreClient(procs[2].address) as disk,
            store.ReplicatedStore([p.address for p in procs[:2]], replicas=1) as replicated,
        ):
            disk.put("b/w", array, durable=True)
            # a put is timed with the disk writer idle (the previous put flushed, untimed):
            # the time to acknowledge; back-to-back puts are bound by the disk instead
            ops = {
                "memcpy": (lambda: np.copyto(dst, array), None),
                "memcpy_fresh": (lambda: np.copyto(np.empty_like(array), array), None),
                "put": (lambda: client.put("b/w", array), client.flush),
                "put_durable": (lambda: client.put("b/w", array, durable=True), None),
                "get": (lambda: client.get("b/w"), None),
                "get_sub": (lambda: client.get("b/w", half), None),
                "put_unix": (lambda: unix.put("b/w", array), unix.flush),
                "get_unix": (lambda: unix.get("b/w"), None),
                "get_disk": (lambda: disk.get("b/w"), None),
                "replicated_put": (lambda: replicated.put(0, "b/r", array), replicated.flush),
            }
            runs = _interleaved_runs(ops, repeats)
            if not np.array_equal(client.get("b/w", half), array[: half[0][1]]):
                raise AssertionError("the store returned other bytes than were put")
    finally:
        for proc in procs:
            proc.stop()
    return runs


def run(quick: bool = False, repeats: int | None = None, log=print) -> dict:
    """One row: bytes per second per store operation and its ratio to memcpy."""
    nbytes = (32 if quick else 256) << 20
    repeats = repeats or (3 if quick else 7)
    rows = int(nbytes // (1024 * 4))
    array = np.random.default_rng(0).standard_normal((rows, 1024), dtype=np.float32)
    half = ((0, rows // 2), (0, 1024))

    with tempfile.TemporaryDirectory(prefix="tenplex-store-bench-") as root:
        runs = _measure(root, array, half, nbytes, repeats)

    seconds = {name: statistics.median(r) for name, r in runs.items()}
    moved = dict.fromkeys(seconds, nbytes)
    moved["get_sub"] = nbytes // 2
    bandwidth = {name: moved[name] / s for name, s in seconds.items()}
    row = {
        "kind": "store",
        "bytes": nbytes,
        "repeats": repeats,
        "runs_seconds": runs,
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
