"""A VW over two processes against the same VW in one, in one run: what spanning nodes costs.

One VW of the reference GPT (``--model``) on 4 fake CPU devices, pipelined (two stages, each data
parallel over two devices), ``Nm = 2``, ``D = 0``, AdamW, trains ``--minibatches`` minibatches
alone, as ``tj.wsp.Processes`` runs it: in one process of 4 devices, and over two processes of 2
devices each (its own ``jax.distributed`` job: the stages' and the gradients' collectives cross
the processes through gloo, and the leader hands its decisions to the follower), the two taking
turns for ``--rounds`` rounds. Each run gives its samples per second after its first wave (from
the leader's wave records: the samples of the waves after the first over the time from the end
of the first to the end of the last) and its waves' compute and push seconds (medians).

    python -m tenplex_jax_benchmarks.wsp_group [--rounds 3] [--minibatches 40] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile

from tenplex_jax.multihost import store
from tenplex_jax.wsp import Coordinator, ParameterServer, Processes, weights_of


def run_once(model: str, minibatches: int, nodes: list | None, root: pathlib.Path) -> dict:
    from tenplex_jax_models import wsp as job_parts

    procs = [store.StoreProcess.start(root / f"s{i}") for i in range(2)]
    try:
        addresses = [p.address for p in procs]
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(job_parts.job(4, model=model)["init"]()), total=minibatches)
            runner = Processes(
                "tenplex_jax_models.wsp:job",
                addresses,
                root / "run",
                options=["--minibatches", "2", "--distance", "0", "--option", f"model={model}"],
                nodes=nodes,
            )
            with Coordinator(ps, runner) as coordinator:
                coordinator.add([0, 1, 2, 3])
                coordinator.wait(timeout=600)
                records = sorted(coordinator.records(), key=lambda r: r.wave)
                records = [dataclasses.asdict(r) for r in records]
    finally:
        for p in procs:
            p.kill()
    later = records[1:]
    seconds = later[-1]["ended"] - records[0]["ended"]
    return {
        "processes": 1 if nodes is None else len(set(nodes)),
        "waves": len(records),
        "samples_per_second": sum(len(r["samples"]) for r in later) / seconds,
        "compute_seconds": statistics.median(r["compute_seconds"] for r in later),
        "push_seconds": statistics.median(r["push_seconds"] for r in later),
    }


def run_wsp_group(rounds: int = 3, minibatches: int = 40, model: str = "tiny", log=print) -> dict:
    runs: dict[str, list] = {"one process": [], "two processes": []}
    for i in range(rounds):
        for name, nodes in (("one process", None), ("two processes", [0, 0, 1, 1])):
            with tempfile.TemporaryDirectory(prefix="tenplex-wsp-group-") as root:
                row = run_once(model, minibatches, nodes, pathlib.Path(root))
            runs[name].append(row)
            log(f"  round {i}, {name}: {row}")
    ratio = statistics.median(
        two["samples_per_second"] / one["samples_per_second"]
        for one, two in zip(runs["one process"], runs["two processes"])
    )
    log(f"  two processes ÷ one, samples/s (median of the rounds' ratios): {ratio:.2f}x")
    return {
        "kind": "wsp_group",
        "model": model,
        "minibatches": minibatches,
        "rounds": rounds,
        "ratio_samples_per_second": ratio,
        "runs": runs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minibatches", type=int, default=40)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    result = run_wsp_group(args.rounds, args.minibatches, args.model)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
