"""``tenplex-jax demo --wsp``: heterogeneous virtual workers with wave synchronous parallel.

On 8 fake CPU devices: a parameter server on two tensor stores (127.0.0.1), and three virtual
workers as threads: ``vw1`` on devices 0..3 (a two-stage GPipe pipeline, twice data parallel),
``vw2`` on 4..5 and ``vw3`` on 6..7 (data parallel), ``vw3`` of a device type ``--slowdown`` times
slower. Each VW's ``Nm`` is in proportion to its speed (4, 2, 1 by default), ``D`` is
``--distance``. A resource trace in the format of ``meshes/`` drives the coordinator: devices 4..5
fail at 30 % of the run (``vw2`` dies without a word; the others drop it after the ledger's timeout
and retrain its unpushed minibatches) and come back at 50 % (a new VW joins, pulls the weights and
starts at the slowest clock; its step, compiled for ``vw2``, is reused). Writes ``DIR/loss.png``
(every minibatch's loss against the samples
trained, per VW) and ``DIR/summary.json``: whether every minibatch and sample was trained exactly
once, the VWs built (``virtual_workers``: devices, stages, ``Nm``), every minibatch's local
version and its local and global staleness (``minibatches``), per VW its waves, minibatches,
waits, pulls and largest staleness, the throughput, and the events.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tempfile
import time


@dataclasses.dataclass(frozen=True)
class WSPOptions:
    out: pathlib.Path = pathlib.Path("out/wsp")
    model: str = "tiny"
    minibatch: int = 8
    total: int = 240  # minibatches in the run
    distance: int = 1
    slowdown: float = 2.0
    minibatches: tuple[int, int, int] = (4, 2, 1)  # Nm of vw1, vw2, vw3 (and the joiner: vw2's)
    fail: bool = True  # devices 4..5 fail at 30 % and come back at 50 %
    timeout: float = 3.0  # the ledger drops a VW silent this long
    lr: float = 3e-3
    seed: int = 0


GROUPS = ((0, 1, 2, 3), (4, 5), (6, 7))


def run(options: WSPOptions, log=print) -> dict:
    import jax
    import numpy as np

    from tenplex_jax._src.elastic.steps import StepCache
    from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent
    from tenplex_jax._src.errors import WSPError
    from tenplex_jax._src.multihost.store.process import StoreProcess
    from tenplex_jax._src.wsp.coordinator import Coordinator, Threads
    from tenplex_jax._src.wsp.ps import ParameterServer
    from tenplex_jax._src.wsp.worker import VirtualWorker, weights_of
    from tenplex_jax_models import wsp as job_parts

    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-wsp-"))
    stores = [StoreProcess.start(root / f"s{i}") for i in range(2)]
    try:
        addresses = [s.address for s in stores]
        parts = job_parts.job(
            1, model=options.model, lr=options.lr, seed=options.seed, minibatch=options.minibatch
        )
        state = parts["init"]()  # built once; each VW places it
        nm = dict(zip(("vw1", "vw2", "vw3"), options.minibatches))
        sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
        steps = StepCache(parts["train_step"], sample, jax.devices(), donate=False)  # for joiners

        built: list[dict] = []  # every VW made, in order

        def make(name: str, devices: tuple[int, ...]) -> VirtualWorker:
            p = job_parts.job(
                len(devices),
                model=options.model,
                lr=options.lr,
                seed=options.seed,
                minibatch=options.minibatch,
            )
            built.append(
                {
                    "name": name,
                    "devices": list(devices),
                    "stages": p["config"].pipe,
                    "nm": nm.get(name, options.minibatches[1]),
                    "slowdown": options.slowdown if devices == GROUPS[2] else 1.0,
                }
            )
            return VirtualWorker(
                name,
                ParameterServer(addresses),
                p["rules"],
                p["dataset"],
                state,
                p["train_step"],
                devices=[jax.devices()[d] for d in devices],
                config=p["config"],
                minibatches=built[-1]["nm"],
                distance=options.distance,
                slowdown=built[-1]["slowdown"],
                timeout=options.timeout,
                steps=steps,
            )

        events = []
        if options.fail:
            at = lambda f: max(1, int(f * options.total))
            events = [
                TraceEvent(at(0.3), "fail", devices=GROUPS[1]),
                TraceEvent(at(0.5), "offer", devices=GROUPS[1]),
            ]
        trace = ResourceTrace("wsp-demo", 8, options.total, tuple(events))
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=options.total)
            coordinator = Coordinator(ps, Threads(make), log=log)
            log(
                f"wsp demo: {options.model} GPT, {options.total} minibatches of "
                f"{options.minibatch}, D={options.distance}, Nm={options.minibatches}, vw3 "
                f"{options.slowdown:g}x slower; building and compiling 3 virtual workers"
            )
            coordinator.add(*GROUPS)
            tic = time.perf_counter()
            coordinator.follow(trace, group=2)
            coordinator.wait()
            seconds = time.perf_counter() - tic
            errors = coordinator.runner.errors
            if errors:
                raise WSPError(f"virtual workers failed: {errors}", "failed")
            ledger = ps.history()
            final = ps.pull(ledger)
        records = coordinator.records()
        summary = summarize(options, ledger, records, coordinator.events, seconds, parts)
        summary["virtual_workers"] = built
        summary["weights_finite"] = bool(all(np.isfinite(w).all() for w in final.values()))
        write_plot(records, out / "loss.png", options)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        log(table(summary))
        log(f"wrote {out / 'loss.png'} and {out / 'summary.json'}")
        return summary
    finally:
        for s in stores:
            s.kill()


def summarize(options, ledger, records, events, seconds, parts) -> dict:
    """The run's proof and numbers: exactly once (minibatches from the ledger's log, samples
    from the dataset PTC's order), per VW, throughput, events."""
    import numpy as np

    trained = ledger.trained()
    dataset = parts["dataset"]
    samples = np.concatenate([dataset.indices(k)[0] for k in trained]) if trained else []
    expected = np.concatenate([dataset.indices(k)[0] for k in range(options.total)])
    pushed = sorted(m for r in records for m in r["minibatches"])
    per_vw = {}
    for r in records:
        v = per_vw.setdefault(
            r["vw"],
            {
                "waves": 0,
                "minibatches": 0,
                "pulls": 0,
                "wait_seconds": 0.0,
                "compute_seconds": 0.0,
                "slowdown_seconds": 0.0,
                "max_lead": 0,
                "max_local_staleness": 0,
                "max_global_staleness": 0,
            },
        )
        v["waves"] += 1
        v["minibatches"] += len(r["minibatches"])
        v["pulls"] += int(r["pulled"])
        v["max_lead"] = max(v["max_lead"], r["wave"] - r["slowest"])
        v["max_local_staleness"] = max(v["max_local_staleness"], *r["local_staleness"])
        v["max_global_staleness"] = max(v["max_global_staleness"], *r["global_staleness"])
        for k in ("wait_seconds", "compute_seconds", "slowdown_seconds"):
            v[k] += r[k]
    return {
        "exactly_once": sorted(trained) == list(range(options.total)) and pushed == sorted(trained),
        "samples_exactly_once": bool(np.array_equal(np.sort(samples), np.sort(expected))),
        "total": options.total,
        "minibatch": options.minibatch,
        "distance": options.distance,
        "nm": list(options.minibatches),
        "slowdown": options.slowdown,
        "seconds": seconds,
        "samples_per_second": options.total * options.minibatch / seconds,
        "dropped": list(ledger.dropped),
        "left": list(ledger.left),
        "per_vw": per_vw,
        "events": events,
        "minibatches": [  # what each minibatch's weights held (HetPipe's staleness)
            {
                "vw": r["vw"],
                "wave": r["wave"],
                "index": m,
                "local_version": v,
                "local_staleness": s,
                "global_staleness": g,
                "loss": loss,
            }
            for r in records
            for m, v, s, g, loss in zip(
                r["minibatches"],
                r["local_versions"],
                r["local_staleness"],
                r["global_staleness"],
                r["losses"],
            )
        ],
        "first_loss": records[0]["losses"][0] if records else None,
        "last_losses": [x for r in records[-3:] for x in r["losses"]],
    }


