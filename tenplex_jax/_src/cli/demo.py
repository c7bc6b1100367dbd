"""``tenplex-jax demo``: train the reference GPT with ``ElasticJob`` through a schedule of device
changes (``job.redeploy``), then the same steps without any; ``docs/cli.md`` says what the run
shows. :func:`choose_devices` stands in for a scheduler; ``train`` is shared with ``replay``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tenplex_jax._src.cli import parsing
from tenplex_jax._src.errors import LayoutError

if TYPE_CHECKING:
    import numpy as np

    from tenplex_jax._src.elastic.job import ElasticJob
    from tenplex_jax._src.elastic.trace import ResourceTrace
    from tenplex_jax._src.mesh import ParallelConfig

MIB = 2**20

EXAMPLES = """\
examples:
  tenplex-jax demo --out out/demo
      the mixture-of-experts GPT, 60 steps on 8 fake CPU devices, through every dimension:
      data=2,expert=4 on 8 -> expert=2,tensor=2 on 4 -> pipe=2,data=3 on 6 -> data=2,expert=4 on 8;
      params, optimizer state and losses bit-identical to a run without resizes
  tenplex-jax demo --no-bitwise --out out/parallel
      the same with tensor-, pipeline- and expert-parallel compute: equal to float32 rounding
  tenplex-jax demo --model small --schedule "0:data=8; 20:tensor=4; 40:pipe=2,fsdp=2"
      a schedule of your own: at each step, a layout over the model's axes
  tenplex-jax demo --model tiny --steps 8 --schedule 2:4,4:6,6:8 --batch 12
      a quick run on the device counts the planner lays out
  tenplex-jax demo --method device_put
      move the state with one jax.device_put instead of the per-shard plan executor

