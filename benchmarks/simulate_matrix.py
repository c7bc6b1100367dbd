"""Every shipped cluster × every shipped trace × every ``--model`` preset through ``tenplex-jax
simulate``: each simulates or refuses in one line; per run the outcome, the refusal or each
policy's goodput, and the seconds it took.

The test suite runs this matrix on the clusters of at most 64 devices; the two large clusters
(1,024 and 4,096 devices) take minutes, so their rows come from here.

    python -m tenplex_jax_benchmarks.simulate_matrix [--clusters cpu8,hetpipe] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import sys
import time

MESHES = pathlib.Path(__file__).resolve().parents[1] / "meshes"


def shipped() -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """The cluster descriptions and the traces in ``meshes/`` (a trace has ``[[events]]``)."""
    files = sorted(MESHES.glob("*.toml"))
    traces = [f for f in files if "[[events]]" in f.read_text()]
    return [f for f in files if f not in traces], traces


def run_matrix(log=print, clusters: tuple[str, ...] | None = None) -> dict:
    """Every shipped cluster (or those whose file stems ``clusters`` names) × trace × model."""
    from tenplex_jax._src.cli import main
    from tenplex_jax._src.cli.simulate import MODELS

    files, traces = shipped()
    clusters = [f for f in files if clusters is None or f.stem in clusters]
    rows = []
    for cluster in clusters:
        for trace in traces:
            for model in MODELS:
                out, err = io.StringIO(), io.StringIO()
                argv = ["simulate", "--cluster", str(cluster), "--trace", str(trace)]
                tic = time.perf_counter()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    status = main([*argv, "--model", model, "--json"])
                row = {
                    "cluster": cluster.stem,
                    "trace": trace.stem,
                    "model": model,
                    "status": status,
                    "seconds": time.perf_counter() - tic,
                }
                if status == 0:
                    result = json.loads(out.getvalue())
                    row["goodput"] = {p: v["goodput"] for p, v in result["policies"].items()}
                else:
                    lines = err.getvalue().strip().splitlines()
                    row["refused"] = lines[-1] if lines else ""
                    row["one_line"] = len(lines) == 1
                rows.append(row)
                what = (
                    " ".join(f"{p} {g:.3f}" for p, g in row["goodput"].items())
                    if status == 0
                    else f"refused: {row['refused'][:150]}"
                )
                log(f"  {cluster.stem:11s} {trace.stem:11s} {model:10s} {what}")
    return {
        "kind": "simulate_matrix",
        "runs": len(rows),
        "simulated": sum(r["status"] == 0 for r in rows),
        "refused_in_one_line": sum(r["status"] == 2 and r["one_line"] for r in rows),
        "rows": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--clusters",
        type=lambda text: tuple(text.split(",")),
        help="only these clusters, by file stem (default: every one in meshes/)",
    )
    args = parser.parse_args(argv)
    result = run_matrix(clusters=args.clusters)
    print(
        f"{result['runs']} runs: {result['simulated']} simulated, "
        f"{result['refused_in_one_line']} refused in one line"
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["simulated"] + result["refused_in_one_line"] == result["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
