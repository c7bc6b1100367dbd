"""A push and a pull in milliseconds (issue 52): the parameter server against another revision
and against the floors of this machine, in one run.

``--before REF`` names another revision; its ``tenplex_jax`` is extracted into a temporary
directory and run from there, the working tree's from here, taking turns (``--rounds``
subprocesses per version). Each runs one VW over two stores on 127.0.0.1, pushing a wave and
then pulling, for GPT small's weights (14 leaves, 0.5 MiB; the median of ``8 * --repeats``
waves, the first not counted) and for 64 MiB in 8 leaves (the median of ``--repeats``):

- **push**: ``ps.push`` until it returns (the wave acknowledged); **added**: until the wave is
  also added into the weights (``ps.settle()``, where the push adds it behind its
  acknowledgement; the same as push where it does not);
- **pull**: ``ps.pull(ledger)`` with the ledger the push returned (what a VW does), once the
  wave is added; **pull, reading the ledger**: ``ps.pull()``, which reads it first;
- the working tree's push and pull also with ``sync=True`` (the stage and the ledger fsynced
  before the acknowledgement, as every push was before issue 52).

Beside them, each round, the floors of each size (``ps_floor``'s steps, in seconds: a pull
crosses from one process to another once, through a loopback TCP socket or a shared mapping; a
push crosses once, refuses non-finite values and adds), and a round trip of a one-byte request
to another process. Ratios are taken per round, then the median over the rounds.

    python -m tenplex_jax_benchmarks.ps_push --before REF [--rounds 3] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

from tenplex_jax_benchmarks.ps_floor import memory_floors
from tenplex_jax_benchmarks.ps_lean import socket_floor
from tenplex_jax_benchmarks.store_hardening import compare_main, compare_revisions

MIB = 1 << 20
OPS = ("push", "added", "pull", "pull, reading the ledger")

TRANSFERS = """
import inspect, json, pathlib, statistics, tempfile, time
import numpy as np
from tenplex_jax.multihost import store
from tenplex_jax.wsp import ParameterServer

def run(shapes, repeats, **options):
    weights = {{p: np.zeros(s, np.float32) for p, s in shapes.items()}}
    update = {{p: np.full(s, 1e-3, np.float32) for p, s in shapes.items()}}
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-ps-push-"))
    procs = [store.StoreProcess.start(root / f"s{{i}}") for i in range(2)]
    times = {{"push": [], "added": [], "pull": [], "pull, reading the ledger": []}}
    settle = getattr(ParameterServer, "settle", lambda ps: None)
    try:
        with ParameterServer([p.address for p in procs], **options) as ps:
            ps.create(weights, total=None)
            ps.update(lambda led: (led.join("b"), None))
            for wave in range(repeats + 1):
                ps.update(lambda led, wave=wave: led.claim("b", wave, 1))
                tic = time.perf_counter()
                ledger = ps.push("b", wave, update)
                times["push"].append(time.perf_counter() - tic)
                settle(ps)  # added behind the acknowledgement (a revision that has it)
                times["added"].append(time.perf_counter() - tic)
                tic = time.perf_counter()
                ps.pull(ledger)
                times["pull"].append(time.perf_counter() - tic)
                tic = time.perf_counter()
                ps.pull()
                times["pull, reading the ledger"].append(time.perf_counter() - tic)
    finally:
        for p in procs:
            p.kill()
    return {{k: statistics.median(v[1:]) for k, v in times.items()}}