Device sets: the run starts on devices 0..N-1; a shrink keeps the lowest-numbered current devices; a
grow takes the highest-numbered devices (4 on 0..3 grown to 6 runs on 2..7). Each resize prints its
plan; the end prints a table of resizes and writes DIR/loss.png and DIR/summary.json.
"""


def add_parser(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="train the GPT on fake CPU devices, resharding as the device count changes",
        description="Train the reference GPT on fake CPU devices and reshard the whole train\n"
        "state at the steps of a schedule; write a loss plot and a JSON summary.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.set_defaults(command=command, name="demo")
    parsing.add_training_flags(demo, out="out/demo", model="moe-small")
    demo.add_argument(
        "--steps", type=parsing.positive, default=60, help="training steps (default: 60)"
    )
    demo.add_argument(
        "--bitwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="JobOptions(bitwise=True): each batch split over every axis, so no change alters a "
        "bit (default); --no-bitwise: tensor, pipeline and expert parallel compute",
    )
    demo.add_argument(
        "--schedule",
        type=_schedule,
        default=(),
        metavar="SCHEDULE",
        help="'STEP:N,...' moves the job onto N devices at each STEP (the planner picks the "
        "layout); 'STEP:axis=size,...; ...' onto that layout over the model's axes, a step-0 "
        "entry being the first (default: 0:data=2,expert=4; 15:expert=2,tensor=2; "
        "30:pipe=2,data=3; 45:data=2,expert=4 for the MoE GPT)",
    )
    demo.add_argument(
        "--devices",
        type=parsing.positive,
        default=8,
        help="fake CPU devices; the run starts on all of them (default: 8)",
    )
    parsing.add_job_flags(demo)


def command(args) -> int:
    """Configure JAX for fake CPU devices first, then run the demo and print its resize table."""
    if not use_cpu_devices(args.devices, "demo") or (
        args.bitwise and not use_bitwise_flags("demo")
    ):
        return 2
    options = options_from(args, model=args.model or "moe-small")
    summary = run(options)
    print()
    print(resize_table(summary))
    print(consistency_line(summary))
    print(f"wrote {options.out / 'loss.png'} and {options.out / 'summary.json'}")
    return 0


def use_cpu_devices(count: int, name: str) -> bool:
    """Ask JAX for ``count`` fake CPU devices before its backend starts; False, the reason
    printed, when a backend already runs (a command called in-process) with fewer."""
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # a backend already runs; use it if big enough
        if len(jax.devices()) < count:
            print(
                f"tenplex-jax {name}: error: JAX already started with {len(jax.devices())} "
                f"devices; the {name} needs {count} (run it in a fresh process)",
                file=sys.stderr,
            )
            return False
    return True


def use_bitwise_flags(name: str) -> bool:
    """Set the XLA flags a bitwise job needs before JAX's backend starts; False, the reason
    printed, when a backend already runs without them."""
    from tenplex_jax._src import bitwise

    try:
        bitwise.use_flags()
    except RuntimeError as error:
        print(f"tenplex-jax {name}: error: {error} (run it in a fresh process)", file=sys.stderr)
        return False
    return True


def options_from(args, **fields) -> DemoOptions:
    """The options of the flags of ``demo`` or ``replay``, with ``fields``."""
    cache = executable_cache(args.executable_cache, args.out)
    given = {"out": pathlib.Path(args.out), "grad_units": args.grad_units or None} | fields
    return DemoOptions(**parsing.fields_of(DemoOptions, args) | given | {"executable_cache": cache})


def executable_cache(value: str | None, out: str) -> pathlib.Path | None:
    """``--executable-cache``: DIR, ``none``, or by default OUT/executables."""
    if value is None:
        return pathlib.Path(out) / "executables"
    return None if value.lower() == "none" else pathlib.Path(value)


def _schedule(text: str) -> tuple[tuple[int, Layout], ...]:
    try:
        return parse_schedule(text)
    except ValueError as error:  # argparse would hide a ValueError's message
        raise argparse.ArgumentTypeError(str(error)) from None


# the default schedules, as parse_schedule reads them
MOE_SCHEDULE = "0:data=2,expert=4; 15:expert=2,tensor=2; 30:pipe=2,data=3; 45:data=2,expert=4"
DENSE_SCHEDULE = "0:data=8; 15:data=2,tensor=2; 30:pipe=2,data=3; 45:data=8"

Layout = int | tuple[tuple[str, int], ...]  # a device count, or (axis, size) pairs


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Everything a demo run depends on; the CLI flags map one to one onto these fields."""

    out: pathlib.Path = pathlib.Path("out/demo")
    model: str = "moe-small"
    steps: int = 60
    schedule: tuple[tuple[int, Layout], ...] = ()  # () : the model's default (see above)
    batch: int = 24
    lr: float = 3e-3
    method: str = "plan"
    devices: int = 8
    seed: int = 0
    grad_units: int | None = 8  # gradient units; None: plain data parallelism
    samples: int = 1000  # dataset size: not a multiple of the batch, so an epoch ends mid-run
    bitwise: bool = False  # JobOptions.bitwise
    notice_seconds: float = 0.0  # JobOptions.notice_seconds: a change waits for its step
    executable_cache: str | pathlib.Path | None = None  # JobOptions.executable_cache

    @property
    def plan(self) -> tuple[tuple[int, Layout], ...]:
        """The schedule, or the default for the mode and model."""
        if self.schedule:
            return self.schedule
        return parse_schedule(MOE_SCHEDULE if is_moe(self.model) else DENSE_SCHEDULE)


def is_moe(model: str) -> bool:
    return model.startswith("moe")


