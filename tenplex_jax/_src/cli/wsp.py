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

With ``--cluster FILE`` the planner builds the job instead (HetPipe's resource allocator):
``plan_workers`` groups the file's devices into VWs (node, equal or hybrid grouping), lays each out
with its pipeline stages balanced by its devices' speed, and sets its ``Nm`` and ``D``, for the
model the cluster is sized for (``--plan-model``, ``gpt100m`` by default). Each of the file's
devices becomes the fake CPU device of the same index; the demo trains a model of
``--model``'s width with the planned model's depth, so each VW runs the planned stages (uneven
ones padded), and each VW is slowed by its speed ratio: its planned seconds per minibatch over the
fastest VW's (fake devices are all equally fast). The second VW's devices fail at 30 % and come
back at 50 % (a new VW on them, with the same plan).
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
    cluster: pathlib.Path | None = None  # plan the VWs for this cluster file instead
    plan_model: str = "gpt100m"  # with cluster: the GPT preset the plan is made for
    processes: bool = False  # each VW in processes of its own, one per node it spans


GROUPS = ((0, 1, 2, 3), (4, 5), (6, 7))


@dataclasses.dataclass(frozen=True)
class Built:
    """How the demo builds one VW: its devices in mesh order, layout, stages, ``Nm`` and
    slowdown (a summary's ``virtual_workers`` entry, with its name)."""

    devices: tuple[int, ...]
    config: object  # tj.ParallelConfig
    stages: object  # tj.pipelining.Stages, or None: even
    nm: int
    slowdown: float

    def describe(self, name: str) -> dict:
        stages = self.stages.layers if self.stages is not None else None
        return {
            "name": name,
            "devices": list(self.devices),
            "config": str(self.config),
            "stages": self.config.pipe,
            "layers_per_stage": list(stages) if stages else None,
            "nm": self.nm,
            "slowdown": self.slowdown,
        }


def by_hand(options: WSPOptions) -> list[Built]:
    """The default demo's VWs: ``GROUPS``, laid out as ``job_parts.config_for``, the last one
    ``--slowdown`` times slower."""
    from tenplex_jax_models import wsp as job_parts

    return [
        Built(
            devices,
            job_parts.config_for(len(devices)),
            None,
            nm,
            options.slowdown if devices == GROUPS[2] else 1.0,
        )
        for devices, nm in zip(GROUPS, options.minibatches)
    ]


def planned(options: WSPOptions, devices: int, log=print) -> tuple[list[Built], int, int]:
    """The planner's VWs for ``options.cluster``, the planned model's layer count and the
    planner's ``D``.

    Raises:
      PlanError: the cluster has more devices than the demo's ``devices`` fake ones, or no
        grouping fits.
    """
    from tenplex_jax._src.errors import PlanError
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.wsp.planner import plan_workers
    from tenplex_jax_models.gpt import GPTConfig
    from tenplex_jax_models.train import profile_of

    cluster = Cluster.load(options.cluster)
    if len(cluster.kinds) > devices:
        raise PlanError(
            f"the demo maps each of {cluster}'s {len(cluster.kinds)} devices onto one of its "
            f"{devices} fake CPU devices: use a cluster of at most {devices} devices"
        )
    choice = plan_workers(cluster, profile_of(options.plan_model), options.minibatch)
    log(str(choice))
    fastest = min(w.candidate.step_time for w in choice.workers)
    built = [
        Built(
            w.candidate.devices,
            w.candidate.config,
            None if w.candidate.stages.is_even else w.candidate.stages,
            w.minibatches,
            w.candidate.step_time / fastest,
        )
        for w in choice.workers
    ]
    return built, GPTConfig.by_name(options.plan_model).n_layers, choice.distance


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
        if options.cluster is None:
            plans, layers, distance = by_hand(options), None, options.distance
        else:
            plans, layers, distance = planned(options, len(jax.devices()), log)
        common = {
            "model": options.model,
            "lr": options.lr,
            "seed": options.seed,
            "minibatch": options.minibatch,
            "layers": layers,
        }
        parts = job_parts.job(1, **common)
        state = parts["init"]()  # built once; each VW places it
        sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
        caches = {}  # steps per stages, cached over all devices: a joiner compiles nothing

        built: list[dict] = []  # every VW made, in order

        def make(name: str, devices: tuple[int, ...]) -> VirtualWorker:
            plan = next(p for p in plans if sorted(p.devices) == sorted(devices))
            p = job_parts.job(len(devices), stages=plan.stages, **common)
            if plan.stages not in caches:  # the train step's cache, and one wave step
                steps = StepCache(p["train_step"], sample, jax.devices(), donate=False)
                caches[plan.stages] = (steps, p["wave_step"])
            steps, wave_step = caches[plan.stages]
            built.append(plan.describe(name))
            return VirtualWorker(
                name,
                ParameterServer(addresses),
                p["rules"],
                p["dataset"],
                state,
                p["train_step"],
                devices=[jax.devices()[d] for d in plan.devices],
                config=plan.config,
                minibatches=plan.nm,
                distance=distance,
                slowdown=plan.slowdown,
                timeout=options.timeout,
                steps=steps,
                stages=plan.stages,
                wave_step=wave_step,
            )

        events = []
        if options.fail and len(plans) > 1:  # the second VW's devices fail, then come back
            at = lambda f: max(1, int(f * options.total))
            events = [
                TraceEvent(at(0.3), "fail", devices=plans[1].devices),
                TraceEvent(at(0.5), "offer", devices=plans[1].devices),
            ]
        trace = ResourceTrace("wsp-demo", len(jax.devices()), options.total, tuple(events))
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=options.total)
            if options.processes:
                runner = processes(options, plans, common, distance, addresses, out, built)
            else:
                runner = Threads(make)
            coordinator = Coordinator(ps, runner, log=log)
            log(
                f"wsp demo: {options.model} GPT"
                + (f" of {layers} layers" if layers else "")
                + f", {options.total} minibatches of {options.minibatch}, D={distance}, "
                f"Nm={[p.nm for p in plans]}, slowdown {[round(p.slowdown, 2) for p in plans]}; "
                f"building and compiling {len(plans)} virtual workers"
            )
            coordinator.add(*(p.devices for p in plans))
            coordinator.wait_joined()  # the trace's events find every VW training
            tic = time.perf_counter()
            coordinator.follow(trace, group=len(plans[1].devices) if len(plans) > 1 else 1)
            coordinator.wait()
            seconds, ended = time.perf_counter() - tic, time.time()
            errors = coordinator.runner.errors
            if errors:
                raise WSPError(f"virtual workers failed: {errors}", "failed")
            ledger = ps.history()
            final = ps.pull(ledger)
        records = coordinator.records()
        if records:  # from the first wave: VWs in processes build after they are added
            seconds = ended - min(r["started"] for r in records)
        summary = summarize(options, ledger, records, coordinator.events, seconds, parts)
        summary["distance"], summary["nm"] = distance, [p.nm for p in plans]
        summary["cluster"] = str(options.cluster) if options.cluster else None
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


