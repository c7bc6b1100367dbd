"""What checking a shared read costs: a reader's copy out of its segments with the check against
without, in one process, taking turns.

The parameter server's pull of 64 MiB of float32 through shared memory is, at the client, one
``shared.Reader.read`` per leaf into a new buffer (fresh pages), the two stores' leaves on a
thread each. This benchmark publishes the same leaves in segments (``shared.Segments``, as a
store does) and reads them as the pull does, three ways, taking turns (each first in turn):

- ``unchecked``: the copy alone (one ``np.copyto``, as the readers did before any check);
- ``crc32``: the copy and the crc32 of each chunk while it is in the cache (issue 49's first
  check, against the record's checksum);
- ``xxh3``: ``shared.copy_digest``, the check the readers run (the digest the store named).

Rows: 8 leaves of 8 MiB over 2 threads, and one leaf of 64 MiB on one. Each figure is the
median over ``--repeats`` rounds of the read's time against a ``np.copyto`` of the same bytes
into fresh pages timed beside it; the check's cost is checked ÷ unchecked.

    python -m tenplex_jax_benchmarks.shared_check [--repeats 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from tenplex_jax._src import checksums
from tenplex_jax._src.multihost.store import shared

MIB = 1 << 20


def _unchecked(dst: np.ndarray, src: np.ndarray) -> str:
    np.copyto(dst, src)
    return "unchecked"


def _crc32(dst: np.ndarray, src: np.ndarray) -> str:
    crc = 0
    for start in range(0, dst.size, shared.COPY_CHUNK_BYTES):
        chunk = dst[start : start + shared.COPY_CHUNK_BYTES]
        np.copyto(chunk, src[start : start + shared.COPY_CHUNK_BYTES])
        crc = checksums.crc32(chunk, crc)
    return checksums.text(crc)


WAYS = {"unchecked": _unchecked, "crc32": _crc32, "xxh3": shared.copy_digest}


def _timed_read(reader, segments, wants: list, leaves: list, threads: int) -> float:
    """Seconds to read ``leaves`` (their segments' files and wanted digests in ``wants``) into
    new buffers, on ``threads`` threads (the stores of a pull)."""
    outs = [np.empty_like(leaf) for leaf in leaves]

    def read(mine):
        for i in mine:
            file, want = wants[i]
            assert reader.read(file, segments.epoch, 1, want, outs[i]), file

    workers = [
        threading.Thread(target=read, args=(range(t, len(leaves), threads),))
        for t in range(threads)
    ]
    tic = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - tic


def run(repeats: int = 15, log=print) -> dict:
    shm = shared.SHM if pathlib.Path(shared.SHM).is_dir() else tempfile.mkdtemp()
    rows = {"8 leaves, 2 threads": (8, 8 * MIB, 2), "1 leaf, 1 thread": (1, 64 * MIB, 1)}
    segments = shared.Segments(1 << 30, shm)
    reader = shared.Reader()
    times: dict = {row: {way: [] for way in [*WAYS, "memcpy"]} for row in rows}
    order = list(WAYS.items())
    try:
        for row, (count, nbytes, threads) in rows.items():
            leaves = [
                np.random.default_rng(i).random(nbytes // 4, np.float32) for i in range(count)
            ]
            wants = [], {"unchecked": [], "crc32": []}
            for i, leaf in enumerate(leaves):  # published with the store's own check
                file, digest = segments.publish(f"{row}/{i}", 1, leaf)
                wants.setdefault("xxh3", []).append((file, digest))
                wants["unchecked"].append((file, "unchecked"))
                wants["crc32"].append(
                    (file, _crc32(np.empty_like(leaf).view(np.uint8), leaf.view(np.uint8)))
                )
            for r in range(repeats):
                for way, copy in order[r % 3 :] + order[: r % 3]:  # each way first in turn
                    shared.copy_digest = copy  # the reader's check, for this read
                    try:
                        seconds = _timed_read(reader, segments, wants[way], leaves, threads)
                    finally:
                        shared.copy_digest = WAYS["xxh3"]
                    times[row][way].append(seconds)
                src, dst = np.concatenate(leaves), np.empty(count * nbytes // 4, np.float32)
                tic = time.perf_counter()
                np.copyto(dst, src)
                times[row]["memcpy"].append(time.perf_counter() - tic)
    finally:
        reader.close()
        segments.close()
    result: dict = {"kind": "shared_check", "repeats": repeats, "rows": {}}
    for row, by_way in times.items():
        memcpy = statistics.median(by_way["memcpy"])
        over = {way: memcpy / statistics.median(by_way[way]) for way in WAYS}
        cost = {way: over[way] / over["unchecked"] for way in ("crc32", "xxh3")}
        result["rows"][row] = {"over_memcpy": over, "checked_over_unchecked": cost}
        log(
            f"  {row}: ÷ memcpy unchecked {over['unchecked']:.3f}, crc32 {over['crc32']:.3f}, "
            f"xxh3 {over['xxh3']:.3f}; checked ÷ unchecked: crc32 {cost['crc32']:.3f}, "
            f"xxh3 {cost['xxh3']:.3f}"
        )
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args.repeats)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
