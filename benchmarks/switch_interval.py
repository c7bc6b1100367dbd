"""A job's training loop beside a compile ahead, at the interpreter's switch interval (5 ms), at
the job's (``JobOptions.switch_interval``, 0.1 ms) and at any others given (``--intervals``).

The loop is GPT tiny's on 8 fake CPU devices: an iteration is ``job.next``, the step and reading
its loss. Beside it a second step cache works on GPT small's layouts (4 to 7 devices, a fresh step
function each time, so each is traced) on its compile thread, as compile-ahead does: either only
tracing and lowering them (``lower``: Python holding the GIL, the part the setting is for) or
compiling them whole (``compile``: XLA's compile, most of it without the GIL, follows). Rounds take
turns between the two settings; each reports the loop's median and mean iteration alone and beside
the background work (timed over at least two whole lowerings or compiles), and how many of them
finished per second.

    python -m tenplex_jax_benchmarks.switch_interval --out switch_interval.json
    python -m tenplex_jax_benchmarks.switch_interval --intervals 5e-4 1e-4 2e-5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import jax

INTERVALS = {"interpreter": 5e-3, "job": None}  # None: the job's default (JobOptions)


def run(rounds: int = 2, iterations: int = 60, others: tuple[float, ...] = ()) -> dict:
    import tenplex_jax as tj
    from tenplex_jax_models import (
        LOGICAL_RULES,
        build_state,
        corpus_samples,
        stdlib_corpus,
        train_step,
    )

    def job_of(model: str, batch: int):
        graphdef, _, cfg = build_state(model, 1e-3, abstract=True)
        source = corpus_samples(stdlib_corpus(), cfg.seq_len, num_samples=20 * batch)
        job = tj.ElasticJob(
            LOGICAL_RULES,
            tj.DatasetPTC(source, batch, seed=0),
            devices=jax.devices()[:8],
            grad_units=8,
            options=tj.elastic.JobOptions(compile_ahead=False),
        )
        return job, job.start(lambda: build_state(model, 1e-3)[1]), graphdef

    loop, state, graphdef = job_of("tiny", 16)
    step = loop.jit(train_step(graphdef))
    other, _, small = job_of("small", 24)
    other.jit(train_step(small))
    cache = other.steps_cache
    box = {"state": state}

    def iterations_ms(count: int) -> list[float]:
        times = []
        for _ in range(count):
            tic = time.perf_counter()
            box["state"], batch = loop.next(box["state"])
            box["state"], metrics = step(box["state"], batch)
            float(metrics["loss"])
            times.append((time.perf_counter() - tic) * 1e3)
        return times

    def lower(target, layout):  # trace and lower only: what compile-ahead does before XLA
        mesh, state, batch = cache._abstract(target, layout)
        return cache._lower(mesh, target, state, batch)[0]

    def background(mode: str, stop: threading.Event, done: list, failed: list) -> None:
        try:
            work(mode, stop, done)
        except BaseException as error:  # the loop waiting for the first one must not hang
            failed.append(error)
            raise

    def work(mode: str, stop: threading.Event, done: list) -> None:
        while not stop.is_set():
            target = other._target(tuple(range(4 + len(done) % 4)))
            layout = other._layout(target.config)
            cache.fn = train_step(small)  # a new function: traced again, as a new layout is
            if mode == "lower":
                cache._background(lower, target, layout)
            else:
                cache._background(cache.compile, target, layout, True)
            done.append(time.perf_counter())

    iterations_ms(10)  # the loop's step is compiled and warm
    settings = INTERVALS | {f"{seconds * 1e3:g} ms": seconds for seconds in others}
    runs = []
    for r in range(rounds):
        for mode in ("lower", "compile"):
            for name, seconds in settings.items():
                default = tj.elastic.JobOptions().switch_interval
                cache.switch_interval = seconds if seconds is not None else default
                alone = iterations_ms(iterations)
                stop, done, failed = threading.Event(), [], []
                thread = threading.Thread(target=background, args=(mode, stop, done, failed))
                thread.start()
                while not done:  # the first one includes warming up the tracing: not timed
                    if failed:
                        raise RuntimeError(f"the background {mode} failed") from failed[0]
                    time.sleep(0.01)
                tic, before = time.perf_counter(), len(done)
                beside = iterations_ms(iterations)
                while len(done) - before < 2 and len(beside) < 50 * iterations:
                    beside += iterations_ms(10)  # over at least two whole compiles or lowerings
                rate = (len(done) - before) / (time.perf_counter() - tic)
                stop.set()
                thread.join()
                row = {
                    "round": r,
                    "mode": mode,
                    "setting": name,
                    "switch_interval": cache.switch_interval,
                    "alone_ms": {
                        "median": statistics.median(alone),
                        "mean": statistics.mean(alone),
                    },
                    "beside_ms": {
                        "median": statistics.median(beside),
                        "mean": statistics.mean(beside),
                    },
                    "background_per_second": rate,
                }
                runs.append(row)
                print(
                    f"  {mode:7s} {name:11s} ({cache.switch_interval * 1e3:.2f} ms): loop "
                    f"{row['alone_ms']['median']:.1f} ms alone, {row['beside_ms']['median']:.1f} "
                    f"ms beside (mean {row['beside_ms']['mean']:.1f}); {rate:.2f} {mode}s/s",
                    flush=True,
                )
    loop.close()
    other.close()
    summary = {}
    for mode in ("lower", "compile"):
        rows = {
            name: [r for r in runs if r["mode"] == mode and r["setting"] == name]
            for name in settings
        }
        beside = {
            n: statistics.median(r["beside_ms"]["median"] for r in rs) for n, rs in rows.items()
        }
        alone = {
            n: statistics.median(r["alone_ms"]["median"] for r in rs) for n, rs in rows.items()
        }
        rate = {
            n: statistics.median(r["background_per_second"] for r in rs) for n, rs in rows.items()
        }
        summary[mode] = {
            "loop_beside_ms": beside,
            "loop_alone_ms": alone,
            "background_per_second": rate,
            # the loop beside the background work, at the interpreter's setting ÷ at the job's
            "loop_speedup": beside["interpreter"] / beside["job"],
            "background_slowdown": rate["interpreter"] / rate["job"] if rate["job"] else None,
        }
        for name in settings:
            if name not in INTERVALS:  # at the job's setting ÷ at this one
                summary[mode][f"loop_speedup_over {name}"] = beside[name] / beside["job"]
                summary[mode][f"background_slowdown_over {name}"] = (
                    rate[name] / rate["job"] if rate["job"] else None
                )
    return {"runs": runs, "summary": summary, "iterations": iterations, "rounds": rounds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--out", help="write the runs and the summary as JSON here")
    parser.add_argument(
        "--intervals", type=float, nargs="*", default=[], help="more settings to try (seconds)"
    )
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    result = run(args.rounds, args.iterations, tuple(args.intervals))
    for mode, s in result["summary"].items():
        print(
            f"{mode}: the loop beside it {s['loop_beside_ms']['interpreter']:.1f} ms at 5 ms, "
            f"{s['loop_beside_ms']['job']:.1f} ms at the job's setting ({s['loop_speedup']:.2f}x); "
            f"alone {s['loop_alone_ms']['job']:.1f} ms; the background work "
            + (
                f"{s['background_slowdown']:.2f}x slower"
                if s["background_slowdown"]
                else "did not finish once while timed"
            )
        )
        for key, value in s.items():
            if key.startswith("loop_speedup_over") and value is not None:
                name = key.removeprefix("loop_speedup_over ")
                slower = s[f"background_slowdown_over {name}"]
                print(
                    f"  at {name}: the loop {s['loop_beside_ms'][name]:.1f} ms ({value:.2f}x the "
                    f"job's)" + (f", the background work {slower:.2f}x as fast" if slower else "")
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
