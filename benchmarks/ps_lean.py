"""A lean parameter server against another revision, in one run: transfers and the ledger's traffic.

``--before REF`` names another revision; its ``tenplex_jax`` is extracted into a temporary
directory and run from there, the working tree's from here, taking turns (``--rounds``
subprocesses per version for the transfers):

- **transfers**: one VW pushing and pulling 64 MiB of float32 weights over two stores (each
  pull right after its push, while the stores write the push back to disk, and again once they
  have: ``pull, stores idle``), as 8
  leaves of 8 MiB and as one leaf of 64 MiB (a leaf kept whole lives in one store; cut by bytes
  it spreads over both), and GPT small's weights (14 leaves, 0.5 MiB: a push's time is its
  requests' there, not its bytes'); the median over ``--repeats`` waves (4x for GPT small; the
  first not counted) against a memcpy (``np.copyto``) of the same bytes measured in the same
  process. Beside them, the
  floors any store on this machine sits on, each against a memcpy measured beside it: the same
  bytes sent once over a loopback TCP socket to another process (a push or a pull crosses one
  at least), written to a file and fsynced (a durable push's stage reaches disk before its
  commit) and checksummed (crc32: every transfer is checked on arrival).
- **the ledger's traffic**: the WSP benchmark's run (``benchmarks/wsp.py``: three VWs as
  threads, ``D = 1``, vw3 2x slow, heartbeats every 0.75 s) with every JSON request its store
  clients make counted by kind: the bytes written to the ledger per committed wave and its size at
  the end (it grew with the run before compaction), the ledger reads per wave, the heartbeat
  and log-segment writes.

    python -m tenplex_jax_benchmarks.ps_lean --before REF [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tenplex_jax_benchmarks.store_hardening import compare_main, compare_revisions

MIB = 1 << 20

# ``lambda led, *now``: the revision before takes ``change(ledger, now)`` and ``join(vw, now)``
TRANSFERS = """
import json, pathlib, statistics, tempfile, time
import numpy as np
from tenplex_jax.multihost import store
from tenplex_jax.wsp import ParameterServer

def run(shapes, repeats):
    weights = {{p: np.zeros(s, np.float32) for p, s in shapes.items()}}
    update = {{p: np.full(s, 1e-3, np.float32) for p, s in shapes.items()}}
    n = sum(w.size for w in weights.values())
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-ps-"))
    procs = [store.StoreProcess.start(root / f"s{{i}}") for i in range(2)]
    try:
        with ParameterServer([p.address for p in procs]) as ps:
            ps.create(weights, total=None)
            ps.update(lambda led, *now: (led.join("b", *now), None))
            push, pull, idle, copy = [], [], [], []
            src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
            for wave in range(repeats + 1):
                ps.update(lambda led, *now, wave=wave: led.claim("b", wave, 1))
                tic = time.perf_counter()
                ps.push("b", wave, update)
                push.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                ps.pull()
                pull.append(time.perf_counter() - tic)
                for client in ps.clients:  # the stores' write-back of the push done
                    client.flush()
                tic = time.perf_counter()
                ps.pull()
                idle.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                np.copyto(dst, src)
                copy.append(time.perf_counter() - tic)
    finally:
        for p in procs:
            p.kill()
    medians = {{"push": push, "pull": pull, "pull, stores idle": idle, "memcpy": copy}}
    return {{k: statistics.median(v[1:]) for k, v in medians.items()}}

