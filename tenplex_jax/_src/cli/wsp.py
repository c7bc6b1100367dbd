"""``tenplex-jax wsp``: HetPipe's heterogeneous virtual workers with wave synchronous parallel,
on 8 fake CPU devices, one VW dying and a new one joining; ``DIR/summary.json`` is a
:class:`Summary`. ``docs/wsp.md`` ("The ``wsp`` command") says what it runs and shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import tempfile
import time

from tenplex_jax._src.cli import parsing

EXAMPLES = """\
examples:
  tenplex-jax wsp --out out/wsp
      three virtual workers of different speeds; one dies at 30%, a new one joins at 50%
  tenplex-jax wsp --cluster meshes/hetpipe.toml --out out/wsp-hetpipe
      the planner's virtual workers for a cluster (grouping, uneven stages, Nm, D)
  tenplex-jax wsp --cluster meshes/hetpipe.toml --processes --out out/wsp-nodes
      the same, every virtual worker in processes of its own, one per node it spans
"""
DEVICES = 8  # the fake CPU devices the demo runs on
GROUPS = ((0, 1, 2, 3), (4, 5), (6, 7))
# a VW's time, summed over its waves (push_wait: the push time its compute did not hide)
SECONDS = ("wait_seconds", "compute_seconds", "slowdown_seconds", "push_seconds")
SECONDS += ("push_wait_seconds",)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "wsp",
        help="train heterogeneous virtual workers with wave synchronous parallel (HetPipe)",
        description="Train heterogeneous virtual workers (HetPipe) with wave synchronous\n"
        "parallel through a parameter server in tensor stores, one dying and one joining;\n"
        "write a loss plot and a JSON summary.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(command=command, name="wsp")
    parsing.add_training_flags(parser, out="out/wsp", model="tiny")
    parser.add_argument(
        "--steps", type=parsing.positive, default=240, help="the run's minibatches (default: 240)"
    )
    parser.add_argument(
        "--batch", type=parsing.positive, default=8, help="samples per minibatch (default: 8)"
    )
    parser.add_argument(
        "--distance", type=parsing.count, default=1, help="the clock distance D (default: 1)"
    )
    parser.add_argument(
        "--slowdown",
        type=float,
        default=2.0,
        help="how many times slower the slow device type is (default: 2)",
    )
    parser.add_argument(
        "--cluster",
        metavar="FILE",
        type=pathlib.Path,
        help="let the planner build the virtual workers for this cluster (TOML, see meshes/; at "
        f"most {DEVICES} devices, each a fake CPU device slowed by its speed)",
    )
    parser.add_argument(
        "--plan-model",
        choices=("tiny", "small", "gpt100m"),
        default="gpt100m",
        help="with --cluster: the GPT preset the plan is made for; the demo trains --model's "
        "width with its depth (default: gpt100m)",
    )
    parser.add_argument(
        "--grouping",
        choices=("node", "equal", "hybrid"),
        help="with --cluster: plan only this grouping into virtual workers (default: the "
        "planner's best of the three)",
    )
    parser.add_argument(
        "--processes",
        action="store_true",
        help="run each virtual worker in processes of its own, one per node it spans (with "
        "--cluster: the file's nodes; else one process per VW)",
    )


def command(args) -> int:
    """Configure JAX for the fake CPU devices first, then run the demo."""
    from tenplex_jax._src.cli.demo import use_cpu_devices

    if not use_cpu_devices(DEVICES, "wsp"):
        return 2
    run(WSPOptions(**parsing.fields_of(WSPOptions, args) | {"out": pathlib.Path(args.out)}))
    return 0


@dataclasses.dataclass(frozen=True)
class WSPOptions:
    """A demo run; the command's flags map onto these fields."""

    out: pathlib.Path = pathlib.Path("out/wsp")
    model: str = "tiny"
    batch: int = 8  # samples per minibatch
    steps: int = 240  # minibatches in the run
    distance: int = 1
    slowdown: float = 2.0
    minibatches: tuple[int, int, int] = (4, 2, 1)  # Nm of vw1, vw2, vw3 (and the joiner: vw2's)
    timeout: float = 3.0  # the ledger drops a VW silent this long
    lr: float = 3e-3
    seed: int = 0
    cluster: pathlib.Path | None = None  # plan the VWs for this cluster file instead
    plan_model: str = "gpt100m"  # with cluster: the GPT preset the plan is made for
    grouping: str | None = None  # with cluster: plan only this grouping (None: the best)
    processes: bool = False  # each VW in processes of its own, one per node it spans


