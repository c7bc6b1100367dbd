"""Resize stall with and without compile-ahead, and what the persistent compilation cache saves.

A preemption notice (the job's last device goes) arrives while an :class:`ElasticJob` trains the
GPT on 8 devices; the stall is the time from the notice to the first step done on 7 devices: plan,
reshard, waiting for the new layout's step, and that step. Two jobs run in one process, the same
number of steps before the notice:

- ``compile_ahead``: a background thread has compiled the 7-device step before the notice (the
  job trains until it is ready, and the other variant trains as many steps);
- ``on_demand``: the step is compiled when the job moves onto 7 devices.

JAX's in-memory caches are cleared before each job, so neither reuses the other's executable.
A stall with the step compiled ahead should cost no more than the change itself: the row gives
the bound 1.5 x (reshard + one step) + 0.1 s beside it. What compile-ahead costs the running job:
steps per second on 8 devices while a background compile runs, against the same job's steps with
none (alternating, in one run). Then the persistent compilation cache
(``jax_compilation_cache_dir``): the 7-device step compiled cold into an empty cache directory,
and again after clearing the in-memory caches (a restarted process), read from disk.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax


def run_compile_ahead(
    model: str = "small", batch: int = 24, after: int = 5, repeats: int = 1, *, quick: bool = False
):
    """One row: both variants' stall seconds (medians over ``repeats``), their parts, the ratio;
    and, unless ``quick``, what a compile ahead costs the steps beside it and the persistent
    compilation cache's cold and warm compiles (four and two more compiles). ``quick``: one job
    for both stalls (``quick_pair``), whose steps take the global batch whole (no gradient
    units: each of its three compiles takes a fifth less)."""
    import tenplex_jax as tj
    from tenplex_jax.elastic import enable_compilation_cache
    from tenplex_jax_models import (
        CPU,
        LOGICAL_RULES,
        build_state,
        corpus_samples,
        profile_of,
        stdlib_corpus,
        train_step,
    )

    graphdef, _, cfg = build_state(model, 1e-3, abstract=True)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, num_samples=20 * batch)
    initial = jax.device_get(build_state(model, 1e-3)[1])  # placed by each job: no init compile

    def job_of(ahead: bool):
        jax.clear_caches()
        job = tj.ElasticJob(
            LOGICAL_RULES,
            tj.DatasetPTC(source, batch, seed=0),
            devices=jax.devices()[:8],
            grad_units=None if quick else 8,
            options=tj.elastic.JobOptions(
                compile_ahead=ahead,
                exact_step_times=True,
                profile=profile_of(model),
                device_type=CPU,
            ),
        )
        state = job.start(initial)
        return job, state, job.jit(train_step(graphdef))

    def one(ahead: bool, before: int | None):
        job, state, step = job_of(ahead)
        while before is None or job.step < before:
            state, b = job.next(state)
            state, _ = step(state, b)
            # train until the 7-device step is compiled, at least 3 steps
            if before is None and job.step >= 3 and job.is_compiled(range(7)):
                break
        steps_before = job.step
        job.preempt()  # what SIGTERM posts: the job's last device goes
        for _ in range(after):
            state, b = job.next(state)
            state, _ = step(state, b)
        job.close()
        (r,) = job.records
        return steps_before, stall_of(job, r)

    def stall_of(job, r) -> dict:
        """An event record's stall, its parts and its bound."""
        step_seconds = statistics.median(
            s for i, s, c in job.step_log if c == r.config_after and i > r.step
        )
        return {
            "stall_seconds": r.stall_seconds,
            "plan_seconds": r.plan_seconds,
            "reshard_seconds": r.reshard_seconds,
            "compile_wait_seconds": r.compile_wait_seconds,
            "compile_seconds": r.compile_seconds,
            "compile": r.compile,
            "first_step_seconds": r.stall_seconds
            - (r.plan_seconds + r.reshard_seconds + r.compile_wait_seconds),
            "step_seconds": statistics.median(
                s for i, s, c in job.step_log if c == r.config_before and 0 < i < r.step
            ),
            "stall_bound_seconds": 1.5 * (r.reshard_seconds + step_seconds) + 0.1,
        }

    def quick_pair():
        """--quick: both stalls in one job, 3 compiles instead of 4: 8 -> 7 devices with the step
        compiled ahead (waited for, not trained beside), then at once 7 -> 6 with the step
        compiled on demand (the boundary of a change starts no guess)."""
        job, state, step = job_of(True)
        for _ in range(3):  # the first step compiles, the others give the steady step
            state, b = job.next(state)
            state, _ = step(state, b)
        seven = job._target(tuple(range(7)))
        job.steps_cache.get(seven, job._layout(seven.config), ahead=True).result()
        rows = []
        for n in (7, 6):
            job.preempt()  # what SIGTERM posts: the job's last device goes
            for i in range(after):
                state, b = job.next(state)
                if n == 7 and i == 0:  # outstanding (and compiled): no guess of 6 devices
                    job.expect(range(8))
                state, _ = step(state, b)
            rows.append(stall_of(job, job.records[-1]))
        assert [r["compile"] for r in rows] == ["cached", "compiled"], rows
        job.close()
        return 3, *rows

    runs: dict[str, list[dict]] = {"compile_ahead": [], "on_demand": []}
    for _ in range(1 if quick else repeats):
        if quick:
            before, ahead_row, on_demand_row = quick_pair()
        else:
            before, ahead_row = one(True, None)
            on_demand_row = one(False, before)[1]
        runs["compile_ahead"].append(ahead_row)
        runs["on_demand"].append(on_demand_row)
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "compile"}
        for name, rs in runs.items()
    }
    ahead = median["compile_ahead"]
    row = {
        "kind": "compile_ahead",
        "model": model,
        "change": "8 -> 7 devices (data=8 -> data=7), preemption notice"
        if not quick
        else "8 -> 7 devices compiled ahead, then 7 -> 6 on demand, preemption notices, "
        "no gradient units",
        "steps_before_notice": before,
        "repeats": repeats,
        "runs": runs,
        "median": median,
        "stall_ratio": median["on_demand"]["stall_seconds"]
        / median["compile_ahead"]["stall_seconds"],
        "within_bound": ahead["stall_seconds"] <= ahead["stall_bound_seconds"],
        "compile_cost": None,
        "persistent_cache": None,
    }
    if quick:
        return row

    # what a background compile costs the steps: the 8-device job's steps while the 7- and
    # 6-device steps compile ahead, one at a time, against as many steps with none in between
    job, state, step = job_of(False)
    busy, idle = [], []
    for n in (7, 6):
        target = job._target(tuple(range(n)))
        future = job.steps_cache.get(target, job._layout(target.config), ahead=True)
        timed = 0
        while not future.done() or timed < 3:
            state, b = job.next(state)
            tic = time.perf_counter()
            state, _ = step(state, b)
            jax.block_until_ready(state)
            (busy if not future.done() else idle).append(time.perf_counter() - tic)
            timed += 1
        for _ in range(max(3, len(busy) // 4 - len(idle))):  # idle steps between the compiles
            state, b = job.next(state)
            tic = time.perf_counter()
            state, _ = step(state, b)
            jax.block_until_ready(state)
            idle.append(time.perf_counter() - tic)
    job.close()
    del state
    cost = {
        "steps_per_second_with_compile": 1 / statistics.median(busy),
        "steps_per_second_without": 1 / statistics.median(idle),
        "steps_with_compile": len(busy),
        "steps_without": len(idle),
    }
    cost["slowdown"] = cost["steps_per_second_without"] / cost["steps_per_second_with_compile"]

    # the persistent cache: a cold compile into an empty directory, then a "restarted" one
    job, state, _ = job_of(False)
    seven = tuple(range(7))
    with tempfile.TemporaryDirectory() as cache_dir:
        enable_compilation_cache(cache_dir)
        jax.clear_caches()
        cold = job.compile_seconds(seven)
        jax.clear_caches()
        warm = job.compile_seconds(seven)
        jax.config.update("jax_compilation_cache_dir", None)
        from tenplex_jax._src.compat import reset_compilation_cache

        reset_compilation_cache()
    job.close()
    del state
    row["compile_cost"] = cost
    row["persistent_cache"] = {"cold_compile_seconds": cold, "warm_compile_seconds": warm}
    return row


def describe(row: dict) -> str:
    a, o = row["median"]["compile_ahead"], row["median"]["on_demand"]
    p, c = row["persistent_cache"], row["compile_cost"]
    line = (
        f"  resize stall ({row['change']}, GPT {row['model']}): compile-ahead "
        f"{a['stall_seconds']:.3f} s (waited {a['compile_wait_seconds']:.3f} s for the step), "
        f"on demand {o['stall_seconds']:.3f} s (compile {o['compile_wait_seconds']:.3f} s): "
        f"{row['stall_ratio']:.1f}x (bound 1.5 x (reshard + step) + 0.1 = "
        f"{a['stall_bound_seconds']:.3f} s: {'met' if row['within_bound'] else 'missed'})"
    )
    if c is None:  # quick
        return line
    return (
        f"{line}; steps/s with a compile ahead running {c['steps_per_second_with_compile']:.1f}, "
        f"without {c['steps_per_second_without']:.1f} ({c['slowdown']:.2f}x slower); persistent "
        f"cache: cold compile {p['cold_compile_seconds']:.2f} s, "
        f"from disk {p['warm_compile_seconds']:.2f} s"
    )


if __name__ == "__main__":
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    import json

    tic = time.perf_counter()
    row = run_compile_ahead()
    print(json.dumps(row["median"], indent=1))
    print(describe(row), f"({time.perf_counter() - tic:.0f} s)")
