"""The benchmark suite behind ``tenplex-jax bench``: every ratio measured in one process run.

1. reshard matrix (``benchmarks.reshard``): tenplex_jax vs orbax save + restore, gather to host +
   ``device_put``, and plain ``device_put``, per change of parallel config;
2. bytes the executor copied vs the plan's minimum and vs a gather-to-one strategy;
3. bandwidth (minimum bytes ÷ time) vs the memcpy bandwidth of this machine;
4. peak memory during a reshard vs steady state;
5. loop overhead (``benchmarks.loop``);
6. resize stall with and without compile-ahead, and the persistent compilation cache
   (``benchmarks.compile_ahead``);
7. plan time vs tensors and devices (``benchmarks.plan_scaling``);
8. tensor store put / get throughput vs memcpy of the same bytes (``benchmarks.store``);
9. recovery after a lost process: tensor stores vs an orbax restart (``benchmarks.recovery``;
   launched jobs, so it adds about a minute even with ``--quick``; ``--no-recovery`` skips it).

``BenchOptions.only`` runs only the named rows (:data:`ROWS`; ``reshard:KIND`` one change of the
matrix); the summary and the verdicts then cover the goals those rows measure.

Writes ``DIR/results.json`` (one object per row: raw runs, medians, ratios), ``DIR/summary.md``
(the tables and goals) and PNG plots. JAX must be configured before its backend starts:
``configure_jax`` uses 8 GPUs when the machine has them, else 8 fake CPU devices.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import platform
import shutil
import subprocess
import sys
import time

DEVICES = 8
GOALS = {
    "orbax_speedup": 50.0,  # tenplex_jax at least 50x faster than orbax save + restore
    "bytes_ratio": 1.0,  # bytes copied = the plan's minimum
    "bandwidth_ratio": 0.5,  # at least half the memcpy bandwidth (mapped pages), geometric mean
    "fresh_ratio": 0.8,  # every row at least 0.8 of a memcpy into a fresh buffer
    "peak_ratio": 1.25,  # peak memory at most 1.25x the steady state
    "loop_overhead": 0.02,  # small GPT: at most 2 % slower steps than a plain jitted loop
    "loop_overhead_large": 0.01,  # the 3.3M-param GPT, whose steps are long: at most 1 %
    "plan_seconds": 1.0,  # 4096 devices x 1000 tensors planned in at most 1 s
    "stall_ratio": 5.0,  # a resize stalls at least 5x shorter with compile-ahead than without
}
# the rows ``--only`` selects, in the order the suite runs them; the memcpy baselines come with
# the reshard matrix, whose ratios they are the denominators of
ROWS = {
    "reshard": "the reshard matrix vs orbax, host and device_put; bytes, bandwidth, peak memory",
    "loop": "loop overhead against a plain jitted loop",
    "stall": "resize stall with and without compile-ahead; the persistent compilation cache",
    "plan": "make_plan time vs tensors and devices (abstract)",
    "store": "tensor store put / get throughput vs memcpy",
    "recovery": "recovery after a lost process, stores vs orbax restart (launched jobs)",
}
# one change of the matrix: reshard:KIND (benchmarks.reshard.MATRIX's kinds)
RESHARD_KINDS = ("dp", "tp", "fsdp", "pp", "mixed", "disjoint")


def parse_only(text: str) -> tuple[str, ...]:
    """``"reshard,stall"`` -> ``("reshard", "stall")``; ``ValueError`` (one line, the valid names)
    for an unknown or missing name."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    valid = (*ROWS, *(f"reshard:{kind}" for kind in RESHARD_KINDS))
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        what = f"unknown row {', '.join(map(repr, unknown))}" if unknown else "no row named"
        raise ValueError(f"{what}; the rows are {describe_rows()}")
    return names