def processes(options, plans, common, distance, addresses, out, built):
    """The demo's VWs as processes (``tj.wsp.Processes``): each in processes of its own, one
    per node of ``options.cluster`` it spans (without a cluster, one per VW); its plan's layout,
    stages, ``Nm`` and slowdown on its command line."""
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.wsp.coordinator import Processes

    shared = ["--distance", str(distance), "--timeout", str(options.timeout)]
    for key, value in common.items():
        if value is not None:
            shared += ["--option", f"{key}={json.dumps(value)}"]

    def options_for(name: str, devices: tuple[int, ...]) -> list[str]:
        plan = next(p for p in plans if sorted(p.devices) == sorted(devices))
        built.append(plan.describe(name))
        own = ["--minibatches", str(plan.nm), "--slowdown", str(plan.slowdown)]
        own += ["--option", f"config={plan.config}"]
        if plan.stages is not None:
            own += ["--option", f"stages={json.dumps(list(plan.stages.layers))}"]
        return own

    nodes = None if options.cluster is None else Cluster.load(options.cluster).nodes
    return Processes(
        "tenplex_jax_models.wsp:job",
        addresses,
        out / "vws",
        options=shared,
        nodes=nodes,
        options_for=options_for,
        executables=out / "vws" / "executables",  # a joiner loads the dead VW's programs
    )


# a VW's time, summed over its waves (push_wait: the push time its compute did not hide)
SECONDS = (
    "wait_seconds",
    "compute_seconds",
    "slowdown_seconds",
    "push_seconds",
    "push_wait_seconds",
)


def summarize(options, ledger, records, events, seconds, parts) -> dict:
    """The run's proof and numbers: exactly once (minibatches from the ledger's log, samples
    from the dataset PTC's order), per VW, throughput, events."""
    import numpy as np

    trained = ledger.trained()
    dataset = parts["dataset"]
    samples = np.concatenate([dataset.indices(k)[0] for k in trained]) if trained else []
    expected = np.concatenate([dataset.indices(k)[0] for k in range(options.total)])
    pushed = sorted(m for r in records for m in r["minibatches"])
    # a VW process SIGKILLed after its commit but before its record was written leaves a wave
    # the ledger holds and no record does: only a killed VW's (dropped, or not, when the run
    # ended before any member waited for it)
    killed = {*ledger.dropped, *(e["vw"] for e in events if e["event"] == "kill")}
    committed_by = {m: vw for vw, _, ms in ledger.log for m in ms}
    unrecorded = set(trained) - set(pushed)
    recorded = len(set(pushed)) == len(pushed) and set(pushed) <= set(trained)
    recorded = recorded and all(committed_by.get(m) in killed for m in unrecorded)
    per_vw = {}
    for r in records:
        v = per_vw.setdefault(
            r["vw"],
            {
                "waves": 0,
                "minibatches": 0,
                "pulls": 0,
                **dict.fromkeys(SECONDS, 0.0),
                "max_lead": 0,
                "max_local_staleness": 0,
                "max_global_staleness": 0,
                "idle_ticks": 0,
            },
        )
        v["waves"] += 1
        v["minibatches"] += len(r["minibatches"])
        v["pulls"] += int(r["pulled"])
        v["idle_ticks"] += r["idle_ticks"]
        v["max_lead"] = max(v["max_lead"], r["wave"] - r["slowest"])
        v["max_local_staleness"] = max(v["max_local_staleness"], *r["local_staleness"])
        v["max_global_staleness"] = max(v["max_global_staleness"], *r["global_staleness"])
        for k in SECONDS:
            v[k] += r[k]
    return {
        "exactly_once": sorted(trained) == list(range(options.total)) and recorded,
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
        if options.cluster is None
        else f"WSP, planned for {options.cluster}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