def even(leaves):
    return {{f"w{{i}}": (64 * 2**20 // 4 // leaves,) for i in range(leaves)}}

def gpt_small():
    from tenplex_jax._src import tree
    from tenplex_jax_models import build_state
    paths, leaves, _ = tree.arrays(build_state("small", 3e-3, abstract=True)[1])
    return {{p: tuple(x.shape) for p, x in zip(paths, leaves) if p.startswith("model/")}}

print(json.dumps({{
    "8 leaves": run(even(8), {repeats}),
    "1 leaf": run(even(1), {repeats}),
    "GPT small's weights": run(gpt_small(), 4 * {repeats}),
}}))
"""

LEDGER = """
import json, collections
from tenplex_jax.multihost.store import StoreClient as Client
from tenplex_jax_benchmarks.suite import configure_jax
configure_jax()
from tenplex_jax_benchmarks import wsp

counts = collections.Counter()

def kind(path):
    if path == "wsp/ledger":
        return "ledger"
    if path.startswith("wsp/beat/"):
        return "beats"
    if path.startswith("wsp/log/"):
        return "log segments"
    return "other"

def counted(name, method):
    def call(self, path, *args, **kwargs):
        out = method(self, path, *args, **kwargs)
        if name in ("cas_json", "put_json"):
            counts[f"{{kind(path)}} write bytes"] += len(json.dumps(args[0]).encode())
            counts[f"{{kind(path)}} last write bytes"] = len(json.dumps(args[0]).encode())
            counts[f"{{kind(path)}} writes"] += 1
        else:
            counts[f"{{kind(path)}} reads"] += 1
        return out
    return call

for name in ("cas_json", "put_json", "get_json"):
    setattr(Client, name, counted(name, getattr(Client, name)))
row = wsp.run_wsp("small", {total}, 1, 2.0, 8, log=lambda *a: None)
print(json.dumps({{"waves": row["waves"], "seconds": row["seconds"],
                  "samples_per_second": row["samples_per_second"], "counts": dict(counts)}}))
"""

RECEIVER = """
import socket, sys
n = int(sys.argv[1])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
buffer = memoryview(bytearray(n))
while True:
    got = 0
    while got < n:
        k = conn.recv_into(buffer[got:], n - got)
        if not k:
            sys.exit(0)
        got += k
    conn.sendall(b"k")
"""


def socket_floor(nbytes: int = 64 * MIB, repeats: int = 7) -> dict:
    """Seconds to send ``nbytes`` once over loopback TCP to another process (acknowledged), and
    a memcpy of the same bytes, each the median of ``repeats`` taking turns."""
    import socket

    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(child.stdout.readline())
        src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        send, copy = [], []
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            for _ in range(repeats + 1):
                tic = time.perf_counter()
                sock.sendall(memoryview(src).cast("B"))
                assert sock.recv(1) == b"k"
                send.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                np.copyto(dst, src)
                copy.append(time.perf_counter() - tic)
    finally:
        child.kill()
        child.wait(timeout=30)
    return {"send": statistics.median(send[1:]), "memcpy": statistics.median(copy[1:])}


def local_floors(nbytes: int = 64 * MIB, repeats: int = 7) -> dict:
    """Seconds to write ``nbytes`` to a new file in the temporary directory and fsync it, to
    crc32 them, and to memcpy them; each the median of ``repeats`` taking turns."""
    import os
    import zlib

    src, dst = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times: dict = {"fsync": [], "crc32": [], "memcpy": []}
    with tempfile.TemporaryDirectory(prefix="tenplex-floor-") as root:
        for i in range(repeats + 1):
            tic = time.perf_counter()
            with open(os.path.join(root, str(i)), "wb") as f:
                f.write(memoryview(src).cast("B"))
                f.flush()
                os.fsync(f.fileno())
            times["fsync"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            zlib.crc32(src)
            times["crc32"].append(time.perf_counter() - tic)
            tic = time.perf_counter()
            np.copyto(dst, src)
            times["memcpy"].append(time.perf_counter() - tic)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def run_ps_lean(before: str, rounds: int = 3, repeats: int = 5, total: int = 161, log=print):
    floors = []
    transfers, ledger = compare_revisions(
        before,
        rounds,
        TRANSFERS.format(repeats=repeats),
        LEDGER.format(total=total),
        each_round=lambda: floors.append(socket_floor() | {"local": local_floors()}),
    )
    ratios: dict = {}
    for version, runs in transfers.items():
        for shape in runs[0]:
            for op in ("push", "pull", "pull, stores idle"):
                # each run's bytes/s over its own memcpy's, then the median over the rounds
                ratios.setdefault(version, {})[f"{op}, {shape}"] = statistics.median(
                    r[shape]["memcpy"] / r[shape][op] for r in runs
                )
    floor = {
        "socket": statistics.median(f["memcpy"] / f["send"] for f in floors),
        "fsync": statistics.median(f["local"]["memcpy"] / f["local"]["fsync"] for f in floors),
        "crc32": statistics.median(f["local"]["memcpy"] / f["local"]["crc32"] for f in floors),
    }
    per_wave = {}
    for version, row in ledger.items():
        c, waves = row["counts"], row["waves"]
        per_wave[version] = {
            "ledger bytes written per wave": c.get("ledger write bytes", 0) / waves,
            "ledger writes per wave": c.get("ledger writes", 0) / waves,
            "ledger reads per wave": c.get("ledger reads", 0) / waves,
            "heartbeat bytes written per wave": c.get("beats write bytes", 0) / waves,
            "log segment bytes written per wave": c.get("log segments write bytes", 0) / waves,
            "ledger bytes at the end": c.get("ledger last write bytes", 0),
            "samples_per_second": row["samples_per_second"],
        }
    log(
        f"  floors ÷ memcpy: one loopback TCP crossing {floor['socket']:.2f}, a write and fsync "
        f"{floor['fsync']:.2f}, crc32 {floor['crc32']:.2f}"
    )
    seconds: dict = {}
    for version, runs in transfers.items():
        for shape in runs[0]:
            for op in ("push", "pull", "pull, stores idle"):
                seconds.setdefault(version, {})[f"{op}, {shape}"] = statistics.median(
                    r[shape][op] for r in runs
                )
    for key in ratios["after"]:
        log(
            f"  {key} ÷ memcpy: before {ratios['before'][key]:.3f}, "
            f"after {ratios['after'][key]:.3f}; ms: before {seconds['before'][key] * 1e3:.1f}, "
            f"after {seconds['after'][key] * 1e3:.1f}"
        )
    for key in per_wave["after"]:
        log(f"  {key}: before {per_wave['before'][key]:.1f}, after {per_wave['after'][key]:.1f}")
    return {
        "kind": "ps_lean",
        "before": before,
        "rounds": rounds,
        "floors_over_memcpy": floor,
        "over_memcpy": ratios,
        "seconds": seconds,
        "transfers": transfers,
        "floor_runs": floors,
        "ledger_per_wave": per_wave,
        "ledger_runs": ledger,
    }


def main(argv=None) -> int:
    repeats, minibatches = {"type": int, "default": 5}, {"type": int, "default": 161}
    return compare_main(argv, __doc__, run_ps_lean, repeats=repeats, minibatches=minibatches)


if __name__ == "__main__":
    sys.exit(main())
