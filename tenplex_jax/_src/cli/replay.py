"""``tenplex-jax replay TRACE``: train the reference GPT through a resource trace with
``ElasticJob``, then the same steps without its events; per event what the job did and what it
cost, and the goodput next to checkpoint-restart's (``docs/elastic.md``). Training is ``demo``'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import time

from tenplex_jax._src.cli import demo, parsing
from tenplex_jax._src.cli.demo import MIB, DemoOptions, Run, train

EXAMPLES = """\
examples:
  tenplex-jax replay meshes/philly.toml --out out/trace
      a Philly-shaped resource trace (preemptions, a failure, offers) on the small GPT: per-event
      table, goodput against checkpoint-restart, DIR/summary.json
  tenplex-jax replay meshes/philly.toml --notice 30
      a preemption notice leaves the job its devices up to 30 s: the change waits for its
      layout's step to compile, training on meanwhile

The trace (TOML, see meshes/README.md) gives the devices, the steps and the events.
"""


def add_parser(sub) -> None:
    replay = sub.add_parser(
        "replay",
        help="replay a resource trace (preemptions, failures, offers) with the elastic loop",
        description="Train the reference GPT on fake CPU devices through a resource trace's\n"
        "events, then without them; per event what the job did and what it cost, and\n"
        "the goodput next to that of checkpoint-restart.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.set_defaults(command=command, name="replay")
    replay.add_argument(
        "trace", metavar="TRACE", help="the resource trace (TOML, see meshes/README.md)"
    )
    parsing.add_training_flags(replay, out="out/replay", model="small")
    parsing.add_job_flags(replay)
    replay.add_argument(
        "--no-compile-ahead",
        action="store_true",
        help="compile each layout's step only when the job moves onto it",
    )
    replay.add_argument(
        "--no-warm-up",
        action="store_true",
        help="do not run each step compiled ahead once on zeros before its change "
        "(JobOptions.warm_up): the first step after a change then pays the executable's "
        "one-time work",
    )


def command(args) -> int:
    """Configure JAX for the trace's fake CPU devices first, then replay it; print its table."""
    from tenplex_jax._src.elastic.trace import ResourceTrace

    trace = ResourceTrace.load(args.trace)
    if not demo.use_cpu_devices(trace.devices, "replay"):
        return 2
    options = demo.options_from(
        args, model=args.model or "small", steps=trace.steps, devices=trace.devices
    )
    summary = run(
        options, trace, compile_ahead=not args.no_compile_ahead, warm_up=not args.no_warm_up
    )
    print()
    print(event_table(summary))
    print(demo.consistency_line(summary | {"epochs": summary["samples_seen"] / args.samples}))
    print(f"wrote {options.out / 'summary.json'}")
    return 0


