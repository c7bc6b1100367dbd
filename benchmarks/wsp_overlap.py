"""A VW's pushes beside its compute, against a revision that pushed between waves, in one run.

``--before REF`` names another revision of this repository; its ``tenplex_jax`` runs the WSP
benchmark's job (``benchmarks/wsp.py``: three VWs on 8 fake CPU devices, ``Nm`` 4 / 2 / 1, the
last VW 2x slower, GPT small, ``--minibatches`` minibatches, ``D`` = ``--distance``), the working
tree's the same, the two taking turns for ``--rounds`` rounds. Each run gives its samples per
second, per VW its push time and how much of it the compute waited for (a revision that
pushes between waves waits for all of it), and how busy the machine's cores were while the VWs
trained (``/proc/stat``: where they are all busy, hiding communication cannot add throughput).

    python -m tenplex_jax_benchmarks.wsp_overlap --before REF [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import statistics
import sys

from tenplex_jax_benchmarks.store_hardening import compare_main, compare_revisions

RUN = """
import json
from tenplex_jax_benchmarks.suite import configure_jax
configure_jax()
from tenplex_jax_benchmarks import wsp
row = wsp.run_wsp("small", {total}, {distance}, 2.0, 8, log=lambda *a: None)
keys = ("samples_per_second", "seconds", "waves", "per_vw", "cpu_busy")
print(json.dumps({{k: row[k] for k in keys}}))
"""


def run_overlap(before: str, rounds: int = 3, minibatches: int = 161, distance: int = 1, log=print):
    runs, _ = compare_revisions(
        before, rounds, RUN.format(total=minibatches, distance=distance), "print('{}')"
    )
    summary = {}
    for version, rows in runs.items():
        push = [sum(v["push"] for v in r["per_vw"].values()) for r in rows]
        waited = [sum(v["push_wait"] for v in r["per_vw"].values()) for r in rows]
        summary[version] = {
            "samples_per_second": statistics.median(r["samples_per_second"] for r in rows),
            "push_seconds": statistics.median(push),
            "push_wait_seconds": statistics.median(waited),
            "hidden": statistics.median(1 - w / p for w, p in zip(waited, push) if p),
            "cpu_busy": statistics.median(r["cpu_busy"] or 0.0 for r in rows),
        }
    ratio = statistics.median(
        a["samples_per_second"] / b["samples_per_second"]
        for a, b in zip(runs["after"], runs["before"])
    )
    for version, row in summary.items():
        log(
            f"  {version}: {row['samples_per_second']:.1f} samples/s; pushes "
            f"{row['push_seconds']:.2f} s, the compute waited {row['push_wait_seconds']:.2f} s "
            f"({row['hidden']:.0%} hidden); the machine's cores {row['cpu_busy']:.0%} busy"
        )
    log(f"  after ÷ before, samples/s (median of the rounds' ratios): {ratio:.2f}x")
    return {
        "kind": "wsp_overlap",
        "before": before,
        "rounds": rounds,
        "minibatches": minibatches,
        "distance": distance,
        "summary": summary,
        "after_over_before": ratio,
        "runs": runs,
    }


def main(argv=None) -> int:
    return compare_main(
        argv,
        __doc__,
        run_overlap,
        minibatches={"type": int, "default": 161},
        distance={"type": int, "default": 1},
    )


if __name__ == "__main__":
    sys.exit(main())
