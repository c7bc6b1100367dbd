"""Tenplex against Tenplex-Central at runtime: the same launched job, the same change, the state
moved by every process through its own store (Tenplex) or by one process (``--central``).

The job is ``benchmarks/recovery.py``'s (the GPT on ``--nprocs`` processes x 2 CPU devices,
``data=2`` across processes), and so are the changes: a planned shrink by one process, at which
every process commits synchronously and the new generation pulls its shards (the layout changes,
``data=2,tensor=4`` -> ``data=3,tensor=2`` on the full model: most bytes move), and the loss of
the last process, whose survivors write their live version. Tenplex-Central sends every object
of a commit or a live version to the first process's store, which serves every process's pull:
the paper's baseline, in which one process gathers the state and sends each new process its
shards.

Per change and variant: the **transformation** (the slowest process's pull, what the Tenplex
artifact times between the save and the restart), the stall from the last step (or the kill) to
the first step on the new layout, and the bytes through the busiest store: written into it (the
commit's or live version's objects it holds) and read from it (the pulls' bytes it served).

    python -m tenplex_jax_benchmarks.central [--quick] [--repeats 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import tempfile

from tenplex_jax.multihost import RunDir
from tenplex_jax_benchmarks import recovery

VARIANTS = ("live", "central")  # recovery's flags: "central" adds --central
CHANGES = ("shrink", "kill")


def run_central(*, quick: bool = False, repeats: int = 1, log=print) -> dict:
    """Both variants of both changes, taking turns, ``repeats`` rounds; medians and ratios."""
    setup = (
        {"model": "tiny", "nprocs": 3, "devices_per_proc": 2}
        if quick
        else {"model": recovery.FULL_MODEL, "nprocs": 4, "devices_per_proc": 2}
    )
    runs = {c: {v: [] for v in VARIANTS} for c in CHANGES}
    for _ in range(repeats):
        for change in CHANGES:
            for variant in VARIANTS:
                with tempfile.TemporaryDirectory(prefix="tenplex-central-") as run_dir:
                    run = pathlib.Path(run_dir)
                    timed = recovery.recover_once(variant, run, change=change, **setup)
                    result = {**timed, **_traffic(run)}
                runs[change][variant].append(result)
                log(
                    f"  {variant:7s} {change:6s}: transformation {result['pull_seconds']:.3f} s, "
                    f"stall {result['recovery_seconds']:.2f} s, busiest store "
                    f"{result['busiest_bytes'] / 2**20:.1f} MiB in+out (slot "
                    f"{result['busiest_slot']}), {result['to_processes']} processes"
                )
    rows = []
    for change in CHANGES:
        med = {
            v: {
                k: statistics.median(r[k] for r in runs[change][v])
                for k in ("pull_seconds", "recovery_seconds", "busiest_bytes")
            }
            for v in VARIANTS
        }
        rows.append(
            {
                "change": change,
                "median": med,
                "transformation_ratio": med["central"]["pull_seconds"]
                / med["live"]["pull_seconds"],
                "stall_ratio": med["central"]["recovery_seconds"] / med["live"]["recovery_seconds"],
                "bytes_ratio": med["central"]["busiest_bytes"] / med["live"]["busiest_bytes"],
                "state_bytes": runs[change]["live"][0]["state_bytes"],
            }
        )
    return {"kind": "central", **setup, "repeats": repeats, "runs": runs, "rows": rows}


def _traffic(run: pathlib.Path) -> dict:
    """The new generation's pulls (the slowest one's seconds) and the bytes each store took in
    and served: in, the copies of the restored version's objects it holds (the commit's, or the
    survivors' live writes); out, the pulls' bytes it served."""
    rundir = RunDir(run)
    generation = rundir.events("generation")[1]
    reports = [rundir.restored(1, p) for p in range(generation["processes"])]
    served = collections.Counter()
    for report in reports:
        served.update({int(k): v for k, v in report.pull.by_slot.items()})
    held = collections.Counter(reports[0].pull.held_by_slot)
    total = held + served
    slot, busiest = max(total.items(), key=lambda kv: kv[1])
    return {
        "pull_seconds": max(r.pull.seconds for r in reports),
        "served_bytes": dict(served),
        "held_bytes": dict(held),
        "busiest_slot": slot,
        "busiest_bytes": busiest,
        "source": generation["restore"],
    }


def table(result: dict) -> str:
    lines = [
        "| change | state MiB | Tenplex transformation s | Central s | Central / Tenplex | "
        "Tenplex stall s | Central stall s | busiest store, Tenplex MiB | Central MiB | "
        "Central / Tenplex (bytes) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        m = row["median"]
        lines.append(
            f"| {row['change']} | {row['state_bytes'] / 2**20:.1f} | "
            f"{m['live']['pull_seconds']:.3f} | {m['central']['pull_seconds']:.3f} | "
            f"**{row['transformation_ratio']:.2f}x** | {m['live']['recovery_seconds']:.2f} | "
            f"{m['central']['recovery_seconds']:.2f} | "
            f"{m['live']['busiest_bytes'] / 2**20:.1f} | "
            f"{m['central']['busiest_bytes'] / 2**20:.1f} | {row['bytes_ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT tiny, 3 processes")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run_central(quick=args.quick, repeats=args.repeats)
    print(table(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