@dataclasses.dataclass(frozen=True)
class Built:
    """How the demo builds one VW (named once it is made): its devices in mesh order, its
    layout (``ParallelConfig.parse``'s text), its stages' layers (None: even), ``Nm``, slowdown,
    and the planner's estimate of its wave's seconds (None: built by hand)."""

    devices: tuple[int, ...]
    config: str
    stages: tuple[int, ...] | None
    nm: int
    slowdown: float
    name: str = ""
    estimate: float | None = None


@dataclasses.dataclass(frozen=True)
class VWTotals:
    """One VW's waves summed: waves, minibatches, pulls, idle ticks and :data:`SECONDS`; the most
    waves it ran ahead of the slowest, the largest local and global staleness, and its measured
    wave time: the median over its waves of the compute, the slowdown's sleep and the push the
    compute did not hide (its own pace: not WSP's waits for the others, nor its pulls)."""

    waves: int
    minibatches: int
    pulls: int
    idle_ticks: int
    wait_seconds: float
    compute_seconds: float
    slowdown_seconds: float
    push_seconds: float
    push_wait_seconds: float
    max_lead: int
    max_local_staleness: int
    max_global_staleness: int
    wave_seconds: float

    @classmethod
    def of(cls, records) -> VWTotals:
        """The totals of one VW's :class:`WaveRecord` s."""
        return cls(
            waves=len(records),
            minibatches=sum(len(r.minibatches) for r in records),
            pulls=sum(int(r.pulled) for r in records),
            idle_ticks=sum(r.idle_ticks for r in records),
            **{k: sum(getattr(r, k) for r in records) for k in SECONDS},
            max_lead=max(0, *(r.wave - r.slowest for r in records)),
            max_local_staleness=max(0, *(s for r in records for s in r.local_staleness)),
            max_global_staleness=max(0, *(s for r in records for s in r.global_staleness)),
            wave_seconds=statistics.median(
                r.compute_seconds + r.slowdown_seconds + r.push_wait_seconds for r in records
            ),
        )


@dataclasses.dataclass(frozen=True)
class Trained:
    """One minibatch: who trained it in which wave, what its weights held (HetPipe's local
    version and staleness, its global staleness), its loss."""

    vw: str
    wave: int
    index: int
    local_version: int
    local_staleness: int
    global_staleness: int
    loss: float

    @classmethod
    def of(cls, r) -> list[Trained]:
        """The minibatches of one :class:`WaveRecord`."""
        rows = zip(r.minibatches, r.local_versions, r.local_staleness, r.global_staleness, r.losses)
        keys = ("index", "local_version", "local_staleness", "global_staleness", "loss")
        return [cls(vw=r.vw, wave=r.wave, **dict(zip(keys, row))) for row in rows]


@dataclasses.dataclass(frozen=True)
class WaveTime:
    """A planned VW's wave: the planner's estimate (seconds of the cluster's devices), what the
    demo measured (:attr:`VWTotals.wave_seconds`, on its fake CPU devices) and their ratio."""

    estimated: float
    measured: float
    ratio: float  # estimated / measured


@dataclasses.dataclass(frozen=True)
class Summary:
    """A demo run's proof and numbers; ``DIR/summary.json`` is its ``dataclasses.asdict``."""

    # every minibatch committed once (the ledger's log) and recorded once (see exactly_once)
    exactly_once: bool
    samples_exactly_once: bool  # the samples trained are the dataset PTC's, each once
    weights_finite: bool  # the final global weights hold no NaN or Inf
    total: int  # the run's minibatches
    minibatch: int  # samples in each
    distance: int  # D
    nm: tuple[int, ...]  # each planned VW's Nm
    slowdown: float
    cluster: str | None  # the cluster file the VWs were planned for
    seconds: float  # from the first wave to the end
    samples_per_second: float
    dropped: tuple[str, ...]  # VWs dropped
    left: tuple[str, ...]  # VWs that left
    virtual_workers: tuple[Built, ...]  # every VW built, in order
    per_vw: dict[str, VWTotals]
    wave_times: dict[str, WaveTime]  # per planned VW that trained: estimate vs measured
    events: tuple  # the coordinator's tj.wsp.VWEvent s
    minibatches: tuple[Trained, ...]  # every minibatch trained, in wave start order
    first_loss: float | None
    last_losses: tuple[float, ...]  # those of the last three waves