def parse_schedule(text: str) -> tuple[tuple[int, Layout], ...]:
    """``"15:4,30:6"`` → ``((15, 4), (30, 6))``: at step 15 move to 4 devices, at 30 to 6 (the
    planner picks each layout). With axis sizes, entries are separated by ``;``:
    ``"0:data=2,expert=4; 15:expert=2,tensor=2"`` starts on ``data=2,expert=4`` and moves to
    ``expert=2,tensor=2`` at step 15."""
    entries = text.split(";") if "=" in text else text.split(",")
    schedule = []
    for part in filter(None, (p.strip() for p in entries)):
        step, sep, layout = part.partition(":")
        layout = layout.strip()
        if not sep or not step.strip().isdigit():
            raise ValueError(
                "a schedule is 'step:devices,...' such as '15:4,30:6', or "
                "'step:axis=size,...;...' "
                f"such as '0:data=2,expert=4; 15:expert=2,tensor=2', got {text!r}"
            )
        if layout.isdigit():
            schedule.append((int(step), int(layout)))
            continue
        sizes = []
        for pair in filter(None, (p.strip() for p in layout.split(","))):
            axis, eq, size = pair.partition("=")
            if not eq or not axis.strip().isidentifier() or not size.strip().isdigit():
                raise ValueError(
                    f"a layout is axis=size pairs such as data=2,expert=4, got {part!r}"
                )
            sizes.append((axis.strip(), int(size)))
        if not sizes:
            raise ValueError(f"a schedule entry names devices or a layout, got {part!r}")
        schedule.append((int(step), tuple(sizes)))
    return tuple(schedule)


def layout_config(model: str, sizes: tuple[tuple[str, int], ...]):
    """The parallel config of axis sizes over the model's mesh (the MoE GPT has an ``expert``
    axis)."""
    from tenplex_jax._src.mesh import ParallelConfig
    from tenplex_jax_models import moe_config

    try:
        return moe_config(**dict(sizes)) if is_moe(model) else ParallelConfig(**dict(sizes))
    except (TypeError, ValueError) as error:
        axes = "pipe, data, fsdp, expert, tensor" if is_moe(model) else "pipe, data, fsdp, tensor"
        raise LayoutError(
            f"the {model} GPT's mesh has axes {axes}; got layout {dict(sizes)} ({error})"
        ) from None


def choose_devices(n: int, current: Sequence[int], total: int) -> tuple[int, ...]:
    """The device ids a job resized from ``current`` to ``n`` devices gets, out of ``0..total-1``,
    as a scheduler might give them: a shrink keeps the lowest-numbered current devices, a grow
    takes the ``n`` highest-numbered ones (8 → 4 → 6 → 8: 0..7, 0..3, 2..7, 0..7), an unchanged
    count keeps the current devices."""
    if not 1 <= n <= total:
        raise LayoutError(f"a job can run on 1 to {total} devices, asked for {n}")
    if n < len(current):
        return tuple(sorted(current)[:n])
    if n == len(current):
        return tuple(current)
    return tuple(range(total - n, total))


def schedule_trace(options: DemoOptions) -> tuple[ResourceTrace, dict | None, tuple[int, ...]]:
    """The schedule as a resource trace of ``redeploy`` events, checked before any training: (the
    trace, the layout of each device count or None for the planner's, the initial devices)."""
    from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent

    schedule = list(options.plan)
    layouts: dict[int, ParallelConfig] = {}

    def count(layout) -> int:
        if isinstance(layout, int):
            return layout
        config = layout_config(options.model, layout)
        n = config.num_devices
        if layouts.setdefault(n, config) != config:
            raise LayoutError(
                f"the demo runs one layout per device count, but {n} devices get both "
                f"{layouts[n]} and {config} in the schedule {format_schedule(options.plan)}"
            )
        return n

    first = schedule.pop(0)[1] if schedule and schedule[0][0] == 0 else options.devices
    current = tuple(range(count(first)))
    if len(current) > options.devices:
        raise LayoutError(f"the initial layout needs {len(current)} of {options.devices} devices")
    initial, last, events = current, 0, []
    for step, layout in schedule:
        if not last < step < options.steps:
            raise LayoutError(
                f"schedule steps must increase and lie in 1..{options.steps - 1} (the run has "
                f"{options.steps} steps), got {format_schedule(options.plan)}"
            )
        current = choose_devices(count(layout), current, options.devices)
        events.append(TraceEvent(step, "redeploy", devices=current))
        last = step
    if layouts and any(isinstance(layout, int) for _, layout in options.plan):
        raise LayoutError(
            f"a schedule gives every layout or none (device counts only, for the planner), got "
            f"{format_schedule(options.plan)}"
        )
    trace = ResourceTrace("schedule", options.devices, options.steps, tuple(events))
    return trace, layouts or None, initial


