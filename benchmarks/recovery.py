"""Recovery time after a lost process: the survivors' memory vs the last commit vs an orbax restart.

Every variant runs the same job under ``tenplex-jax launch`` (``examples/elastic_gpt.py``, the
GPT on ``--nprocs`` processes x ``--devices-per-proc`` CPU devices, laid out ``data=2`` across
processes: each tensor-parallel group spans processes, and its replica is the other group) and
loses the same host the same way: after step ``K`` = 3, one step past the last commit (and, in
the orbax variant, checkpoint) of step 2, the last worker and its store are SIGKILLed. The
launcher then starts a generation on the processes left, which restores

- **live**: the survivors' memory (the default): each survivor writes the boxes of its state at
  step 3 that it takes its turn for to its own store, and the new generation reads them; 0 lost
  steps;
- **commit**: the same job with ``--no-live``: the last complete commit in the tensor stores
  (step 2; the dead host's shards from their replicas), each process pulling only its shards;
  1 lost step;
- **orbax**: the orbax checkpoint of step 2 on disk, the way a JAX job restarts today: launched
  with no replicas (``--replicas 0``: the lost host's shards survive nowhere, so the launcher
  restores the checkpoint) and as a plain restart (``--no-standby --no-keep
  --no-executable-cache``: new processes, cold, each compiling the new layout). A planned change
  stops that job (SIGTERM: a checkpoint at the next step boundary) and launches it again on the
  new count, from the checkpoint;
- **commit, no keep** (``--no-keep``, optional): the commit's, with every process of the next
  generation new (warm standbys).

Recovery time = from the kill to the end of the first train step on the new config; it also holds
what the variants share (failure detection, process start-up, ``jax.distributed`` init, compiling
the step), so the *restore* column — the time ``job.start`` took to restore in process 0 —
isolates the part that differs, and the lost steps are what each must train again. It also holds
one step, which no way of recovering removes: the new configuration's steady step (the median of
its next steps) is shown, and the ratio of the stalls less a step each. The variants take turns,
``repeats`` rounds; the ratios are of the medians, measured in the same run.

    python -m tenplex_jax_benchmarks.recovery [--quick] [--repeats 2] [--no-keep]
    [--commit-overhead] [--out FILE]

``--commit-overhead`` also runs the job three times more, with a commit every 4 steps, after every
step and without commits, and reports the step time ratios: the price of the asynchronous commits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from tenplex_jax.multihost import LiveReport, RunDir, RunEvent

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "elastic_gpt.py"
# "live": the survivors stay and restore from their memory; "commit": they stay and restore the
# last commit; "orbax": a plain restart from the orbax checkpoint
VARIANTS = ("live", "commit", "orbax")
NO_KEEP = "commit, no keep"  # optional: every process of the next generation is new
CACHED = ("live, cached compile", "orbax, cached compile")  # optional: both with a warm cache
# the loop benchmark's GPT: 3.3M params, 38 MiB of state with the AdamW moments
FULL_MODEL = "seq_len=128,d_model=256,n_layers=4,n_heads=4,d_ff=1024"
# data=2 across processes (2 devices each): a tensor-parallel group spans processes
LAYOUTS = {
    FULL_MODEL: "8=data=2,tensor=4; 6=data=3,tensor=2; 4=data=2,tensor=2; 2=tensor=2",
    "tiny": "6=data=3,tensor=2; 4=data=2,tensor=2; 2=tensor=2",
}
COMMIT_EVERY, KILL_AFTER = 2, 3  # the kill comes one step after the last commit


CHANGES = {  # the change -> the row's name for it
    "kill": "lose 1 of {n} processes",
    "shrink": "planned shrink {n} -> {m} processes",
    "grow": "planned grow {m} -> {n} processes",
}


def run_recovery(
    *,
    quick: bool = False,
    repeats: int = 1,
    cached: bool = False,
    no_keep: bool = False,
    change: str = "kill",
    log=print,
) -> dict:
    """The recovery row: per variant, raw runs and medians; the orbax ÷ store ratios.

    ``change`` is a kill, or a planned shrink or grow (see :func:`recover_once`). ``cached``
    adds both variants again with JAX's persistent compilation cache (``--compile-cache``)
    warmed by an earlier launch on the processes left, so the new layout's step loads instead
    of compiling.
    """
    setup = (
        {"model": "tiny", "nprocs": 2, "devices_per_proc": 2}
        if quick
        else {"model": FULL_MODEL, "nprocs": 4, "devices_per_proc": 2}
    )
    variants = (*VARIANTS, *((NO_KEEP,) if no_keep else ()), *(CACHED if cached else ()))
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(repeats):
        for variant in variants:
            runs[variant].append(_measured(variant, change, setup, log))
    median = lambda key: {v: statistics.median(r[key] for r in runs[v]) for v in variants}
    total, restore = median("recovery_seconds"), median("restore_seconds")
    step = median("step_seconds")
    phases = {
        v: {k: statistics.median(r["phases"][k] for r in runs[v]) for k in runs[v][0]["phases"]}
        for v in variants
    }
    return {
        "kind": "recovery",
        "change": CHANGES[change].format(n=setup["nprocs"], m=setup["nprocs"] - 1),
        "kind_of_change": change,
        **setup,
        "state_bytes": runs["live"][0]["state_bytes"],
        "repeats": repeats,
        "runs": runs,
        "median_seconds": total,
        "median_restore_seconds": restore,
        "median_phases": phases,
        "median_step_seconds": step,
        "lost_steps": {v: max(r["lost_steps"] for r in runs[v]) for v in variants},
        "live_seconds": statistics.median(r["live_seconds"] or 0.0 for r in runs["live"]),
        "speedup": total["orbax"] / total["live"],
        "commit_speedup": total["commit"] / total["live"],
        # the stalls less one steady step each: what recovering adds to the step it ends with
        # (None when the live variant's stall is within a step: noise decides the ratio)
        "speedup_beyond_step": (total["orbax"] - step["orbax"]) / (total["live"] - step["live"])
        if total["live"] > step["live"]
        else None,
        **({"keep_speedup": total[NO_KEEP] / total["commit"]} if no_keep else {}),
        "restore_speedup": restore["orbax"] / restore["live"],
        **({"cached_speedup": total[CACHED[1]] / total[CACHED[0]]} if cached else {}),
    }


def _measured(variant: str, change: str, setup: dict, log) -> dict:
    """One :func:`recover_once` of ``variant`` (again when a process was lost before a planned
    change: the machine, not the change), logged."""
    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="tenplex-recovery-") as run_dir:
            try:
                result = recover_once(variant, pathlib.Path(run_dir), change=change, **setup)
                break
            except UnplannedFailure as error:
                if attempt == 2:
                    raise
                log(f"  {variant:6s} {change}: run again ({error})")
    phases = ", ".join(f"{k} {v:.2f}" for k, v in result["phases"].items())
    request = result["request_to_change"]
    log(
        f"  {variant:6s} {change} -> first step {result['recovery_seconds']:.2f} s "
        f"(restore {result['restore_seconds'] * 1e3:.0f} ms, lost steps "
        f"{result['lost_steps']}, {result['from_processes']} -> "
        f"{result['to_processes']} processes, {result['config']}; step loaded "
        f"{result['step_loaded']}, traced {result['step_traced']}, warm "
        f"{result['warm_processes']}; s: {phases}"
        + ("" if request is None else f"; request -> change {request:.2f}")
        + ")"
    )
    return result


def recover_once(
    variant: str,
    run: pathlib.Path,
    *,
    model: str,
    nprocs: int,
    devices_per_proc: int,
    change: str = "kill",
    kill_after: int = KILL_AFTER,
    after: int = 3,
    timeout: float = 300.0,
) -> dict:
    """One launched job, one change after step ``kill_after``, ``after`` steps on the new
    configuration (the first is the recovery's; the others time a steady step); the timings.

    ``change``: ``"kill"`` SIGKILLs the last worker and its store (``nprocs`` -> ``nprocs - 1``);
    ``"shrink"`` and ``"grow"`` ask for a planned resize (``nprocs`` -> ``nprocs - 1``, and
    ``nprocs - 1`` -> ``nprocs``), and the job is stopped (SIGTERM) after ``after`` steps of the
    new generation. The orbax variants restart plainly: after a kill the launcher finds no copy
    of the lost host's shards (``--replicas 0``) and restores the orbax checkpoint; a planned
    change stops the job (SIGTERM: a checkpoint) and launches it anew on the new count.
    """
    planned = change != "kill"
    if change == "grow":
        nprocs -= 1
    if variant in CACHED:
        _warm_cache(run, model, nprocs - 1, devices_per_proc, timeout)
    # planned: runs on until stopped (a shrink trains on while its layout compiles ahead)
    steps = 1000 if planned else kill_after + after
    script = ["--model", model, "--steps", str(steps), "--layouts", LAYOUTS[model]]
    flags = _flags(variant, nprocs, devices_per_proc, COMMIT_EVERY, run, run)
    log = ["--log", str(run / "steps.jsonl"), "--pause-after", str(kill_after)]
    proc = _launch(flags, [*script, *log], run / "launcher.log")
    relaunch, restart = False, None
    try:
        deadline = time.monotonic() + timeout
        dir = RunDir(run)
        _wait(lambda: _paused(run, kill_after, nprocs), proc, deadline, "the pause")
        if not variant.startswith("orbax"):  # its warm processes, started after the first step
            _wait(lambda: dir.events(RunEvent.STANDBY), proc, deadline, "the standby processes")
        killed = time.time()
        if planned:
            count = nprocs - 1 if change == "shrink" else nprocs + 1
            relaunch = _planned(variant, run, proc, deadline, count, kill_after, after)
        else:
            if not variant.startswith("orbax"):  # a failure comes after the job's first seconds:
                # process 0 compiled the next generation's step, the others lowered it
                ready = lambda: dir.ahead(0, processes=nprocs)
                _wait(ready, proc, deadline, "the compile-ahead after a loss")
                killed = time.time()
            stores = dir.events(RunEvent.STORES)[-1]["slots"]
            workers = dir.events(RunEvent.GENERATION)[-1]["pids"]
            for pid in (workers[-1], stores[str(nprocs - 1)]["pid"]):
                os.kill(pid, signal.SIGKILL)
        _finish(proc, deadline, variant, run / "launcher.log")
        if relaunch:
            restart = _restart(variant, run, flags, count, script, deadline, after)
    finally:
        _reap(proc)
    return timings(run, killed, nprocs, planned=planned, restart=restart)


def _flags(variant: str, nprocs: int, devices: int, every: int, run, home) -> list[str]:
    """The launcher's flags of ``variant`` (its run dir ``run``; the compilation cache and the
    checkpoints in ``home``): a commit every ``every`` steps; the orbax variants' a plain
    restart's (new processes, cold, each compiling the new layout) from an orbax checkpoint
    every ``every`` steps, no replicas (a lost host's shards come from orbax)."""
    flags = ["--nprocs", str(nprocs), "--devices-per-proc", str(devices)]
    flags += ["--commit-every", str(every), "--run-dir", str(run)]
    if variant in CACHED:
        flags += ["--compile-cache", str(home / "jax-cache")]
    if variant == "commit":
        flags += ["--no-live"]
    if variant == "central":  # Tenplex-Central (benchmarks/central.py)
        flags += ["--central"]
    if variant == NO_KEEP:
        flags += ["--no-keep"]
    if variant.startswith("orbax"):
        flags += ["--checkpoint-dir", str(home / "ckpt"), "--checkpoint-every", str(every)]
        flags += ["--replicas", "0", "--no-standby", "--no-keep", "--no-executable-cache"]
    return flags


def _planned(variant, run, proc, deadline, count: int, at: int, after: int) -> bool:
    """A planned change to ``count`` processes asked at the pause after step ``at``: the store
    variants resize, and the job stops after ``after`` steps on them; the orbax ones stop the
    job (a checkpoint at the next step boundary). Whether the job must be launched again."""
    orbax = variant.startswith("orbax")
    if orbax:
        proc.send_signal(signal.SIGTERM)
    else:
        (run / "resize").write_text(str(count))
    _wait(lambda: (run / "control.json").exists(), proc, deadline, "the request")
    (run / f"resume-{at}").write_text("")
    if not orbax:
        _wait(lambda: _stepped(run, generation=1) >= after, proc, deadline, "the new steps")
        proc.send_signal(signal.SIGTERM)  # a graceful stop: commit, exit 0
    return orbax


def _restart(variant, run, flags, count: int, script, deadline: float, after: int):
    """The stopped job launched again on ``count`` processes (from its orbax checkpoint), run
    for ``after`` steps, then stopped; its run dir."""
    restart = run / "restart"
    restart.mkdir()
    flags = [*flags]
    flags[flags.index("--nprocs") + 1] = str(count)
    flags[flags.index("--run-dir") + 1] = str(restart)
    script = [*script, "--log", str(restart / "steps.jsonl")]
    again = _launch(flags, script, restart / "launcher.log")
    try:
        _wait(lambda: _stepped(restart, generation=0) >= after, again, deadline, "the restart")
        again.send_signal(signal.SIGTERM)
        _finish(again, deadline, variant, restart / "launcher.log")
    finally:
        _reap(again)
    return restart


def _launch(flags: list[str], script: list[str], log: pathlib.Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "tenplex_jax", "launch", *flags, str(EXAMPLE), *script]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    with open(log, "wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _warm_cache(run, model: str, nprocs: int, devices_per_proc: int, timeout: float) -> None:
    """JAX's compilation cache warmed by one step on ``nprocs`` processes (the cached
    variants: the processes left after the change load the new layout's step)."""
    warm = run / "warm"
    warm.mkdir()
    flags = _flags(CACHED[0], nprocs, devices_per_proc, 1, warm, run)
    script = ["--model", model, "--steps", "1", "--layouts", LAYOUTS[model]]
    proc = _launch(flags, script, warm / "launcher.log")
    try:
        _finish(proc, time.monotonic() + timeout, "warm-up", warm / "launcher.log")
    finally:
        _reap(proc)


def _finish(proc, deadline: float, variant: str, log: pathlib.Path) -> None:
    _wait(lambda: proc.poll() is not None, proc, deadline, "the job to finish", done_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the {variant} job failed ({proc.returncode}):\n"
            + log.read_text(errors="replace")[-3000:]
        )


def _reap(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def _paused(run: pathlib.Path, step: int, processes: int) -> bool:
    return all((run / f"paused-{step}-p{i}").exists() for i in range(processes))


class UnplannedFailure(RuntimeError):
    """A planned change's run lost a process before the change (the machine, not the change)."""


def _stepped(run: pathlib.Path, generation: int) -> int:
    """How many steps ``generation`` has logged."""
    return sum(r["generation"] == generation for r in _steps(run))


def _steps(run: pathlib.Path) -> list[dict]:
    path = run / "steps.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


def timings(
    run: pathlib.Path,
    killed: float,
    nprocs: int,
    planned: bool = False,
    restart: pathlib.Path | None = None,
) -> dict:
    """A launched job's recovery from a change at wall-clock time ``killed``, read from its run
    dir (``tj.multihost.RunDir``): the seconds to the first step of generation 1 (or, for a
    ``restart``, of that launch's generation 0), and where they went. A planned change counts
    from the last step of generation 0 (it trains on until then): the stall."""
    records = _steps(run)
    if planned:
        killed = max(r["time"] for r in records if r["generation"] == 0)
    after = RunDir(restart or run)
    number = 0 if restart else 1
    new = sorted(
        (r for r in _steps(after.path) if r["generation"] == number), key=lambda r: r["step"]
    )
    first, restored = new[0], after.restored(number)
    generation = after.events(RunEvent.GENERATION)[number]
    events = RunDir(run).events()
    ended = next(
        e for e in events if e["event"] in (RunEvent.FAILURE, RunEvent.RESIZE, RunEvent.STOP)
    )
    if ended["event"] != (
        RunEvent.FAILURE if not planned else RunEvent.STOP if restart else RunEvent.RESIZE
    ):
        raise UnplannedFailure(f"generation 0 ended with {ended}, not the change measured")
    request = next((e for e in events if e["event"] == RunEvent.REQUEST), None)
    steps = after.first_steps(number)  # how each process got its step: loaded or compiled
    return {
        "recovery_seconds": first["time"] - killed,
        "phases": _phases(killed, ended["time"], restored, steps[0], first["time"]),
        # a steady step of the new configuration: the first step's own share of the recovery,
        # which no way of recovering removes
        "step_seconds": statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(new))
        if len(new) > 1
        else None,
        "step_loaded": [s.loaded for s in steps],
        # False: loaded as a program the process had lowered before (a survivor), nothing traced
        "step_traced": [s.traced for s in steps],
        "warm_processes": generation.get("warm"),
        "kept_processes": generation.get("kept"),  # survivors that stayed in their process
        "restore_seconds": restored.seconds,
        # the survivors' copy of their memory into their stores (the live variant), the slowest
        "live_seconds": max(
            (k.seconds for p in range(nprocs) if (k := RunDir(run).read(LiveReport, 0, p))),
            default=None,
        ),
        "restore_source": f"{generation['restore']}:{generation['step']}",
        # a restart knows nothing of the job before: the steps since its checkpoint
        "lost_steps": max(r["step"] for r in records) - restored.step
        if restart
        else generation["lost_steps"],
        "from_processes": nprocs,
        "to_processes": generation["processes"],
        # a planned change: the launcher's request to the generation's end (the job trains on
        # meanwhile, while the change's stores, standby and step get ready)
        "request_to_change": ended["time"] - request["time"] if planned else None,
        "config": first["config"],
        "state_bytes": restored.state_bytes,
    }


def _phases(killed: float, ended: float, restored, step, first: float) -> dict[str, float]:
    """Where the time goes, from the kill (wall clock): the launcher notices it and ends the
    generation (at ``ended``; grace included), the new processes start (python, imports,
    jax.distributed; a restart's launcher and stores too), prepare (abstract state, dataset),
    restore, then load the step (or compile it: what XLA took), and the rest of the first step
    (tracing and lowering, the batch, running it), which ends at ``first``."""
    return {
        "end_generation": ended - killed,
        "start": restored.joined - ended,
        "prepare": restored.restoring - restored.joined,
        "restore": restored.restored - restored.restoring,
        "compile_or_load": step.seconds,
        "first_step": first - restored.restored - step.seconds,
    }


def run_commit_overhead(
    *, quick: bool = False, steps: int = 24, repeats: int = 1, log=print
) -> dict:
    """Step time with asynchronous commits every 4 steps and every step vs without commits.

    Two launched jobs of the same model and process count; the median interval between
    consecutive steps (process 0's step log, first 4 steps dropped: compile and warm-up).
    """
    model, nprocs = ("tiny", 2) if quick else (FULL_MODEL, 4)
    variants = (("none", steps + 1), ("every 4 steps", 4), ("every step", 1))
    runs: dict[str, list[float]] = {name: [] for name, _ in variants}
    for name, every in variants * repeats:  # in turn, so the machine's noise hits all alike
        with tempfile.TemporaryDirectory(prefix="tenplex-commit-") as run_dir:
            run = pathlib.Path(run_dir)
            command = [
                sys.executable,
                "-m",
                "tenplex_jax",
                "launch",
                "--nprocs",
                str(nprocs),
                "--commit-every",
                str(every),
                "--run-dir",
                str(run),
                str(EXAMPLE),
                "--model",
                model,
                "--steps",
                str(steps),
                "--log",
                str(run / "steps.jsonl"),
            ]
            with open(run / "launcher.log", "wb") as out:
                done = subprocess.run(
                    command,
                    check=False,
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=os.environ | {"JAX_PLATFORMS": "cpu"},
                    timeout=600,
                )
            if done.returncode != 0:
                raise RuntimeError((run / "launcher.log").read_text(errors="replace")[-3000:])
            lines = (run / "steps.jsonl").read_text().splitlines()
            times = [json.loads(line)["time"] for line in lines][4:]
        runs[name].append(statistics.median(b - a for a, b in itertools.pairwise(times)))
        log(f"  commits {name:13s}: {runs[name][-1] * 1e3:.1f} ms/step")
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {
        "kind": "commit_overhead",
        "model": model,
        "nprocs": nprocs,
        "steps": steps,
        "runs": runs,
        "median_step_seconds": medians,
        "overhead": {k: medians[k] / medians["none"] - 1 for k in medians if k != "none"},
    }


def _wait(predicate, proc, deadline: float, what: str, done_ok: bool = False) -> None:
    while not predicate():
        if not done_ok and proc.poll() is not None:
            raise RuntimeError(f"the launcher exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def table(row: dict) -> str:
    m, r, lost = row["median_seconds"], row["median_restore_seconds"], row["lost_steps"]
    head = (
        "| recovery | state MiB | live s | commit s | orbax s | orbax / live | commit / live | "
        "lost steps (live, commit, orbax) | live restore ms | commit restore ms | "
        "orbax restore ms | orbax / live (restore) | survivors' copy ms | steady step s | "
        "orbax / live, less a step each |"
    )
    line = (
        f"| GPT {_name(row['model'])}, {row['change']} | {row['state_bytes'] / 2**20:.2f} | "
        f"{m['live']:.2f} | {m['commit']:.2f} | {m['orbax']:.2f} | "
        f"**{row['speedup']:.2f}x** | {row['commit_speedup']:.2f}x | "
        f"{lost['live']}, {lost['commit']}, {lost['orbax']} | "
        f"{r['live'] * 1e3:.0f} | {r['commit'] * 1e3:.0f} | {r['orbax'] * 1e3:.0f} | "
        f"**{row['restore_speedup']:.1f}x** | {row['live_seconds'] * 1e3:.0f} | "
        f"{row['median_step_seconds']['live']:.2f} | {_times(row['speedup_beyond_step'])} |"
    )
    names = list(row["median_phases"]["live"])
    origin = "kill" if row.get("kind_of_change", "kill") == "kill" else "last step"
    phases = [
        f"| seconds from the {origin} | " + " | ".join(n.replace("_", " ") for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ] + [
        f"| {v} | " + " | ".join(f"{row['median_phases'][v][n]:.2f}" for n in names) + " |"
        for v in row["median_phases"]
    ]
    extra = ""
    if NO_KEEP in m:
        extra += (
            f"\n\nWith every process of the next generation new (`--no-keep`): {m[NO_KEEP]:.2f} s "
            f"from the kill to the first step, {row['keep_speedup']:.2f}x the commit's."
        )
    if CACHED[0] in m:
        extra += (
            f"\n\nWith the new layout's step in a warm compilation cache (`--compile-cache`), "
            f"both: live {m[CACHED[0]]:.2f} s, orbax {m[CACHED[1]]:.2f} s from the kill to the "
            f"first step, orbax / live **{row['cached_speedup']:.2f}x**."
        )
    table = f"{head}\n|---|" + "---:|" * 14 + f"\n{line}{extra}\n\n"
    return table + "\n".join(phases)


def _times(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}x"


def _name(model: str) -> str:
    return "d_model=256, 4 layers" if model == FULL_MODEL else model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT tiny, 2 -> 1 processes")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of both variants")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--change",
        default="kill",
        help="comma-separated changes among kill, shrink, grow (planned resizes; default kill)",
    )
    parser.add_argument(
        "--no-keep",
        action="store_true",
        help="also the commit's recovery with every process of the next generation new",
    )
    parser.add_argument(
        "--cached-compile",
        action="store_true",
        help="both variants again with a compilation cache warmed on the processes left",
    )
    parser.add_argument(
        "--commit-overhead",
        action="store_true",
        help="also time steps with an asynchronous commit after every step vs without commits",
    )
    args = parser.parse_args(argv)
    rows = []
    for change in args.change.split(","):
        if change not in CHANGES:
            parser.error(f"--change takes {', '.join(CHANGES)}, got {change!r}")
        rows.append(
            run_recovery(
                quick=args.quick,
                repeats=args.repeats,
                cached=args.cached_compile,
                no_keep=args.no_keep,
                change=change,
            )
        )
        print(table(rows[-1]))
    row = rows[0] if len(rows) == 1 else {"rows": rows}
    if args.commit_overhead:
        row["commit_overhead"] = run_commit_overhead(quick=args.quick, repeats=args.repeats)
        for k, v in row["commit_overhead"]["overhead"].items():
            print(f"commits {k}: {v:+.1%} step time")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
