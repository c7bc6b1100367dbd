"""The least a parameter server's push and pull can cost on this machine, against a memcpy.

Issue 30 asks push and pull of 64 MiB each at 0.5 of a memcpy (``np.copyto`` into pages already
mapped). This measures, in one run, what each of them must do at its fastest, each step the
median of ``--repeats`` taking turns with a memcpy of the same bytes:

- **a crossing** from one process to another: once over a loopback TCP socket; read from a file
  in shared memory (``/dev/shm``) into a buffer; a new shared mapping of such a file copied out
  (what a store publishing each version of a piece as a new file would cost a reader); a mapping
  the reader keeps, copied out (what a store updating a piece in place in a segment both
  processes keep mapped would cost: the only crossing at a memcpy's speed);
- **what a push must do besides** (issue 29's rules, which stand): refuse an update holding NaN
  or Inf (``isfinite().all()`` over it), add it into the weights while the previous version is
  kept (into a second buffer already mapped; into fresh pages), and a crc32 of the bytes (what
  checks a transfer or a file).

The composite floors add the times of the steps no design can skip: a push crosses once, checks
and adds; a pull crosses once. Nothing here runs the store: these are the bounds any store on
this machine sits on, whatever its protocol.

    python -m tenplex_jax_benchmarks.ps_floor [--megabytes 64] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pathlib
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np

from tenplex_jax_benchmarks.ps_lean import socket_floor

MIB = 1 << 20


def _timed(steps: dict, repeats: int) -> dict[str, float]:
    """The median seconds of each of ``steps`` (name -> callable), every one taking its turn in
    each of ``repeats`` rounds (the first round not counted: it maps the pages)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats + 1):
        for name, step in steps.items():
            tic = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - tic)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def memory_floors(nbytes: int = 64 * MIB, repeats: int = 7) -> dict[str, float]:
    """Seconds of each step a push or a pull of ``nbytes`` of float32 takes at its fastest."""
    rng = np.random.default_rng(0)
    update = rng.standard_normal(nbytes // 4).astype(np.float32)
    weights = rng.standard_normal(nbytes // 4).astype(np.float32)
    out, kept = np.empty_like(update), np.empty_like(update)
    shm = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tenplex-ps-floor-", dir=shm) as root:
        piece = pathlib.Path(root) / "piece"
        piece.write_bytes(memoryview(update).cast("B"))
        with open(piece, "rb") as file:
            held = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
        views = [np.frombuffer(held, np.float32)]  # dropped before the mapping closes

        def read_file():
            with open(piece, "rb", buffering=0) as f:
                f.readinto(memoryview(out).cast("B"))

        def new_mapping():
            with open(piece, "rb") as f:
                mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            try:
                np.copyto(out, np.frombuffer(mapping, np.float32))
            finally:
                del mapping  # the view above is gone: the mapping may close

        crossings = {
            "read from shared memory": read_file,
            "new shared mapping, copied out": new_mapping,
            "kept shared mapping, copied out": lambda: np.copyto(out, views[0]),
        }
        try:
            for name, cross in crossings.items():  # each crossing timed hands over the bytes
                out.fill(np.nan)
                cross()
                if not np.array_equal(out, update):
                    raise AssertionError(f"{name}: the bytes copied out differ from the piece's")
            return _timed(
                {
                    "memcpy": lambda: np.copyto(out, update),
                    **crossings,
                    "refuse non-finite": lambda: bool(np.isfinite(update).all()),
                    "add, previous kept (mapped pages)": lambda: np.add(weights, update, out=kept),
                    "add, previous kept (fresh pages)": lambda: np.add(weights, update),
                    "crc32": lambda: zlib.crc32(memoryview(update).cast("B")),
                },
                repeats,
            )
        finally:
            views.clear()
            held.close()


def run(megabytes: int = 64, repeats: int = 7, log=print) -> dict:
    nbytes = megabytes * MIB
    steps = memory_floors(nbytes, repeats)
    sock = socket_floor(nbytes, repeats)
    steps["loopback TCP socket"] = sock["send"] * steps["memcpy"] / sock["memcpy"]  # same scale
    memcpy = steps["memcpy"]
    crossings = {
        name: steps[name]
        for name in (
            "loopback TCP socket",
            "read from shared memory",
            "new shared mapping, copied out",
            "kept shared mapping, copied out",
        )
    }
    besides = steps["refuse non-finite"] + steps["add, previous kept (mapped pages)"]
    floors = {f"pull, {name}": memcpy / seconds for name, seconds in crossings.items()} | {
        f"push, {name}": memcpy / (seconds + besides) for name, seconds in crossings.items()
    }
    for name, seconds in steps.items():
        log(f"  {name}: {seconds * 1e3:.2f} ms, memcpy ÷ this {memcpy / seconds:.2f}")
    for name, ratio in floors.items():
        log(f"  floor {name}: {ratio:.2f} of memcpy (goal 0.5)")
    return {
        "kind": "ps_floor",
        "bytes": nbytes,
        "repeats": repeats,
        "seconds": steps,
        "over_memcpy": {name: memcpy / seconds for name, seconds in steps.items()},
        "floors_over_memcpy": floors,
        "socket_run": sock,
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    print(f"a push's and a pull's floors, {args.megabytes} MiB, medians of {args.repeats}")
    row = run(args.megabytes, args.repeats)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