def format_schedule(schedule) -> str:
    """The schedule as ``parse_schedule`` reads it."""
    counts = all(isinstance(layout, int) for _, layout in schedule)
    return ("," if counts else "; ").join(
        f"{step}:" + (str(n) if isinstance(n, int) else ",".join(f"{a}={s}" for a, s in n))
        for step, n in schedule
    )


@dataclasses.dataclass
class Run:
    """What one training run produced."""

    job: ElasticJob
    state: list[np.ndarray]  # the final state, on the host
    losses: list[float]
    samples: list[np.ndarray]  # per step, the real samples of its global batch
    wall: float  # from the end of the first step to the end of the last
    start_up: float  # building the state and the first step (its compile)
    # per step run, in order: (step, when it ended, its timed seconds or None: not timed), in
    # perf_counter seconds
    ends: list[tuple[int, float, float | None]] = dataclasses.field(default_factory=list)


def train(
    options: DemoOptions,
    trace: ResourceTrace,
    source,
    bar,
    layouts: dict | None = None,
    initial: tuple[int, ...] | None = None,
    *,
    checkpoint_dir: pathlib.Path | None = None,
    checkpoint_every: int | None = None,
    **job_options,
) -> Run:
    """Train ``trace.steps`` steps of the GPT with ``ElasticJob`` through ``trace``'s events,
    starting on ``initial`` (default all devices), each device count on its layout in ``layouts``
    or else the planner's; ``job_options`` are ``JobOptions`` fields. The dataset PTC serves every
    step's global batch, so an event changes how it is split over ranks, never what it holds."""
    import jax
    import numpy as np

    from tenplex_jax._src.elastic.trace import replay

    step_fn = _train_step(options.model, options.lr, options.seed)
    losses, samples, ends = {}, {}, []

    def on_step(job, metrics):
        i = job.step - 1
        losses[i], samples[i] = float(metrics["loss"]), job.samples[job.samples >= 0]
        timed = job.step_log[-1] if job.step_log else None
        seconds = timed[1] if timed is not None and timed[0] == i else None
        ends.append((i, time.perf_counter(), seconds))
        # redrawn at tqdm's own interval: a redraw per step would slow the timed loop
        bar.set_postfix({"loss": f"{losses[i]:.3f}", "config": str(job.ptc.config)}, refresh=False)
        bar.update(job.step - bar.n)

    job_options["log"] = bar.write
    checkpoints = {"checkpoint_dir": checkpoint_dir, "checkpoint_every": checkpoint_every}
    with _job(options, trace, source, layouts, initial, job_options, **checkpoints) as job:
        tic = time.perf_counter()
        state = job.start(_init(options.model, options.lr, options.seed))
        step = job.jit(step_fn, program=_program(options.model, options.lr, options.seed))
        # what start-up made (modules, the model, JAX's caches) stays out of the collector's
        # full passes: each would walk it all, tenths of a second between two timed steps
        gc.collect()
        gc.freeze()
        state = replay(job, state, step, trace, on_step=on_step)
        host = [np.asarray(x) for x in jax.tree.leaves(state)]
    return Run(
        job=job,
        state=host,
        losses=[losses[i] for i in range(trace.steps)],
        samples=[samples[i] for i in range(trace.steps)],
        wall=ends[-1][1] - ends[0][1],
        start_up=ends[0][1] - tic,
        ends=ends,
    )


