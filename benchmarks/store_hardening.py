"""The tensor store before and after a change, in one run: throughput, and memory under attack.

``--before REF`` names another revision of this repository (a commit, a tag); its ``tenplex_jax``
is extracted into a temporary directory and its servers and clients run from there, the working
tree's from here, the two taking turns:

- **throughput**: ``benchmarks/store.py``'s operations (put, get, sub-box get, disk get, Unix
  socket, replicated put), each as a ratio to memcpy of the same bytes measured in the same
  process, ``--rounds`` subprocesses per version, alternating;
- **memory under attack**: a server with a 64 MiB memory tier, then 20 puts of 40 MiB that send
  their body but never the checksum trailer, then 8 gets of 40 MiB disk objects whose replies are
  never read; the growth of the server's peak RSS (VmHWM) over its idle peak.

    python -m tenplex_jax_benchmarks.store_hardening --before REF [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MIB = 1 << 20
ATTACK_TIER, ATTACK_OBJECT = 64 * MIB, 40 * MIB
HERE = pathlib.Path(__file__).resolve().parents[1]


def _tree(ref: str, root: pathlib.Path) -> pathlib.Path:
    """The ``tenplex_jax`` package of revision ``ref``, extracted under ``root``."""
    archive = subprocess.run(
        ["git", "-C", str(HERE), "archive", ref, "tenplex_jax"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def _in(tree: pathlib.Path, code: str) -> dict:
    """Run ``code`` (which prints one JSON object last) with ``tree``'s tenplex_jax."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(HERE)]))
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare_revisions(
    before: str,
    rounds: int,
    alternated: str,
    once: str,
    *,
    each_round: Callable[[], object] = lambda: None,
    once_may_fail: bool = False,
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Revision ``before``'s ``tenplex_jax`` against the working tree's, in one run: ``alternated``
    (code that prints one JSON object last) run ``rounds`` times with each, the two taking turns
    (``each_round()`` after each round), then ``once`` once with each; ``(runs, onces)``, each
    keyed by ``"before"`` and ``"after"``: ``alternated``'s objects and ``once``'s object. With
    ``once_may_fail``, a version whose ``once`` exits with an error is left out of ``onces``."""
    with tempfile.TemporaryDirectory(prefix="tenplex-before-") as root:
        trees = {"before": _tree(before, pathlib.Path(root)), "after": HERE}
        runs: dict = {v: [] for v in trees}
        for _ in range(rounds):
            for version, tree in trees.items():
                runs[version].append(_in(tree, alternated))
            each_round()
        onces: dict = {}
        failed = (subprocess.CalledProcessError,) if once_may_fail else ()
        for version, tree in trees.items():
            with contextlib.suppress(*failed):
                onces[version] = _in(tree, once)
    return runs, onces


def compare_main(argv, doc: str, run: Callable[..., dict], **options: dict) -> int:
    """The command line of a benchmark comparing revisions: ``--before REF``, ``--rounds``, each
    of ``options`` (an option's name -> ``add_argument``'s keywords) and ``--out FILE``; the row
    ``run(before, rounds, *options' values)`` written to ``--out`` as JSON."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    for name, keywords in options.items():
        parser.add_argument(f"--{name}", **keywords)
    parser.add_argument("--out", help="write the row as JSON here")
    args = parser.parse_args(argv)
    row = run(args.before, args.rounds, *(getattr(args, name) for name in options))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(row, indent=1))
    return 0


THROUGHPUT = """
import json
from benchmarks.store import run
row = run(quick={quick}, log=lambda *a: None)
print(json.dumps(row["vs_memcpy"]))
"""

ATTACK = """
import json, sys
sys.path.insert(1, {here!r})
from benchmarks.store_hardening import attack
print(json.dumps(attack()))
"""


def attack() -> dict:
    """Peak RSS growth (bytes) of a server over its idle peak under each attack (a fresh server
    for each), run with this process's ``tenplex_jax`` (whichever version its path gives)."""
    import numpy as np

    from tenplex_jax._src.multihost.store import wire

    body = np.ones(ATTACK_OBJECT, np.uint8)
    with tempfile.TemporaryDirectory(prefix="tenplex-attack-") as root:
        with _server(f"{root}/a") as (proc, client, idle):
            held = []
            for i in range(20):  # bodies sent, trailers withheld
                sock = _connect(proc.address)
                request = {
                    "op": "put",
                    "path": f"w/{i}",
                    "box": [[0, ATTACK_OBJECT]],
                    "global_shape": [ATTACK_OBJECT],
                    "dtype": "uint8",
                    "checksum": None,
                }
                wire.send_header(sock, request, ATTACK_OBJECT)
                held.append(sock)
            for sock in held:  # the body goes to every put the server says continue to
                if _answered(sock, 1.0):
                    sock.sendall(body)
            _settle(client)
            trailers = _peak_rss(proc.pid) - idle
            for sock in held:
                sock.close()
        with _server(f"{root}/b") as (proc, client, idle):
            for i in range(8):
                client.put(f"disk/{i}", body, durable=True)
        with _server(f"{root}/b") as (proc, client, idle):  # the objects on disk only
            held = []
            for i in range(8):  # replies never read
                sock = _connect(proc.address)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                wire.send_frame(sock, {"op": "get", "path": f"disk/{i}", "box": None})
                held.append(sock)
            time.sleep(3.0)  # the server reads what it is allowed to
            replies = _peak_rss(proc.pid) - idle
            for sock in held:
                sock.close()
    return {"withheld_trailers": trailers, "unread_replies": replies}


@contextlib.contextmanager
def _server(directory: str):
    """A store server with the attack's memory tier: (process, a client, its idle peak RSS)."""
    from tenplex_jax.multihost import store

    proc = store.StoreProcess.start(directory, memory_bytes=ATTACK_TIER)
    try:
        with store.StoreClient(proc.address, timeout=120) as client:
            client.stats()
            yield proc, client, _peak_rss(proc.pid)
    finally:
        proc.stop()


def _connect(address: str) -> socket.socket:
    from tenplex_jax._src.multihost.store import wire
    from tenplex_jax.multihost import store

    sock = socket.create_connection(store.parse_address(address), timeout=120)
    wire.send_frame(sock, {"op": "hello", "token": None})
    prefix = wire.recv_prefix(sock)
    wire.recv_header(sock, prefix[0], 1 << 20)
    return sock


def _answered(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return bool(sock.recv(1 << 16))
    except TimeoutError:
        return False
    finally:
        sock.settimeout(120)


def _settle(client) -> None:
    """Wait until no request body is arriving any more."""
    deadline = time.monotonic() + 120
    while client.stats()["receiving"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _peak_rss(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def run_store_hardening(before: str, rounds: int = 3, quick: bool = False, log=print) -> dict:
    ratios, attacks = compare_revisions(
        before,
        rounds,
        THROUGHPUT.format(quick=quick),
        ATTACK.format(here=str(HERE)),
        once_may_fail=True,
    )
    ops = list(ratios["after"][0])
    medians = {
        v: {op: statistics.median(r[op] for r in runs) for op in ops} for v, runs in ratios.items()
    }
    for op in ops:
        if op.startswith("memcpy"):
            continue
        b, a = medians["before"][op], medians["after"][op]
        log(f"  {op:15s} before {b:.3f}  after {a:.3f} x memcpy  (after / before {a / b:.2f})")
    for version, grown in attacks.items():
        trailers, replies = (grown[k] / MIB for k in ("withheld_trailers", "unread_replies"))
        log(
            f"  {version}: peak RSS growth under withheld trailers {trailers:.0f} MiB, under "
            f"unread replies {replies:.0f} MiB (memory tier {ATTACK_TIER // MIB} MiB)"
        )
    return {
        "kind": "store_hardening",
        "before": before,
        "rounds": rounds,
        "quick": quick,
        "vs_memcpy_runs": ratios,
        "vs_memcpy": medians,
        "attack_rss_growth": attacks,
        "attack_memory_tier": ATTACK_TIER,
        "attack_object": ATTACK_OBJECT,
    }


def main(argv=None) -> int:
    quick = {"action": "store_true", "help": "32 MiB objects instead of 256 MiB"}
    return compare_main(argv, __doc__, run_store_hardening, quick=quick)


if __name__ == "__main__":
    sys.exit(main())