small = {small}
large = {{f"w{{i}}": (64 * 2**20 // 4 // 8,) for i in range(8)}}
rows = {{"GPT small": run(small, 8 * {repeats}), "64 MiB": run(large, {repeats})}}
if "sync" in inspect.signature(ParameterServer).parameters:
    rows["GPT small, sync"] = run(small, 8 * {repeats}, sync=True)
    rows["64 MiB, sync"] = run(large, {repeats}, sync=True)
print(json.dumps(rows))
"""

PONG = """
import socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while conn.recv(1):
    conn.sendall(b"k")
"""


def round_trip(repeats: int = 200) -> float:
    """The median seconds of a one-byte request and its one-byte reply over loopback TCP to
    another process: what any request to a store costs at least."""
    import socket

    child = subprocess.Popen([sys.executable, "-c", PONG], stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(repeats + 1):
                tic = time.perf_counter()
                sock.sendall(b"p")
                assert sock.recv(1) == b"k"
                times.append(time.perf_counter() - tic)
    finally:
        child.kill()
        child.wait(timeout=30)
    return statistics.median(times[1:])


def floors(nbytes: int) -> dict[str, float]:
    """Seconds a push and a pull of ``nbytes`` cost at least (``ps_floor``'s composites)."""
    steps = memory_floors(nbytes)
    sock = socket_floor(nbytes)
    tcp = sock["send"] * steps["memcpy"] / sock["memcpy"]  # on this process's memcpy's scale
    besides = steps["refuse non-finite"] + steps["add, previous kept (mapped pages)"]
    mapped = steps["kept shared mapping, copied out"]
    return {
        "memcpy": steps["memcpy"],
        "push, loopback TCP socket": tcp + besides,
        "pull, loopback TCP socket": tcp,
        "pull, kept shared mapping": mapped,
    }


def gpt_small() -> dict[str, list[int]]:
    """GPT small's weights: leaf path -> shape (14 leaves, 0.5 MiB of float32)."""
    from tenplex_jax._src import tree
    from tenplex_jax_models import build_state

    paths, leaves, _ = tree.arrays(build_state("small", 3e-3, abstract=True)[1])
    return {p: list(x.shape) for p, x in zip(paths, leaves) if p.startswith("model/")}


def run_ps_push(before: str, rounds: int = 3, repeats: int = 5, log=print) -> dict:
    small = gpt_small()
    small_bytes = 4 * sum(math.prod(s) for s in small.values())
    measured: list[dict] = []

    def each_round():
        measured.append(
            {"round trip": round_trip(), "0.5 MiB": floors(small_bytes), "64 MiB": floors(64 * MIB)}
        )

    code = TRANSFERS.format(small=json.dumps(small), repeats=repeats)
    runs, _ = compare_revisions(before, rounds, code, "print('{}')", each_round=each_round)
    seconds = {
        version: {
            shape: {op: statistics.median(r[shape][op] for r in rows) for op in OPS}
            for shape in rows[0]
        }
        for version, rows in runs.items()
    }
    speedup = {
        shape: {
            op: statistics.median(b[shape][op] / a[shape][op] for b, a in zip(*runs.values()))
            for op in OPS
        }
        for shape in runs["before"][0]
    }
    floor = {
        key: {name: statistics.median(m[key][name] for m in measured) for name in measured[0][key]}
        for key in ("0.5 MiB", "64 MiB")
    }
    trip = statistics.median(m["round trip"] for m in measured)
    log(f"  a loopback round trip to another process: {trip * 1e3:.3f} ms")
    for shape, size in (("GPT small", "0.5 MiB"), ("64 MiB", "64 MiB")):
        b, a, f = seconds["before"][shape], seconds["after"][shape], floor[size]
        log(
            f"  {shape}: push {b['push'] * 1e3:.2f} -> {a['push'] * 1e3:.2f} ms "
            f"({speedup[shape]['push']:.2f}x; floor {f['push, loopback TCP socket'] * 1e3:.2f}), "
            f"added {b['added'] * 1e3:.2f} -> {a['added'] * 1e3:.2f} ms "
            f"({speedup[shape]['added']:.2f}x), "
            f"pull {b['pull'] * 1e3:.2f} -> {a['pull'] * 1e3:.2f} ms "
            f"({speedup[shape]['pull']:.2f}x; floors {f['pull, loopback TCP socket'] * 1e3:.2f} "
            f"by socket, {f['pull, kept shared mapping'] * 1e3:.2f} by a kept mapping)"
        )
        synced = seconds["after"].get(f"{shape}, sync")
        if synced is not None:
            log(
                f"  {shape}, fsynced before the ack: push {synced['push'] * 1e3:.2f} ms, "
                f"pull {synced['pull'] * 1e3:.2f} ms"
            )
    return {
        "kind": "ps_push",
        "before": before,
        "rounds": rounds,
        "repeats": repeats,
        "seconds": seconds,
        "before_over_after": speedup,
        "floors_seconds": floor,
        "round_trip_seconds": trip,
        "runs": runs,
        "floor_runs": measured,
    }


def main(argv=None) -> int:
    return compare_main(
        argv, __doc__, run_ps_push, repeats={"type": int, "default": 5, "help": "waves"}
    )


if __name__ == "__main__":
    sys.exit(main())