def table(summary: dict) -> str:
    lines = [
        f"{'vw':6} {'waves':>6} {'minibatches':>11} {'pulls':>6} {'max lead':>8} "
        f"{'staleness local/global':>22} {'wait s':>7} {'compute s':>9} {'slowdown s':>10}"
    ]
    for vw, v in summary["per_vw"].items():
        staleness = f"{v['max_local_staleness']}/{v['max_global_staleness']}"
        lines.append(
            f"{vw:6} {v['waves']:6d} {v['minibatches']:11d} {v['pulls']:6d} "
            f"{v['max_lead']:8d} {staleness:>22} {v['wait_seconds']:7.2f} "
            f"{v['compute_seconds']:9.2f} {v['slowdown_seconds']:10.2f}"
        )
    lines.append(
        f"exactly once: minibatches {summary['exactly_once']}, samples "
        f"{summary['samples_exactly_once']}; dropped {summary['dropped']}; "
        f"{summary['samples_per_second']:.1f} samples/s over {summary['seconds']:.1f} s"
    )
    return "\n".join(lines)


def write_plot(records, path: pathlib.Path, options) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    done = 0
    points: dict[str, list] = {}
    for r in sorted(records, key=lambda r: r["ended"]):  # in push order: samples trained so far
        for loss in r["losses"]:
            done += options.minibatch
            points.setdefault(r["vw"], []).append((done, loss))
    for vw, xy in sorted(points.items()):
        ax.plot(*zip(*xy), ".", label=vw)
    ax.set_xlabel("samples trained (all virtual workers)")
    ax.set_ylabel("minibatch loss")
    ax.set_title(
        f"WSP, D={options.distance}, Nm={options.minibatches}, vw3 {options.slowdown:g}x slower"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
