"""Hydrozoa's growth experiment at this machine's scale: one virtual worker (VW) to four, as devices
are offered, each offer taken or declined by the scaling policy on measured throughput per dollar.

The GPT trains with wave synchronous parallel (``D = 1``) on 8 fake CPU devices: VWs of 2 devices
(``--group``), ``Nm = --nm`` minibatches a wave, ``vw1`` on devices 0 and 1 from the start, then
offers of 2, 3, then 4, 5, then 6, 7. Every device costs the same (``--usd``, $/hour: an
illustrative rate). Each VW is ``--slowdown`` times slower than this machine's cores (it sleeps
``s - 1`` times its compute, as a slower device would take): a fake device's compute is the
host's, and 2 cores cannot run 8 devices' compute at once, so without it a VW added takes cores
from the others instead of adding devices. The policy (``tolerance``: a VW is taken, and kept,
when the samples per dollar with it are at least that fraction of those without) measures a
window of committed waves before each offer and after each VW it took. Written: every decision
with its numbers, and the job's throughput and samples per dollar after each step of growth.

    python -m tenplex_jax_benchmarks.hydrozoa [--slowdown 4] [--tolerance 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile


def run_growth(
    model: str = "small",
    group: int = 2,
    slowdown: float = 4.0,
    tolerance: float = 0.9,
    usd: float = 1.0,
    window: int = 12,
    nm: int = 4,
    log=print,
) -> dict:
    import jax

    from tenplex_jax.multihost.store import StoreProcess
    from tenplex_jax.wsp import (
        Coordinator,
        ParameterServer,
        Scaler,
        ScalingPolicy,
        Threads,
        weights_of,
    )
    from tenplex_jax_models import wsp as job_parts

    groups = [tuple(range(i, i + group)) for i in range(0, len(jax.devices()), group)]
    parts = job_parts.job(group, model=model)
    state = parts["init"]()
    steps = job_parts.step_cache(parts, jax.devices())
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-hydrozoa-"))
    stores = [StoreProcess.start(root / f"s{i}") for i in range(2)]
    try:
        addresses = [s.address for s in stores]

        def make(name, devices):
            return job_parts.virtual_worker(
                parts,
                name,
                devices,
                addresses,
                state,
                minibatches=nm,
                distance=1,
                slowdown=slowdown,
                timeout=3.0,
                steps=steps,
            )

        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=None)
            with Coordinator(ps, Threads(make)) as coordinator:
                scaler = Scaler(coordinator, ScalingPolicy(tolerance=tolerance), usd, window=window)
                coordinator.add(groups[0])
                start = scaler.measure()
                growth = [{"vws": 1, **start.numbers()}]
                log(_line(growth[-1]))
                for devices in groups[1:]:
                    decision = scaler.offer(devices)
                    log(
                        f"  offer of devices {list(devices)}: {decision.action} ({decision.reason})"
                    )
                    if decision.action != "add":
                        continue
                    measured = len(coordinator.members)  # the VWs the review measures
                    review = scaler.review()
                    log(f"  review of {review.vw}: {review.action} ({review.reason})")
                    numbers = review.numbers
                    growth.append(
                        {
                            "vws": measured,
                            "samples_per_second": numbers["samples_per_second_with"],
                            "usd_per_hour": numbers["usd_per_hour_with"],
                            "samples_per_usd": numbers["samples_per_usd_with"],
                            "kept": review.action == "keep",
                        }
                    )
                    log(_line(growth[-1]) + ("" if growth[-1]["kept"] else " (then removed)"))
                for name in list(coordinator.members):
                    coordinator.remove(name)
                coordinator.wait(timeout=300)
            errors = coordinator.runner.errors
    finally:
        for s in stores:
            s.kill()
    if errors:
        raise RuntimeError(f"virtual workers failed: {errors}")
    return {
        "kind": "hydrozoa_growth",
        "model": model,
        "group": group,
        "slowdown": slowdown,
        "tolerance": tolerance,
        "usd_per_device_hour": usd,
        "window_waves": window,
        "nm": nm,
        "growth": growth,
        "decisions": [dataclasses.asdict(d) for d in scaler.decisions],
    }


def _line(row: dict) -> str:
    return (
        f"  {row['vws']} VWs: {row['samples_per_second']:.1f} samples/s, "
        f"${row['usd_per_hour']:.2f}/h, {row['samples_per_usd']:.0f} samples/$"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--slowdown", type=float, default=4.0)
    parser.add_argument("--tolerance", type=float, default=0.9)
    parser.add_argument("--usd", type=float, default=1.0, help="$/hour of one device")
    parser.add_argument("--window", type=int, default=12, help="waves a measurement spans")
    parser.add_argument("--nm", type=int, default=4, help="minibatches in a VW's wave")
    parser.add_argument("--out", help="write the row as JSON here")
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    print(
        f"Hydrozoa's growth: GPT {args.model}, VWs of 2 devices {args.slowdown:g}x slower than a "
        f"core, ${args.usd:g}/device-hour, tolerance {args.tolerance:g}"
    )
    row = run_growth(
        args.model,
        slowdown=args.slowdown,
        tolerance=args.tolerance,
        usd=args.usd,
        window=args.window,
        nm=args.nm,
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
