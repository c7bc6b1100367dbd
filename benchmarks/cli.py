"""``tenplex-jax bench``: the benchmark suite's command, which the repository's benchmarks add to
the command line through the entry-point group ``tenplex_jax.commands`` (the library never imports
them). Only the standard library is imported here: ``tenplex-jax --help`` loads this module."""

from __future__ import annotations

import argparse
import pathlib
import sys

EXAMPLES = """\
examples:
  tenplex-jax bench --out out/bench
      the full suite on the 114.5M-param GPT (about 11 minutes on 2 CPU cores)
  tenplex-jax bench --quick --out /tmp/bench
      the same rows on a small model and small sizes, without the recovery row: about 1.5 minutes
  tenplex-jax bench --quick --recovery --out /tmp/bench
      with the recovery row (launched multi-process jobs, about a minute more)
  tenplex-jax bench --only reshard,stall --out /tmp/bench
      only the reshard matrix and the resize stall; the summary gives their goals
  tenplex-jax bench --quick --only reshard:mixed,recovery --out /tmp/bench
      one change of the matrix and the recovery row (named, it runs with --quick too)

Runs on 8 GPUs when the machine has them, else on 8 fake CPU devices. Writes DIR/results.json,
DIR/summary.md, DIR/reshard.png and DIR/plan_scaling.png (with --only: those of the rows run).
"""


def add_parser(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite: reshard vs orbax restart, bytes, bandwidth, memory, loop, "
        "plan",
        description="Measure tenplex_jax against orbax save + restore, gather to host and\n"
        "jax.device_put on a GPT + AdamW state; bytes vs the plan's minimum, bandwidth vs\n"
        "memcpy, peak memory, loop overhead and plan scaling. Ratios come from one run.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.set_defaults(command=run, name="bench")
    bench.add_argument(
        "--out", default="out/bench", metavar="DIR", help="output folder (default: out/bench)"
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="small model and sizes: about a minute; checks that every ratio is computed",
    )
    bench.add_argument(
        "--repeats",
        type=_positive,
        default=None,
        help="timed runs per strategy after a warm-up (default: 3, or 2 with --quick)",
    )
    bench.add_argument(
        "--no-recovery",
        action="store_true",
        help="skip the recovery row (stores vs orbax restart; launched jobs, about a minute)",
    )
    bench.add_argument(
        "--recovery",
        action="store_true",
        help="run the recovery row with --quick too (a full run always does)",
    )
    bench.add_argument(
        "--only",
        type=_rows,
        default=None,
        metavar="ROW[,ROW]",
        help="run only these rows: reshard, loop, stall, plan, store, recovery, or reshard:KIND "
        "for one change of the matrix (KIND: dp, tp, fsdp, pp, mixed, disjoint)",
    )


def run(args) -> int:
    """Configure JAX (8 GPUs if present, else 8 fake CPU devices), then run the suite."""
    from tenplex_jax_benchmarks import suite

    if args.only is not None and args.no_recovery and "recovery" in args.only:
        print(
            "tenplex-jax bench: error: --only names the recovery row, --no-recovery skips it",
            file=sys.stderr,
        )
        return 2
    try:
        suite.configure_jax()
    except RuntimeError as error:
        print(f"tenplex-jax bench: error: {error}", file=sys.stderr)
        return 2
    options = suite.BenchOptions(
        out=pathlib.Path(args.out),
        quick=args.quick,
        repeats=args.repeats,
        recovery=not args.no_recovery and (args.recovery or not args.quick),
        only=args.only,
    )
    suite.run(options)
    return 0


def _rows(text: str) -> tuple[str, ...]:
    from tenplex_jax_benchmarks.suite import parse_only  # stdlib imports only: cheap

    try:
        return parse_only(text)
    except ValueError as error:  # argparse would hide a ValueError's message
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)