def _job(options, trace, source, layouts, initial, job_options: dict, **checkpoints) -> ElasticJob:
    """The job ``train`` runs, on the first ``trace.devices`` devices."""
    import jax

    from tenplex_jax._src.data import DatasetPTC
    from tenplex_jax._src.elastic.core import JobOptions
    from tenplex_jax._src.elastic.job import ElasticJob
    from tenplex_jax_models import CPU, LOGICAL_RULES, MOE_RULES, profile_of

    if layouts is None:  # the planner picks data and FSDP sizes with the model's profile
        job_options |= {"profile": profile_of(options.model), "device_type": CPU}
        config = None
    else:

        def config(n: int) -> ParallelConfig:
            if n not in layouts:
                raise LayoutError(f"the schedule gives no layout for {n} devices")
            return layouts[n]

    return ElasticJob(
        MOE_RULES if is_moe(options.model) else LOGICAL_RULES,
        DatasetPTC(source, options.batch, seed=options.seed),
        devices=jax.devices()[: trace.devices],
        initial=initial,
        grad_units=options.grad_units,
        config=config,
        steps=trace.steps,
        options=JobOptions(
            method=options.method,
            bitwise=options.bitwise,
            notice_seconds=options.notice_seconds,
            executable_cache=options.executable_cache,
            **job_options,
        ),
        **checkpoints,
    )


# one init and one train step object per model: the run without resizes compiles them from
# JAX's in-memory caches of the resized run's
@functools.cache
def _init(model: str, lr: float, seed: int):
    from tenplex_jax_models import build_state

    def init():
        return build_state(model, lr, seed)[1]

    return init


@functools.cache
def _train_step(model: str, lr: float, seed: int):
    from tenplex_jax_models import build_state, train_step

    return train_step(build_state(model, lr, seed, abstract=True)[0])