def describe_rows() -> str:
    """The names ``--only`` takes, on one line."""
    return ", ".join(ROWS) + f" (reshard:KIND: one change, KIND one of {', '.join(RESHARD_KINDS)})"


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    out: pathlib.Path = pathlib.Path("out/bench")
    quick: bool = False
    repeats: int | None = None  # default: 3 (full), 2 (quick)
    recovery: bool = True  # the multi-process recovery row (launched jobs)
    # only these rows (names in ROWS, or reshard:KIND); None: every row, recovery as it says.
    # A recovery named here runs whatever ``recovery`` says
    only: tuple[str, ...] | None = None

    def wants(self, row: str) -> bool:
        """Whether the row named ``row`` (a key of :data:`ROWS`) runs."""
        if self.only is None:
            return row != "recovery" or self.recovery
        return row in self.only or (
            row == "reshard" and any(n.startswith("reshard:") for n in self.only)
        )

    def changes(self) -> tuple:
        """The changes of the reshard matrix that run."""
        from tenplex_jax_benchmarks.reshard import MATRIX

        if self.only is None or "reshard" in self.only:
            return MATRIX
        return tuple(c for c in MATRIX if f"reshard:{c.kind}" in self.only)

    @property
    def model(self) -> str:
        return "small" if self.quick else "gpt100m"

    @property
    def runs(self) -> int:
        return self.repeats or (2 if self.quick else 3)