@dataclasses.dataclass(frozen=True)
class _Job:
    """What the demo's VWs are built from."""

    options: WSPOptions
    plans: list[Built]
    common: dict  # the keywords of ``tenplex_jax_models.wsp.job`` every VW shares
    distance: int
    addresses: list[str]
    built: list[Built]  # every VW made, in order, named


def by_hand(options: WSPOptions) -> list[Built]:
    """The default demo's VWs: ``GROUPS``, laid out as ``job_parts.config_for``, the last one
    ``--slowdown`` times slower."""
    from tenplex_jax_models import wsp as job_parts

    return [
        Built(
            devices=devices,
            config=str(job_parts.config_for(len(devices))),
            stages=None,
            nm=nm,
            slowdown=options.slowdown if devices == GROUPS[2] else 1.0,
        )
        for devices, nm in zip(GROUPS, options.minibatches)
    ]


def planned(options: WSPOptions, log=print) -> tuple[list[Built], int, int]:
    """The planner's VWs for ``options.cluster``, the planned model's layer count and the
    planner's ``D``.

    Raises:
      PlanError: the cluster has more devices than the demo's fake ones, or no grouping fits.
    """
    from tenplex_jax._src.errors import PlanError
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.wsp.planner import plan_workers
    from tenplex_jax_models.gpt import GPTConfig
    from tenplex_jax_models.train import profile_of

    cluster = Cluster.load(options.cluster)
    if len(cluster.kinds) > DEVICES:
        raise PlanError(
            f"the demo maps each of {cluster}'s {len(cluster.kinds)} devices onto one of its "
            f"{DEVICES} fake CPU devices: use a cluster of at most {DEVICES} devices"
        )
    groupings = (options.grouping,) if options.grouping else ("node", "equal", "hybrid")
    choice = plan_workers(
        cluster, profile_of(options.plan_model), options.batch, groupings=groupings
    )
    log(str(choice))
    fastest = min(w.candidate.step_time for w in choice.workers)
    built = [
        Built(
            devices=w.candidate.devices,
            config=str(w.candidate.config),
            stages=None if w.candidate.stages.is_even else tuple(w.candidate.stages.layers),
            nm=w.minibatches,
            slowdown=w.candidate.step_time / fastest,
            estimate=w.wave_seconds,
        )
        for w in choice.workers
    ]
    return built, GPTConfig.by_name(options.plan_model).n_layers, choice.distance


def run(options: WSPOptions, log=print) -> Summary:
    """Run the demo (see the module's docstring); write ``loss.png`` and ``summary.json`` to
    ``options.out``."""
    from tenplex_jax._src.multihost.store.process import StoreProcess

    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-wsp-"))
    stores = [StoreProcess.start(root / f"s{i}") for i in range(2)]
    try:
        if options.cluster is None:
            plans, layers, distance = by_hand(options), None, options.distance
        else:
            plans, layers, distance = planned(options, log)
        common = {"model": options.model, "lr": options.lr, "seed": options.seed}
        common |= {"minibatch": options.batch, "layers": layers}
        addresses = [s.address for s in stores]
        job = _Job(options, plans, common, distance, addresses, built=[])
        summary = _train(job, log)
    finally:
        for s in stores:
            s.kill()
    (out / "summary.json").write_text(json.dumps(dataclasses.asdict(summary), indent=1) + "\n")
    log(table(summary))
    log(f"wrote {out / 'loss.png'} and {out / 'summary.json'}")
    return summary