@functools.cache
def _program(model: str, lr: float, seed: int) -> str:
    """The name of the demo's step (``job.jit``'s ``program``): its model and hyperparameters,
    and the versions of the code that makes it, this package's and the models' read from their
    source, so that an edit of either is a new program."""
    import hashlib
    import importlib.metadata

    import tenplex_jax_models

    code = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parents[2]  # tenplex_jax
    for root in (package, pathlib.Path(tenplex_jax_models.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            code.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    versions = " ".join(f"{p} {importlib.metadata.version(p)}" for p in ("flax", "optax"))
    return f"tenplex-jax demo {model} lr {lr!r} seed {seed}; {versions}; code {code.hexdigest()}"


def run(options: DemoOptions) -> dict:
    """Train with resizes and once more without, write ``loss.png`` and ``summary.json``."""
    import jax
    from tqdm import tqdm

    from tenplex_jax._src.data import BatchLayout
    from tenplex_jax_models import build_state, corpus_samples, stdlib_corpus

    started = time.perf_counter()
    trace, layouts, initial = schedule_trace(options)
    if len(jax.devices()) < options.devices:
        raise LayoutError(f"the demo needs {options.devices} devices, found {len(jax.devices())}")
    BatchLayout(options.batch, 1, options.grad_units)  # a bad batch fails before any training
    _, abstract, cfg = build_state(options.model, options.lr, options.seed, abstract=True)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, options.samples)
    with tqdm(total=options.steps, desc=f"{options.model} resized", unit="step") as bar:
        resized = train(options, trace, source, bar, layouts, initial, exact_step_times=True)
        resized_seconds = time.perf_counter() - started
        bar.reset()
        bar.set_description(f"{options.model} fixed")
        no_events = dataclasses.replace(trace, events=())
        fixed = train(options, no_events, source, bar, layouts, initial, compile_ahead=False)
    summary = _summary(options, abstract, cfg, initial, resized, fixed)
    summary["resized_run_seconds"] = resized_seconds
    summary["total_seconds"] = time.perf_counter() - started
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    write_plot(out / "loss.png", summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _summary(options: DemoOptions, abstract, cfg, initial, resized: Run, fixed: Run) -> dict:
    """What ``summary.json`` says of the two runs (less their seconds)."""
    import numpy as np

    job = resized.job
    seen = np.concatenate(resized.samples)
    first = job.step_log[0] if job.step_log else (0, float("nan"), "")
    return {
        **model_summary(options, abstract, cfg, job),
        "steps": options.steps,
        "method": options.method,
        "devices": options.devices,
        "mode": "bitwise" if options.bitwise else "parallel compute",
        "not_bitwise": job.not_bitwise,
        "schedule": format_schedule(options.plan),
        "initial": {
            "config": str(job.config_for(len(initial))),
            "devices": list(initial),
            "first_step_seconds": first[1],
        },
        "resizes": [_resize_record(r, job.step_log) for r in job.records],
        "exactly_once": exactly_once(resized.samples, fixed.samples, options.samples),
        "samples_seen": int(seen.size),
        "samples_expected": options.steps * options.batch,
        "epochs": seen.size / options.samples,
        "data_state": dataclasses.asdict(job.dataset.state()),
        "params_vs_fixed_run": compare_states(resized.state, fixed.state),
        "losses": resized.losses,
        "fixed_run_losses": fixed.losses,
        "final_loss": resized.losses[-1],
        "compiles": job.compiles,
        "loads": job.loads,  # steps loaded from the executable cache instead of compiled
        # steps traced and lowered: none where a run before stored them (the step is named)
        "traced": sum(step.traced for step in job.steps_cache.done()),
    }


def model_summary(options: DemoOptions, abstract, cfg, job: ElasticJob) -> dict:
    """What the summaries of ``demo`` and ``replay`` say first: the model, its state, the data."""
    from tenplex_jax_models import param_count

    return {
        "model": options.model,
        "param_count": param_count(abstract),
        "state_bytes": job.ptc.nbytes,
        "global_batch": options.batch,
        "grad_units": options.grad_units,
        "dataset_samples": options.samples,
        "seq_len": cfg.seq_len,
        "lr": options.lr,
        "seed": options.seed,
    }


def _resize_record(r, step_log) -> dict:
    """One event of the schedule, as the summary and the table show it; ``stall_bound_seconds``,
    what the stall may take when the new layout's step was compiled ahead, is 1.5 x (reshard + one
    step of the new layout, the median of its later steps) + 0.1 s."""
    import statistics

    first = next((s for i, s, _ in step_log if i == r.step), float("nan"))
    later = [s for i, s, c in step_log if c == r.config_after and i != r.step]
    step = statistics.median(later) if later else first
    return {
        "step": r.step,
        "from": len(r.devices_before),
        "to": len(r.devices_after),
        "from_config": r.config_before,
        "to_config": r.config_after,
        "from_devices": r.devices_before,
        "to_devices": r.devices_after,
        "bytes_moved": r.bytes_moved,
        "bytes_kept": r.bytes_kept,
        "plan_seconds": r.plan_seconds,
        "seconds": r.reshard_seconds,
        "compile": r.compile,
        "compile_wait_seconds": r.compile_wait_seconds,
        "warm_up_seconds": r.warm_up_seconds,
        "notice_steps": r.notice_steps,
        "first_step_seconds": first,
        "step_seconds": step,
        "stall_seconds": r.stall_seconds,
        "stall_bound_seconds": 1.5 * (r.reshard_seconds + step) + 0.1,
        "bitwise": r.bitwise,
    }


def exactly_once(samples: list[np.ndarray], fixed: list[np.ndarray], num_samples: int) -> bool:
    """True if every step saw the fixed run's samples, and each epoch saw each sample once."""
    import numpy as np

    if len(samples) != len(fixed) or any(not np.array_equal(a, b) for a, b in zip(samples, fixed)):
        return False
    stream = np.concatenate(samples)
    for start in range(0, stream.size, num_samples):
        epoch = stream[start : start + num_samples]
        if np.unique(epoch).size != epoch.size:
            return False
        if epoch.size == num_samples and not np.array_equal(np.sort(epoch), np.arange(num_samples)):
            return False
    return True


def compare_states(got: list[np.ndarray], want: list[np.ndarray]) -> str | dict:
    """``"bitwise"`` if every leaf has the same bits, else the max abs and relative differences
    (a leaf's relative difference: its max abs difference over its max abs value)."""
    import numpy as np

    if all(np.array_equal(a, b) for a, b in zip(got, want)):
        return "bitwise"
    diffs = [
        (float(np.max(np.abs(a - b))), float(np.max(np.abs(b))))
        for a, b in zip(got, want)
        if np.issubdtype(b.dtype, np.floating) and b.size
    ]
    return {
        "max_abs": max(d for d, _ in diffs),
        "max_rel": max(d / m for d, m in diffs if m > 0),
    }


def write_plot(path: pathlib.Path, summary: dict) -> None:
    """Loss against step for the resized and the fixed run, with an "8→4" label at every resize."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, fixed, initial = summary["losses"], summary["fixed_run_losses"], summary["initial"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(len(fixed)), fixed, color="tab:orange", lw=3, alpha=0.5, label="no resizes")
    ax.plot(range(len(losses)), losses, color="tab:blue", lw=1.2, label="resized")
    top = max(losses + fixed) if losses else 1.0
    for record in summary["resizes"]:
        ax.axvline(record["step"] - 0.5, color="gray", ls="--", lw=1)
        ax.annotate(
            f"{record['from']}→{record['to']}\n{record['to_config']}",
            (record["step"] - 0.5, top),
            xytext=(3, 0),
            textcoords="offset points",
            va="top",
            fontsize=8,
        )
    moe = " + balance loss" if is_moe(summary["model"]) else ""
    ax.set(
        xlabel="step",
        ylabel=f"loss (next-byte cross entropy{moe})",
        title=f"GPT {summary['model']}, global batch {summary['global_batch']}, from "
        f"{initial['config']} on {len(initial['devices'])} devices",
    )
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resize_table(summary: dict) -> str:
    """The resizes of a run as a fixed-width table, for the terminal."""
    head = (
        f"{'step':>5} {'devices':>8} {'config':>42} {'to devices':>16} {'moved MiB':>10} "
        f"{'kept MiB':>10} {'reshard s':>10} {'step':>9} {'wait s':>7} {'stall s':>8} "
        f"{'bound s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in summary["resizes"]:
        configs = f"{r['from_config']}->{r['to_config']}"
        stall = "-" if r["stall_seconds"] is None else f"{r['stall_seconds']:.2f}"
        lines.append(
            f"{r['step']:5d} {str(r['from']) + '->' + str(r['to']):>8} {configs:>42} "
            f"{_ids(r['to_devices']):>16} {r['bytes_moved'] / MIB:10.3f} "
            f"{r['bytes_kept'] / MIB:10.3f} {r['seconds']:10.3f} {r['compile']:>9} "
            f"{r['compile_wait_seconds']:7.2f} {stall:>8} {r['stall_bound_seconds']:8.2f}"
        )
    if not summary["resizes"]:
        lines.append("(no resizes)")
    lines.append(
        f"(step: cached = compiled before the resize, ahead, waited = the resize waited for "
        f"its compile ahead (wait s); bound = 1.5 x (reshard + one step) + 0.1 s; state "
        f"{summary['state_bytes'] / MIB:.3f} MiB, final loss {summary['final_loss']:.4f}, "
        f"{summary['total_seconds']:.1f} s in all)"
    )
    return "\n".join(lines)


def consistency_line(summary: dict) -> str:
    """One line: did the resized run see the fixed run's data and reach its params?"""
    params = summary["params_vs_fixed_run"]
    if params != "bitwise":
        params = f"max abs diff {params['max_abs']:.2e}, max rel diff {params['max_rel']:.2e}"
    losses = "bitwise" if summary["losses"] == summary["fixed_run_losses"] else "differ"
    return (
        f"data: exactly once {summary['exactly_once']}, {summary['samples_seen']} samples seen of "
        f"{summary['samples_expected']} expected ({summary['epochs']:.2f} epochs); state vs a run "
        f"without resizes: {params}, losses {losses}"
    )


def _ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return ",".join(map(str, ids))