def gpu_count() -> int:
    """GPUs ``nvidia-smi`` lists, without starting a JAX backend (0 when there is none)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def configure_jax(devices: int = DEVICES) -> str:
    """Use ``devices`` GPUs if there are that many, else as many fake CPU devices; the platform."""
    import jax

    if gpu_count() >= devices:
        return "gpu"
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # a backend already runs (in-process call): use it if it is big enough
        pass
    if len(jax.devices()) < devices:
        raise RuntimeError(
            f"the benchmark needs {devices} devices; JAX already started with "
            f"{len(jax.devices())} (run it in a fresh process)"
        )
    return jax.default_backend()


def run(options: BenchOptions, log=print) -> dict:
    """Run the benchmarks ``options`` selects (every row by default), write the outputs to
    ``options.out``; returns the results."""
    import jax

    from tenplex_jax_benchmarks import compile_ahead, loop, plan_scaling, reshard
    from tenplex_jax_benchmarks import store as store_bench
    from tenplex_jax_models import LOGICAL_RULES, GPTConfig, build_state, param_count

    started = time.perf_counter()
    sections: dict[str, float] = {}  # seconds each part took, so the bench says where time goes

    def lap(name: str) -> None:
        sections[name] = time.perf_counter() - started - sum(sections.values())

    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    if options.wants("reshard"):
        memcpy_bytes = (32 if options.quick else 512) * 2**20
        memcpy = reshard.memcpy_bandwidth(memcpy_bytes, repeats=max(options.runs, 5))
        fresh = reshard.memcpy_bandwidth(memcpy_bytes, repeats=max(options.runs, 5), fresh=True)
        rows.append(
            {
                "kind": "memcpy",
                "change": "memcpy",
                "bytes": memcpy_bytes,
                "bytes_per_s": memcpy,
                "fresh_bytes_per_s": fresh,
            }
        )
        log(
            f"memcpy bandwidth {memcpy / 1e9:.2f} GB/s ({memcpy_bytes // 2**20} MiB, np.copyto; "
            f"{fresh / 1e9:.2f} GB/s into a fresh buffer, one thread)"
        )

        _, state, _ = build_state(options.model, lr=1e-3)
        # on the host: placing it then copies, so no row's donation can free the source of the
        # next
        state = jax.device_get(state)
        log(
            f"reshard matrix: GPT {options.model}, {param_count(state):,} params + AdamW, "
            f"{options.runs} runs after a warm-up, per strategy"
        )
        for change in options.changes():
            rows.append(
                reshard.run_change(
                    change, state, LOGICAL_RULES, options.runs, memcpy, log, fresh=fresh
                )
            )
        del state
        lap("memcpy and reshard matrix")

    if options.wants("loop"):
        config = _loop_config()
        log(f"loop overhead ({config}):")
        # the small GPT, whose steps are short: with and without gradient units, with
        # compile-ahead off and running (--quick: plain data parallelism without); the
        # 3.3M-param GPT, whose steps are long, once
        variants = [(None, False)]
        if not options.quick:
            variants += [(None, True), (8, False), (8, True)]
        # pairs of blocks of 10 short steps: the median over the pairs holds to about a
        # percent on a shared machine (4 blocks of 5 steps moved it by 3-7 %)
        blocks = 6 if options.quick else 10
        for units, ahead in variants:
            row = loop.run_loop_overhead(
                GPTConfig.small(), config, 8, blocks, 10, grad_units=units, compile_ahead=ahead
            )
            log(loop.describe(row))
            rows.append(row | {"model": "small"})
        if not options.quick:
            large = GPTConfig(seq_len=128, d_model=256, n_layers=4, n_heads=4, d_ff=1024)
            row = loop.run_loop_overhead(large, config, 16, 4, 4)  # 16 steps each: about 50 s
            log(f"  {row['params']:,} params:" + loop.describe(row)[1:])
            rows.append(row | {"model": "large"})
        lap("loop overhead")

    if options.wants("stall"):
        log("resize stall, compile-ahead vs on demand:")
        model = "tiny" if options.quick else "small"
        # --quick: 3 steps after each change (5 in full) give its steady step
        after = 3 if options.quick else 5
        row = compile_ahead.run_compile_ahead(model, after=after, repeats=1, quick=options.quick)
        log(compile_ahead.describe(row))
        rows.append(row)
        lap("resize stall")

    if options.wants("plan"):
        log("plan scaling (abstract, no devices):")
        sizes = ((8, 64), (10, 100)) if options.quick else ((8, 64, 512, 4096), (10, 100, 1000))
        rows += plan_scaling.run_plan_scaling(*sizes, repeats=options.runs, log=log)
        lap("plan scaling")

    if options.wants("store"):
        rows.append(store_bench.run(options.quick, repeats=options.runs, log=log))
        lap("tensor store")

    if options.wants("recovery"):
        from tenplex_jax_benchmarks import recovery

        log("recovery after a lost process (launched jobs):")
        rows.append(recovery.run_recovery(quick=options.quick, repeats=1, log=log))
        lap("recovery")

    results = {
        "suite": "tenplex_jax bench",
        "quick": options.quick,
        "model": options.model,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "goals": GOALS,
        "rows": rows,
        "seconds": time.perf_counter() - started,
        "section_seconds": sections,
    }
    if options.only is not None:
        results["only"] = list(options.only)
    results["verdicts"] = verdicts(rows)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(results) + "\n")
    written = [out / "results.json", out / "summary.md", *plots(results, out)]
    log(summary_markdown(results))
    log(f"wrote {', '.join(map(str, written))} in {results['seconds']:.0f} s")
    return results


def _loop_config():
    import tenplex_jax as tj

    return tj.ParallelConfig(data=2, fsdp=2, tensor=2)


def machine() -> dict:
    import flax
    import jax
    import optax
    import orbax.checkpoint
    import psutil

    return {
        "platform": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()[:DEVICES]],
        "device_kind": jax.devices()[0].device_kind,
        "cpu_cores": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
        "os": platform.platform(),
        "versions": {
            "jax": jax.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "orbax-checkpoint": orbax.checkpoint.__version__,
        },
    }


def loop_name(row: dict) -> str:
    """A loop row's variant in words."""
    units = f"{row['grad_units']} gradient units" if row["grad_units"] else "plain DP"
    return f"{row['model']} GPT, {units}, compile-ahead {row['compile_ahead']}"


def _overhead(row: dict) -> float:
    return row["overhead"]


def _row(rows: list[dict], kind: str) -> dict | None:
    """The first row of ``kind``, or None when that row did not run (``--only``)."""
    return next((r for r in rows if r["kind"] == kind), None)