def _train(job: _Job, log) -> Summary:
    """Train the job's VWs through the trace; its summary, and its plot written."""
    import numpy as np

    from tenplex_jax._src.errors import WSPError
    from tenplex_jax._src.wsp.coordinator import Coordinator
    from tenplex_jax._src.wsp.options import weights_of
    from tenplex_jax._src.wsp.ps import ParameterServer
    from tenplex_jax_models import wsp as job_parts

    options, plans = job.options, job.plans
    parts = job_parts.job(1, **job.common)
    state = parts["init"]()  # built once; each VW places it
    with ParameterServer(job.addresses) as ps:
        ps.create(weights_of(state), total=options.steps)
        runner = _processes(job) if options.processes else _threads(job, parts, state)
        coordinator = Coordinator(ps, runner, log=log)
        nm, slow = [p.nm for p in plans], [round(p.slowdown, 2) for p in plans]
        log(
            f"wsp: {options.model} GPT, {options.steps} minibatches of {options.batch}, "
            f"D={job.distance}, Nm={nm}, slowdown {slow}; building {len(plans)} virtual workers"
        )
        coordinator.add(*(p.devices for p in plans))
        coordinator.wait_joined()  # the trace's events find every VW training
        tic = time.perf_counter()
        group = len(plans[1].devices) if len(plans) > 1 else 1
        coordinator.follow(_trace(options, plans), group=group)
        coordinator.wait()
        seconds, ended = time.perf_counter() - tic, time.time()
        if coordinator.runner.errors:
            raise WSPError(f"virtual workers failed: {coordinator.runner.errors}", "failed")
        ledger = ps.history()
        final = ps.pull(ledger)
    records = coordinator.records()
    if records:  # from the first wave: VWs in processes build after they are added
        seconds = ended - min(r.started for r in records)
    write_plot(records, pathlib.Path(options.out) / "loss.png", options)
    finite = all(np.isfinite(w).all() for w in final.values())
    return summarize(job, ledger, records, coordinator.events, seconds, parts, bool(finite))


def _trace(options: WSPOptions, plans: list[Built]):
    """The demo's resource trace: the second VW's devices fail at 30 % and come back at 50 %
    (no event with one VW)."""
    from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent

    at = lambda f: max(1, int(f * options.steps))
    events = tuple(
        TraceEvent(step=at(f), kind=kind, devices=plans[1].devices)
        for f, kind in ((0.3, "fail"), (0.5, "offer"))
        if len(plans) > 1
    )
    return ResourceTrace(name="wsp-demo", devices=DEVICES, steps=options.steps, events=events)


def _threads(job: _Job, parts: dict, state):
    """The demo's VWs as threads of this process, each placing ``state``; VWs of the same
    stages share one step cache over all the devices, so a joiner compiles nothing."""
    import jax
    import numpy as np

    from tenplex_jax._src.elastic.steps import StepCache
    from tenplex_jax._src.wsp.coordinator import Threads
    from tenplex_jax_models import wsp as job_parts

    sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
    caches = {}  # stages -> the train step's cache and one wave step (its programs shared)

    def make(name: str, devices: tuple[int, ...]):
        plan = next(p for p in job.plans if sorted(p.devices) == sorted(devices))
        p = job_parts.job(len(devices), stages=plan.stages, config=plan.config, **job.common)
        if plan.stages not in caches:
            steps = StepCache(p["train_step"], sample, jax.devices(), donate=False)
            caches[plan.stages] = (steps, p["wave_step"])
        job.built.append(dataclasses.replace(plan, name=name))
        steps, wave_step = caches[plan.stages]
        options = {"minibatches": plan.nm, "distance": job.distance, "slowdown": plan.slowdown}
        options |= {"steps": steps, "stages": p["stages"], "wave_step": wave_step}
        return job_parts.virtual_worker(
            p, name, plan.devices, job.addresses, state, timeout=job.options.timeout, **options
        )

    return Threads(make)


def _processes(job: _Job):
    """The demo's VWs as processes (``tj.wsp.Processes``): each in processes of its own, one
    per node of ``options.cluster`` it spans (without a cluster, one per VW); its plan's layout,
    stages, ``Nm`` and slowdown on its command line."""
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.wsp.coordinator import Processes

    options, out = job.options, pathlib.Path(job.options.out)
    shared = ["--distance", str(job.distance), "--timeout", str(options.timeout)]
    for key, value in job.common.items():
        if value is not None:
            shared += ["--option", f"{key}={json.dumps(value)}"]

    def options_for(name: str, devices: tuple[int, ...]) -> list[str]:
        plan = next(p for p in job.plans if sorted(p.devices) == sorted(devices))
        job.built.append(dataclasses.replace(plan, name=name))
        own = ["--minibatches", str(plan.nm), "--slowdown", str(plan.slowdown)]
        own += ["--option", f"config={plan.config}"]
        if plan.stages is not None:
            own += ["--option", f"stages={json.dumps(list(plan.stages))}"]
        return own

    nodes = None if options.cluster is None else Cluster.load(options.cluster).nodes
    return Processes(
        "tenplex_jax_models.wsp:job",
        job.addresses,
        out / "vws",
        options=shared,
        nodes=nodes,
        options_for=options_for,
        executables=out / "vws" / "executables",  # a joiner loads the dead VW's programs
    )


