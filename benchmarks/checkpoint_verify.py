"""What checking a checkpoint's files costs: a verified restore against an unverified one.

One orbax checkpoint of the GPT + AdamW state (``save_checkpoint``: a directory per leaf, every file
listed with its crc32) is restored onto two layouts, with the files read and checked first
(``verify=True``, the default) and without (``verify=False``), the two taking turns in every round
after a warm-up, in one process. The goal: checking costs at most 10 % of the restore.

    python -m tenplex_jax_benchmarks.checkpoint_verify [--model gpt100m] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import jax


def run_checkpoint_verify(model: str = "gpt100m", repeats: int = 5, log=print) -> dict:
    import tenplex_jax as tj
    from tenplex_jax_models import LOGICAL_RULES, build_state

    C = tj.ParallelConfig
    _, state, _ = build_state(model, 1e-3)
    ptc = tj.PTC.of(state, LOGICAL_RULES, C(fsdp=8), jax.devices()[:8])
    state = tj.place(state, ptc)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tenplex-verify-") as directory:
        tic = time.perf_counter()
        tj.save_checkpoint(directory, state, ptc, step=1)
        save_seconds = time.perf_counter() - tic
        del state
        tic = time.perf_counter()
        latest = tj.latest_checkpoint(directory)  # reads and checks every file of the step
        latest_seconds = time.perf_counter() - tic
        assert latest == 1
        for config in (C(fsdp=4), C(data=2, fsdp=4)):
            target = ptc.relayout(config, jax.devices()[: config.num_devices])
            runs = {"verified": [], "unverified": []}
            for round_ in range(repeats + 1):
                for name in runs:
                    tic = time.perf_counter()
                    restored = tj.restore_checkpoint(directory, target, verify=name == "verified")
                    jax.block_until_ready(restored.state)
                    if round_:
                        runs[name].append(time.perf_counter() - tic)
                    del restored
            medians = {name: statistics.median(r) for name, r in runs.items()}
            row = {
                "to": str(config),
                "runs_seconds": runs,
                "median_seconds": medians,
                "overhead": medians["verified"] / medians["unverified"] - 1,
            }
            rows.append(row)
            log(
                f"  restore onto {config}: verified {medians['verified']:.3f} s, unverified "
                f"{medians['unverified']:.3f} s: checking adds {row['overhead']:+.1%}"
            )
    return {
        "kind": "checkpoint_verify",
        "model": model,
        "state_bytes": ptc.nbytes,
        "save_seconds": save_seconds,
        "latest_checkpoint_seconds": latest_seconds,
        "repeats": repeats,
        "rows": rows,
        "overhead": max(r["overhead"] for r in rows),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the row as JSON here")
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    row = run_checkpoint_verify(args.model, args.repeats)
    print(
        f"{row['model']}: {row['state_bytes'] / 2**30:.2f} GiB; save {row['save_seconds']:.2f} s, "
        f"latest_checkpoint (checks every file) {row['latest_checkpoint_seconds']:.3f} s; the "
        f"worst overhead of checking a restore {row['overhead']:+.1%}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