def verdicts(rows: list[dict]) -> dict:
    """Each goal whose rows ran: the measured value, the goal, and whether it is met."""
    reshards = [r for r in rows if r["kind"] == "reshard"]
    loops = [r for r in rows if r["kind"] == "loop"]
    stall = _row(rows, "compile_ahead")
    plans = [r for r in rows if r["kind"] == "plan"]
    measured, where = {}, {}
    if reshards:
        measured |= {
            "orbax_speedup": min(r["speedup"]["orbax"] for r in reshards),
            "bytes_ratio": max(r["bytes_ratio"] for r in reshards),
            "bandwidth_ratio": _geomean([r["bandwidth_ratio"] for r in reshards]),
            "fresh_ratio": min(r["fresh_ratio"] for r in reshards),
            "peak_ratio": max(r["peak_ratio"] for r in reshards),
        }
        where["bandwidth_ratio"] = "geometric mean over rows"
    for goal, model in (("loop_overhead", "small"), ("loop_overhead_large", "large")):
        worst = max((r for r in loops if r["model"] == model), default=None, key=_overhead)
        if worst is not None:
            measured[goal], where[goal] = worst["overhead"], loop_name(worst)
    if plans:
        largest = max(
            plans, key=lambda r: (r["devices"] * r["tensors"], r["median_seconds"]["make_plan"])
        )
        worst_plan = max(
            (
                r
                for r in plans
                if (r["devices"], r["tensors"]) == (largest["devices"], largest["tensors"])
            ),
            key=lambda r: r["median_seconds"]["make_plan"],
        )
        measured["plan_seconds"] = worst_plan["median_seconds"]["make_plan"]
        where["plan_seconds"] = f"{worst_plan['devices']} devices x {worst_plan['tensors']} tensors"
    if stall is not None:
        measured["stall_ratio"] = stall["stall_ratio"]
        where["stall_ratio"] = f"GPT {stall['model']}, {stall['change']}"
    at_least = {"orbax_speedup", "bandwidth_ratio", "fresh_ratio", "stall_ratio"}
    return {
        goal: {
            "measured": measured[goal],
            "goal": GOALS[goal],
            "met": (
                measured[goal] >= GOALS[goal] if goal in at_least else measured[goal] <= GOALS[goal]
            ),
            "at": where.get(goal, "worst row"),
        }
        for goal in GOALS
        if goal in measured
    }


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary_markdown(results: dict) -> str:
    """The tables and goals of the rows that ran, as Markdown."""
    mib = lambda n: f"{n / 2**20:,.0f}"
    rows = results["rows"]
    lines = []
    reshards = [r for r in rows if r["kind"] == "reshard"]
    if reshards:
        lines += [
            (
                "| change | moved MiB | tenplex ms | orbax ms | host ms | device_put ms | "
                "vs orbax | bound vs orbax | vs host | vs device_put | copied / min bytes | "
                "central / min bytes | bandwidth / memcpy | bandwidth / fresh memcpy | "
                "all copies / memcpy | peak / steady (RSS) | peak / steady (state) |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
    for r in reshards:
        m, x = r["median_seconds"], r["speedup"]
        lines.append(
            f"| {r['change']} | {mib(r['min_bytes'])} | {m['tenplex'] * 1e3:,.0f} | "
            f"{m['orbax'] * 1e3:,.0f} | {m['host'] * 1e3:,.0f} | {m['device_put'] * 1e3:,.0f} | "
            f"**{x['orbax']:.1f}x** | {r['orbax_speedup_bound']:.1f}x | {x['host']:.2f}x | "
            f"{x['device_put']:.2f}x | {r['bytes_ratio']:.2f} | {r['central_over_min']:.2f} | "
            f"{r['bandwidth_ratio']:.2f} | {r['fresh_ratio']:.2f} | "
            f"{r['copy_bandwidth_ratio']:.2f} | "
            f"{r['peak_ratio']:.3f} | {r['state_peak_ratio']:.3f} |"
        )
    loops = [r for r in rows if r["kind"] == "loop"]
    if loops:
        lines += [
            "",
            f"Loop overhead ({loops[0]['config']}; the median over pairs of adjacent blocks):",
            "",
            "| GPT | params | global batch | steps each | loop | tenplex_jax ms | plain jit ms "
            "| overhead |",
            "|---|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in loops:
            lines.append(
                f"| {r['model']} | {r['params']:,} | {r['global_batch']} | {r['steps_each']} | "
                f"{loop_name(r)} | {r['median_seconds']['tenplex'] * 1e3:.2f} | "
                f"{r['median_seconds']['plain'] * 1e3:.2f} | **{r['overhead']:+.2%}** |"
            )
    stall = _row(rows, "compile_ahead")
    if stall is not None:
        lines += ["", _stall_line(stall)]
    plans = [r for r in rows if r["kind"] == "plan"]
    if plans:
        lines += [
            "",
            "| plan change | devices | tensors | target shards | make_plan ms | µs per shard |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for r in plans:
        lines.append(
            f"| {r['plan_change']} | {r['devices']} | {r['tensors']} | {r['target_shards']:,} | "
            f"{r['median_seconds']['make_plan'] * 1e3:,.1f} | {r['microseconds_per_shard']:.2f} |"
        )
    store_rows = [r for r in rows if r["kind"] == "store"]
    if store_rows:
        from tenplex_jax_benchmarks import store as store_bench

        lines += ["", store_bench.summary_markdown(store_rows[0])]

    recovered = _row(rows, "recovery")
    if recovered is not None:
        from tenplex_jax_benchmarks.recovery import table

        lines += ["", table(recovered)]
    lines += [
        "",
        "Seconds per part: "
        + ", ".join(
            f"{name} {seconds:.0f}" for name, seconds in results.get("section_seconds", {}).items()
        )
        + f"; {results['seconds']:.0f} in all.",
    ]
    if results["verdicts"]:
        lines += ["", "| goal | measured | target | met |", "|---|---:|---:|---|"]
    for goal, v in results["verdicts"].items():
        lines.append(
            f"| {goal} ({v['at']}) | {v['measured']:.4g} | {v['goal']:g} | "
            f"{'yes' if v['met'] else '**no**'} |"
        )
    return "\n".join(lines).lstrip("\n")


def _stall_line(row: dict) -> str:
    a, o = row["median"]["compile_ahead"], row["median"]["on_demand"]
    p = row["persistent_cache"]
    line = (
        f"Resize stall (GPT {row['model']}, {row['change']}; the notice to the first step done on "
        f"7 devices): compile-ahead {a['stall_seconds']:.3f} s, compiled on demand "
        f"{o['stall_seconds']:.3f} s ({o['compile_wait_seconds']:.2f} s of it compiling): "
        f"**{row['stall_ratio']:.1f}x**."
    )
    if p is None:  # quick: no persistent-cache compiles
        return line
    return (
        f"{line} Persistent compilation cache: the 7-device step compiled cold in "
        f"{p['cold_compile_seconds']:.2f} s, read back from disk in "
        f"{p['warm_compile_seconds']:.2f} s."
    )


def plots(results: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """The reshard and plan-scaling plots of the rows that ran; the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    reshards = [r for r in results["rows"] if r["kind"] == "reshard"]
    plans = [r for r in results["rows"] if r["kind"] == "plan"]
    if reshards:
        written.append(_reshard_plot(plt, results, reshards, out / "reshard.png"))
    if plans:
        written.append(_plan_plot(plt, plans, out / "plan_scaling.png"))
    return written


def _reshard_plot(plt, results: dict, reshards: list[dict], path: pathlib.Path) -> pathlib.Path:
    from tenplex_jax_benchmarks.reshard import STRATEGIES

    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(STRATEGIES)
    for i, strategy in enumerate(STRATEGIES):
        ax.bar(
            [j + (i - (len(STRATEGIES) - 1) / 2) * width for j in range(len(reshards))],
            [r["median_seconds"][strategy] for r in reshards],
            width,
            label=strategy,
        )
    ax.set_xticks(range(len(reshards)), [r["change"] for r in reshards], rotation=15, fontsize=8)
    ax.set(
        yscale="log",
        ylabel="seconds (median)",
        title=f"Reshard time per strategy, GPT {results['model']}",
    )
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plan_plot(plt, plans: list[dict], path: pathlib.Path) -> pathlib.Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for change in sorted({r["plan_change"] for r in plans}):
        for tensors in sorted({r["tensors"] for r in plans}):
            sel = [r for r in plans if r["plan_change"] == change and r["tensors"] == tensors]
            ax.plot(
                [r["devices"] for r in sel],
                [r["median_seconds"]["make_plan"] for r in sel],
                marker="o",
                ls="-" if change == "reshape" else "--",
                label=f"{change}, {tensors} tensors",
            )
    ax.axhline(GOALS["plan_seconds"], color="gray", lw=1, ls=":")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="devices",
        ylabel="make_plan seconds (median)",
        title="Plan time vs devices and tensors (abstract)",
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