def exactly_once(total: int, ledger, records, events) -> bool:
    """Every minibatch ``0 .. total - 1`` committed once (the ledger's whole log) and each
    committed wave recorded once. A VW process SIGKILLed after its commit but before its record
    was written leaves a wave the ledger holds and no record does: allowed of a killed VW only
    (dropped, or not, when the run ended before any member waited for it)."""
    trained = ledger.trained()
    pushed = sorted(m for r in records for m in r.minibatches)
    killed = {*ledger.dropped, *(e.vw for e in events if e.kind == "kill")}
    committed_by = {m: vw for vw, _, ms in ledger.log for m in ms}
    unrecorded = set(trained) - set(pushed)
    recorded = len(set(pushed)) == len(pushed) and set(pushed) <= set(trained)
    recorded = recorded and all(committed_by.get(m) in killed for m in unrecorded)
    return sorted(trained) == list(range(total)) and recorded


def summarize(job: _Job, ledger, records, events, seconds: float, parts, finite: bool) -> Summary:
    """The run's proof and numbers (see :class:`Summary`)."""
    import numpy as np

    options, dataset = job.options, parts["dataset"]
    samples = [dataset.indices(k)[0] for k in ledger.trained()]
    expected = np.concatenate([dataset.indices(k)[0] for k in range(options.steps)])
    got = np.sort(np.concatenate(samples)) if samples else np.zeros(0, expected.dtype)
    per_vw = {}
    for r in records:
        per_vw.setdefault(r.vw, []).append(r)
    totals = {vw: VWTotals.of(rs) for vw, rs in per_vw.items()}
    planned = {b.name: b.estimate for b in job.built if b.estimate is not None and b.name in totals}
    wave_times = {
        vw: WaveTime(e, totals[vw].wave_seconds, e / totals[vw].wave_seconds)
        for vw, e in planned.items()
    }
    return Summary(
        exactly_once=exactly_once(options.steps, ledger, records, events),
        samples_exactly_once=bool(np.array_equal(got, np.sort(expected))),
        weights_finite=finite,
        total=options.steps,
        minibatch=options.batch,
        distance=job.distance,
        nm=tuple(p.nm for p in job.plans),
        slowdown=options.slowdown,
        cluster=None if options.cluster is None else str(options.cluster),
        seconds=seconds,
        samples_per_second=options.steps * options.batch / seconds,
        dropped=tuple(ledger.dropped),
        left=tuple(ledger.left),
        virtual_workers=tuple(job.built),
        per_vw=totals,
        wave_times=wave_times,
        events=tuple(events),
        minibatches=tuple(m for r in records for m in Trained.of(r)),
        first_loss=records[0].losses[0] if records else None,
        last_losses=tuple(x for r in records[-3:] for x in r.losses),
    )


def table(summary: Summary) -> str:
    lines = [
        f"{'vw':6} {'waves':>6} {'minibatches':>11} {'pulls':>6} {'max lead':>8} "
        f"{'staleness local/global':>22} {'wait s':>7} {'compute s':>9} {'slowdown s':>10} "
        f"{'wave s':>7}"
    ]
    for vw, v in summary.per_vw.items():
        staleness = f"{v.max_local_staleness}/{v.max_global_staleness}"
        lines.append(
            f"{vw:6} {v.waves:6d} {v.minibatches:11d} {v.pulls:6d} {v.max_lead:8d} "
            f"{staleness:>22} {v.wait_seconds:7.2f} {v.compute_seconds:9.2f} "
            f"{v.slowdown_seconds:10.2f} {v.wave_seconds:7.3f}"
        )
    if summary.wave_times:
        lines.append("the planner's wave estimate vs the measured wave (median, fake CPU devices):")
    for vw, w in summary.wave_times.items():
        lines.append(
            f"  {vw}: estimated {w.estimated:.4f} s, measured {w.measured:.4f} s, "
            f"estimate / measured {w.ratio:.3f}"
        )
    lines.append(
        f"exactly once: minibatches {summary.exactly_once}, samples "
        f"{summary.samples_exactly_once}; dropped {list(summary.dropped)}; "
        f"{summary.samples_per_second:.1f} samples/s over {summary.seconds:.1f} s"
    )
    return "\n".join(lines)


def write_plot(records, path: pathlib.Path, options: WSPOptions) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    done = 0
    points: dict[str, list] = {}
    for r in sorted(records, key=lambda r: r.ended):  # in push order: samples trained so far
        for loss in r.losses:
            done += options.batch
            points.setdefault(r.vw, []).append((done, loss))
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