def run(options: DemoOptions, trace, *, compile_ahead: bool = True, warm_up: bool = True) -> dict:
    """Replay ``trace``, train a fixed run, measure the restart costs; write ``summary.json``."""
    from tqdm import tqdm

    from tenplex_jax_models import build_state, corpus_samples, stdlib_corpus

    started = time.perf_counter()
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)
    _, abstract, cfg = build_state(options.model, options.lr, options.seed, abstract=True)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, options.samples)
    with tqdm(total=trace.steps, desc=f"{options.model} {trace.name}", unit="step") as bar:
        elastic = train(
            options,
            trace,
            source,
            bar,
            checkpoint_dir=checkpoints if trace.checkpoint_every else None,
            checkpoint_every=trace.checkpoint_every,
            compile_ahead=compile_ahead,
            exact_step_times=True,
            warm_up=warm_up,
        )
        bar.reset()
        # the same replay without its events: the trace's checkpoints and compile-ahead too, so
        # that the ratio of the two goodputs is what the events cost
        quiet = out / "checkpoints-without-events"
        shutil.rmtree(quiet, ignore_errors=True)
        fixed = train(
            options,
            dataclasses.replace(trace, events=()),
            source,
            bar,
            checkpoint_dir=quiet if trace.checkpoint_every else None,
            checkpoint_every=trace.checkpoint_every,
            compile_ahead=compile_ahead,
            exact_step_times=True,
            warm_up=warm_up,
        )
        shutil.rmtree(quiet, ignore_errors=True)
        costs = restart_costs(elastic.job, checkpoints, options, bar.write)
    summary = _summary(options, trace, elastic, fixed, costs, abstract, cfg, compile_ahead)
    summary["warm_up"] = warm_up
    summary["total_seconds"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _summary(
    options: DemoOptions, trace, elastic: Run, fixed: Run, costs, abstract, cfg, compile_ahead
) -> dict:
    """What ``summary.json`` says of the replay, the fixed run and the restart costs (less the
    seconds in all)."""
    import numpy as np

    job = elastic.job
    events, step_seconds, goodput = _goodput(trace, elastic, fixed, costs)
    seen = np.concatenate(elastic.samples)
    return {
        **demo.model_summary(options, abstract, cfg, job),
        "compile_ahead": compile_ahead,
        "trace": dataclasses.asdict(trace),
        "events": events,
        "compiles": job.compiles,
        "compile_cache_hits": job.cache_hits,
        # steps traced and lowered (a loading run's named steps are not), and the compile
        # threads' seconds of work (lowering, loading and warming steps ahead)
        "traced": sum(step.traced for step in job.steps_cache.done()),
        "compile_thread_seconds": sum(stop - start for start, stop in job.steps_cache.background),
        "checkpoints": [{"step": s, "seconds": t} for s, t in job.checkpoints],
        "step_seconds_by_config": step_seconds,
        "goodput": goodput,
        "exactly_once": demo.exactly_once(elastic.samples, fixed.samples, options.samples),
        "samples_seen": int(seen.size),
        "samples_expected": trace.steps * options.batch,
        "params_vs_fixed_run": demo.compare_states(elastic.state, fixed.state),
        "losses": elastic.losses,
        "fixed_run_losses": fixed.losses,
    }


def _useful(run: Run) -> float:
    """Seconds of a run's timed steps after its first (which the start-up holds)."""
    return sum(s for i, s, _ in run.job.step_log if i > 0)


def _lost(elastic: Run, fixed: Run, step_seconds: dict[str, float]) -> dict:
    """What the elastic run's wall time went to besides its steps (seconds): the events' stalls
    less their first steps (split into their phases), the checkpoints the boundaries waited for,
    and the loop between timed steps; the same loop's seconds in the run without events, and
    how much longer than its layout's median step (``step_seconds``) each first step on a new
    layout took."""
    job = elastic.job
    phases = {"plan": 0.0, "reshard": 0.0, "executable": 0.0, "batch": 0.0, "restore": 0.0}
    stalls, first_excess = 0.0, 0.0
    for r in job.records:
        if r.stall_seconds is None:
            continue
        stalls += r.stall_seconds - r.first_step_seconds
        phases["plan"] += r.plan_seconds
        phases["reshard"] += r.reshard_seconds
        phases["executable"] += r.compile_wait_seconds
        phases["batch"] += r.batch_seconds
        phases["restore"] += r.restore_seconds
        first_excess += r.first_step_seconds - step_seconds[r.config_after]
    checkpoints = _checkpoints(elastic)
    phases["other"] = stalls - sum(phases.values())
    loop = elastic.wall - _useful(elastic) - stalls - checkpoints - job.lost_seconds
    return {
        "event_stalls": stalls,
        "event_phases": phases,
        "first_steps_beyond_median": first_excess,
        "checkpoints": checkpoints,
        "rewound_steps": job.lost_seconds,
        "loop": loop,
        "loop_beside_compiles": _loop_beside_compiles(elastic),
        "checkpoints_without_events": _checkpoints(fixed),
        "loop_without_events": fixed.wall - _useful(fixed) - _checkpoints(fixed),
    }


def _loop_beside_compiles(run: Run) -> dict:
    """The loop's gaps between two timed steps (the end of one to the end of the next, less the
    next's time) while the compile threads worked (lowering, loading or warming a layout's step
    ahead), against the other gaps: their seconds, count and median (ms). A boundary with an
    event or a checkpoint is left out: its gap holds the stall or the save."""
    import statistics

    job = run.job
    skip = {r.step for r in job.records} | {step for step, _ in job.checkpoints}
    background = list(job.steps_cache.background) if job.steps_cache is not None else []
    beside, otherwise = [], []
    for (_, before, _), (step, end, seconds) in zip(run.ends, run.ends[1:]):
        if seconds is None or step in skip:
            continue
        busy = any(start < end and stop > before for start, stop in background)
        (beside if busy else otherwise).append(end - before - seconds)

    def median_ms(gaps):
        return statistics.median(gaps) * 1e3 if gaps else None

    return {
        "seconds": sum(beside),
        "steps": len(beside),
        "median_gap_ms": median_ms(beside),
        "other_steps": len(otherwise),
        "other_median_gap_ms": median_ms(otherwise),
    }


def _checkpoints(run: Run) -> float:
    """Seconds a run's boundaries waited for its checkpoints (after the first step)."""
    return sum(s for step, s in run.job.checkpoints if step > 0)


def _goodput(trace, elastic: Run, fixed: Run, costs) -> tuple[list[dict], dict, dict]:
    """(each event with what checkpoint-restart paid for it, the median step seconds of each
    layout, the goodput of both policies and of the run without events, and its parts)."""
    import statistics

    from tenplex_jax._src.elastic.trace import checkpoint_restart, elastic_overhead

    job, wall = elastic.job, elastic.wall
    useful = _useful(elastic)
    by_config: dict[str, list[float]] = {}
    for _, s, c in job.step_log:
        by_config.setdefault(c, []).append(s)
    step_seconds = {c: statistics.median(v) for c, v in by_config.items()}
    baseline = checkpoint_restart(
        job.records,
        step_seconds,
        costs,
        steps=trace.steps,
        checkpoint_every=trace.checkpoint_every,
        useful_seconds=useful,
        wall_seconds=wall,
        elastic_overhead_seconds=elastic_overhead(job),
    )
    events = [
        dataclasses.asdict(r) | {"checkpoint_restart": c}
        for r, c in zip(job.records, baseline.pop("events"))
    ]
    no_events = _useful(fixed) / fixed.wall
    goodput = {
        "elastic": useful / wall,
        "no_events": no_events,
        "elastic_over_no_events": useful / wall / no_events,
        "checkpoint_restart": baseline["goodput"],
        "useful_seconds": useful,
        "lost_seconds": job.lost_seconds,
        "elastic_wall_seconds": wall,
        "start_up_seconds": elastic.start_up,
        "checkpoint_restart_seconds": baseline["seconds"],
        "checkpoint_restart_event_seconds": baseline["event_seconds"],
        "elastic_overhead_seconds": elastic_overhead(job),
        "checkpoint_restart_periodic_saves": baseline["periodic_saves"],
        "restart_costs": dataclasses.asdict(costs),
        "lost_seconds_to": _lost(elastic, fixed, step_seconds),
    }
    return events, step_seconds, goodput


def restart_costs(job, checkpoints, options, log):
    """A save (the run's median, or one timed now), a restore onto each layout the run moved to,
    and a fresh compile of each, measured now on the run's final state and checkpoints
    (``RestartCosts``)."""
    import statistics

    import jax

    from tenplex_jax._src.checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint
    from tenplex_jax._src.elastic.trace import RestartCosts
    from tenplex_jax._src.executor import place
    from tenplex_jax._src.ptc import PTC, ParallelConfig
    from tenplex_jax_models import LOGICAL_RULES, build_state

    saves = [s for _, s in job.checkpoints]
    if latest_checkpoint(checkpoints) is None or not saves:
        state = place(build_state(options.model, options.lr, options.seed)[1], job.ptc)
        tic = time.perf_counter()
        save_checkpoint(checkpoints, state, job.ptc, step=10**9, data_state=job.dataset.state())
        saves = [time.perf_counter() - tic]
    _, abstract, _ = build_state(options.model, options.lr, abstract=True)
    restore, compile_s = {}, {}
    layouts = {r.config_after: r.devices_after for r in job.records if r.decision != "stay"}
    for config, ids in layouts.items():
        target = PTC.of(abstract, LOGICAL_RULES, ParallelConfig.parse(config), ids)
        tic = time.perf_counter()
        restored = restore_checkpoint(checkpoints, target)
        jax.block_until_ready(jax.tree.leaves(restored.state))
        restore[config] = time.perf_counter() - tic
        jax.clear_caches()  # a restarted process compiles from scratch
        compile_s[config] = job.compile_seconds(ids)
        log(
            f"restart onto {config}: restore {restore[config]:.2f} s, compile "
            f"{compile_s[config]:.2f} s"
        )
    return RestartCosts(
        save_seconds=statistics.median(saves), restore_seconds=restore, compile_seconds=compile_s
    )


def event_table(summary: dict) -> str:
    """The events of a trace replay as a fixed-width table, for the terminal."""
    head = (
        f"{'step':>4} {'event':>8} {'devices':>7} {'decision':>8} {'config':>18} {'moved MiB':>9} "
        f"{'reshard s':>9} {'compile':>14} {'stall s':>7} {'lost':>4} {'ckpt-restart s':>14}"
    )
    lines = [head, "-" * len(head)]
    for e in summary["events"]:
        devices = f"{len(e['devices_before'])}->{len(e['devices_after'])}"
        compile_ = f"{e['compile']} {e['compile_wait_seconds']:.2f}" if e["compile"] else "-"
        stall = "-" if e["stall_seconds"] is None else f"{e['stall_seconds']:.2f}"
        lines.append(
            f"{e['step']:4d} {e['kind']:>8} {devices:>7} {e['decision']:>8} "
            f"{e['config_after']:>18} {e['bytes_moved'] / MIB:9.3f} {e['reshard_seconds']:9.3f} "
            f"{compile_:>14} {stall:>7} {e['lost_steps']:4d} "
            f"{e['checkpoint_restart']['seconds']:14.2f}"
        )
    g = summary["goodput"]
    lines.append(
        f"goodput: elastic {g['elastic']:.1%} ({g['useful_seconds']:.1f} s of steps in "
        f"{g['elastic_wall_seconds']:.1f} s), without events {g['no_events']:.1%} (elastic ÷ "
        f"without {g['elastic_over_no_events']:.3f}), checkpoint-restart "
        f"{g['checkpoint_restart']:.1%} ({g['checkpoint_restart_seconds']:.1f} s); "
        f"{summary['compiles']} compiles, {summary['compile_cache_hits']} cache hits"
    )
    lost = g["lost_seconds_to"]
    phases = ", ".join(f"{k} {v:.2f}" for k, v in lost["event_phases"].items() if v)
    lines.append(
        f"seconds besides steps: event stalls {lost['event_stalls']:.2f} ({phases}; first "
        f"steps {lost['first_steps_beyond_median']:+.2f} beyond their layouts' median), "
        f"checkpoints {lost['checkpoints']:.2f} (without events "
        f"{lost['checkpoints_without_events']:.2f}), rewound steps {lost['rewound_steps']:.2f}, "
        f"the loop between steps {lost['loop']:.2f} (without events "
        f"{lost['loop_without_events']:.2f})"
    )
    beside = lost["loop_beside_compiles"]
    if beside["steps"]:
        lines.append(
            f"the loop beside compile-ahead's work: {beside['seconds']:.2f} s over "
            f"{beside['steps']} steps, median gap {beside['median_gap_ms']:.2f} ms against "
            f"{beside['other_median_gap_ms'] or 0:.2f} ms over the other {beside['other_steps']}"
        )
    return "\n".join(lines)
