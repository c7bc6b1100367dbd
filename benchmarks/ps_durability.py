"""The parameter server's push before and after a change, in one run, and JSON bodies against the
store's memory bound.

``--before REF`` names another revision (a commit, a tag); its ``tenplex_jax`` is extracted into
a temporary directory and run from there, the working tree's from here, taking turns:

- **push and pull**: 64 MiB of float32 weights in 8 leaves over two stores, one VW pushing and
  pulling ``--repeats`` waves (the first not counted), median seconds, ``--rounds``
  subprocesses per version, alternating. After the change a push also refuses non-finite updates
  and sees its stage on disk before the commit; ``after / before`` is what that costs.
- **JSON bodies**: a store with ``--memory-bytes 64 MiB``, one ``put_json`` of 60 MiB of
  ``[[[]],[[]],...]`` (the costliest JSON to parse); the growth of the server's peak RSS (VmHWM),
  and whether it was refused.

    python -m tenplex_jax_benchmarks.ps_durability --before REF [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import statistics
import sys

from tenplex_jax_benchmarks.store_hardening import MIB, compare_main, compare_revisions

PUSH = """
import json, pathlib, statistics, tempfile, time
import numpy as np
from tenplex_jax.multihost import store
from tenplex_jax.wsp import ParameterServer
leaves, n = 8, 64 * 2**20 // 4 // 8
weights = {{f"w{{i}}": np.zeros(n, np.float32) for i in range(leaves)}}
update = {{p: np.full(n, 1e-3, np.float32) for p in weights}}
root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-ps-"))
procs = [store.StoreProcess.start(root / f"s{{i}}") for i in range(2)]
try:
    with ParameterServer([p.address for p in procs]) as ps:
        ps.create(weights, total=None)
        ps.update(lambda led, *now: (led.join("b", *now), None))  # either revision's API
        push, pull = [], []
        for wave in range({repeats} + 1):
            ps.update(lambda led, *now, wave=wave: led.claim("b", wave, 1))
            tic = time.perf_counter()
            ps.push("b", wave, update)
            push.append(time.perf_counter() - tic)
            tic = time.perf_counter()
            ps.pull()
            pull.append(time.perf_counter() - tic)
finally:
    for p in procs:
        p.kill()
print(json.dumps({{"push": statistics.median(push[1:]), "pull": statistics.median(pull[1:])}}))
"""

JSON_BODY = """
import json, pathlib, tempfile
from tenplex_jax.multihost import store
def hwm(pid):
    for line in pathlib.Path(f"/proc/{{pid}}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
proc = store.StoreProcess.start(pathlib.Path(tempfile.mkdtemp()) / "s", memory_bytes={tier})
try:
    with store.StoreClient(proc.address, timeout=300) as client:
        client.put_json("warm", {{"x": 1}})
        idle = hwm(proc.pid)
        try:
            client.put_json("huge", {{"a": [[[]]] * (10 * 2**20)}})
            refused = None
        except Exception as error:
            refused = getattr(error, "reason", type(error).__name__)
        print(json.dumps({{"rss_growth": hwm(proc.pid) - idle, "refused": refused}}))
finally:
    proc.kill()
"""


def run_ps_durability(before: str, rounds: int = 3, repeats: int = 5, log=print) -> dict:
    runs, json_body = compare_revisions(
        before, rounds, PUSH.format(repeats=repeats), JSON_BODY.format(tier=64 * MIB)
    )
    medians = {
        v: {k: statistics.median(r[k] for r in rs) for k in ("push", "pull")}
        for v, rs in runs.items()
    }
    for k in ("push", "pull"):
        b, a = medians["before"][k], medians["after"][k]
        log(f"  {k}: before {b:.3f} s  after {a:.3f} s  (after / before {a / b:.2f})")
    for version, row in json_body.items():
        log(
            f"  {version}: a 60 MiB JSON body grows the store's peak RSS by "
            f"{row['rss_growth'] / MIB:.0f} MiB (--memory-bytes 64 MiB); refused: {row['refused']}"
        )
    return {
        "kind": "ps_durability",
        "before": before,
        "rounds": rounds,
        "seconds_runs": runs,
        "seconds": medians,
        "push_after_over_before": medians["after"]["push"] / medians["before"]["push"],
        "json_body": json_body,
    }


def main(argv=None) -> int:
    repeats = {"type": int, "default": 5}
    return compare_main(argv, __doc__, run_ps_durability, repeats=repeats)


if __name__ == "__main__":
    sys.exit(main())
