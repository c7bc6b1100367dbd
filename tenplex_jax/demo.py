"""The ``tenplex-jax demo``: train the reference GPT while the device set changes under it.

The job starts on all fake CPU devices and, at the steps of a schedule, is moved onto a different
number of devices: the whole train state (params, AdamW moments, step counters) is resharded with a
plan from the old PTC to the new one, and training goes on with the same batches it would have seen
without the change. Losses, resize costs and a plot are written to an output folder, so the run
shows that a resize neither disturbs the loss curve nor costs more than the bytes the plan moves.

The planner chooses each layout and a small policy stands in for a scheduler:

- ``choose_config`` asks ``tenplex_jax.planner.choose`` for a device count's best config;
- ``choose_devices`` picks which device ids a resized job gets (see its docstring for the rule).

The reference model lives in ``models/``, outside the library; it is imported inside functions only,
so that ``tenplex_jax`` itself never depends on it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax.cluster import GIB, Cluster, DeviceType
from tenplex_jax.data import BatchLayout, DatasetPTC
from tenplex_jax.errors import LayoutError, PlanError
from tenplex_jax.plan import allocate, make_plan
from tenplex_jax.planner import choose
from tenplex_jax.ptc import PTC, ParallelConfig
from tenplex_jax.train import BATCH_AXES, batch_value_and_grad, device_batch
from tenplex_jax.transform import place, reshard

MIB = 2**20
# One fake CPU device, as in meshes/cpu8.toml.
CPU = DeviceType("cpu", memory=2 * GIB, flops=5e9, link_bandwidth=10e9)


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Everything a demo run depends on; the CLI flags map one to one onto these fields."""

    out: pathlib.Path = pathlib.Path("out/demo")
    model: str = "small"
    steps: int = 60
    schedule: tuple[tuple[int, int], ...] = ((15, 4), (30, 6), (45, 8))  # (step, device count)
    batch: int = 24
    lr: float = 3e-3
    method: str = "plan"
    devices: int = 8
    seed: int = 0
    workers: int | None = 8  # virtual data-parallel workers; None: plain data parallelism
    samples: int = 1000  # dataset size: not a multiple of the batch, so an epoch ends mid-run


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stretch of training on one layout, from step ``start`` until the next stage begins."""

    start: int
    config: ParallelConfig
    device_ids: tuple[int, ...]


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """``"15:4,30:6"`` → ``((15, 4), (30, 6))``: at step 15 move to 4 devices, at 30 to 6."""
    schedule = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, sep, count = part.partition(":")
        if not sep or not step.strip().isdigit() or not count.strip().isdigit():
            raise ValueError(f"a schedule is 'step:devices,...' such as '15:4,30:6', got {text!r}")
        schedule.append((int(step), int(count)))
    return tuple(schedule)


def build_state(model, lr: float, seed: int = 0, *, abstract: bool = False):
    """(graphdef, state, GPTConfig) of the GPT and its AdamW optimizer, built without a mesh.

    ``model`` is a preset name (``"tiny"``, ``"small"``, ``"gpt100m"``) or a ``GPTConfig``.

    Built under ``use_eager_sharding(False)`` so no mesh is needed: the layout comes afterwards, by
    ``place`` for a live state or by ``PTC.of`` for an abstract one (``abstract=True`` gives
    ``ShapeDtypeStruct`` leaves via ``nnx.eval_shape``: no device touched, nothing allocated).
    """
    import optax

    from models import GPT, GPTConfig

    cfg = model if isinstance(model, GPTConfig) else GPTConfig.by_name(model)

    def build():
        gpt = GPT(cfg, rngs=nnx.Rngs(seed))
        # named parts, so that tree paths (and plan groups) read "model/..", "optimizer/.."
        return {"model": gpt, "optimizer": nnx.Optimizer(gpt, optax.adamw(lr), wrt=nnx.Param)}

    with nnx.use_eager_sharding(False):
        nodes = nnx.eval_shape(build) if abstract else build()
    graphdef, state = nnx.split(nodes)
    return graphdef, state, cfg


def param_count(state) -> int:
    """Parameters of the model part of a ``{"model", "optimizer"}`` state."""
    return sum(math.prod(v.shape) for v in jax.tree.leaves(state["model"]))


def choose_config(
    n: int, abstract_state, global_batch: int, rules=None, *, model: str = "small"
) -> ParallelConfig:
    """The planner's parallel config for the GPT on ``n`` fake CPU devices.

    Candidates are the ``(data, fsdp)`` meshes of ``n`` devices that lay the state out without
    replicating an indivisible dim; ``tenplex_jax.planner.choose`` picks the fastest under its cost
    model for ``CPU`` devices (``meshes/cpu8.toml``). The demo promises parameters bitwise equal to
    a run that never resized: virtual workers make that hold across data-parallel and FSDP sizes,
    but a change of tensor or pipeline degree changes summation order, so it keeps ``tensor=1`` and
    ``pipe=1`` (its per-example losses also run inside a ``shard_map`` over the batch axes).
    Pipelined layouts are trained in ``tests/test_pipeline.py`` and timed in
    ``benchmarks/pipeline_step.py``; ``tenplex-jax plan --cluster`` shows the unrestricted choice.
    """
    if rules is None:
        from models import LOGICAL_RULES as rules
    valid, refused = [], []
    for config in _configs(n):
        try:
            PTC.of(abstract_state, rules, config, range(n))
        except LayoutError as error:
            refused.append(f"{config}: {str(error).split(';')[0]}")  # the rule, not the advice
            continue
        valid.append(config)
    try:
        choice = choose(
            Cluster.uniform(n, CPU, per_node=n), _profile(model), global_batch, configs=valid
        )
    except PlanError as error:
        raise LayoutError(
            f"no (data, fsdp) config lays the state out on {n} devices with global batch "
            f"{global_batch}: {error}; refused by the layout: " + "; ".join(refused)
        ) from None
    return choice.best.config


def choose_devices(n: int, current: Sequence[int], total: int) -> tuple[int, ...]:
    """The device ids a job resized from ``current`` to ``n`` devices gets, out of ``0..total-1``.

    The rule mimics a scheduler: a shrink keeps the lowest-numbered current devices (the job gives
    back its top devices); a grow takes the ``n`` highest-numbered devices (the devices freed at the
    top of the machine), so it overlaps the current set only partly. The default schedule 8 → 4 → 6
    → 8 thus runs on 0..7, then 0..3 (smaller), 2..7 (overlapping: 2 and 3 keep their shards, 4..7
    are new) and 0..7 (larger). An unchanged count keeps the current devices.
    """
    if not 1 <= n <= total:
        raise LayoutError(f"a job can run on 1 to {total} devices, asked for {n}")
    if n < len(current):
        return tuple(sorted(current)[:n])
    if n == len(current):
        return tuple(current)
    return tuple(range(total - n, total))


def plan_stages(options: DemoOptions, abstract_state) -> list[Stage]:
    """The layout of every stretch of the run, fixed before training so bad input fails at once."""
    last = 0
    for step, _ in options.schedule:
        if not last < step < options.steps:
            raise LayoutError(
                f"schedule steps must increase and lie in 1..{options.steps - 1} (the run has "
                f"{options.steps} steps), got {options.schedule}"
            )
        last = step
    stages, current = [], ()
    for start, n in ((0, options.devices), *options.schedule):
        ids = tuple(range(n)) if not current else choose_devices(n, current, options.devices)
        config = choose_config(n, abstract_state, options.batch, model=options.model)
        stages.append(Stage(start, config, ids))
        current = ids
    return stages


def make_train_step(graphdef, ptc: PTC, layout: BatchLayout):
    """The jitted ``(state, batch, weights) -> (state, loss)`` for one layout; donates the state.

    Pure in the state, so that the state stays a plain tree the planner can reshard between steps,
    and pinned to the PTC's shardings, so that each step keeps the layout the next plan starts from.
    The gradient comes from ``batch_value_and_grad``: with virtual workers it has the same bits on
    any data-parallel size.
    """
    from models import example_losses

    mesh = ptc.mesh()
    grad_fn = batch_value_and_grad(example_losses, layout, mesh, batch_axes=BATCH_AXES)

    def train_step(state, batch, weights):
        nodes = nnx.merge(graphdef, state)
        model, optimizer = nodes["model"], nodes["optimizer"]
        loss, grads = grad_fn(model, batch, weights)
        optimizer.update(model, grads)
        return nnx.state(nodes), loss

    batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
    return jax.jit(
        train_step,
        in_shardings=(ptc.shardings(mesh), batch_sharding, batch_sharding),
        out_shardings=(ptc.shardings(mesh), NamedSharding(mesh, P())),
        donate_argnums=0,
    )


@dataclasses.dataclass
class Trace:
    """What one training run produced: per-step losses, samples, first-step times, resizes."""

    losses: list[float] = dataclasses.field(default_factory=list)
    samples: list[np.ndarray] = dataclasses.field(default_factory=list)
    first_steps: dict[int, tuple[float, bool]] = dataclasses.field(default_factory=dict)
    resizes: list[dict] = dataclasses.field(default_factory=list)
    data_state: dict | None = None
    state_bytes: int = 0


def train(options: DemoOptions, stages: list[Stage], dataset_source, progress=None):
    """Train ``options.steps`` steps through ``stages``; (final state on the host, Trace).

    The dataset PTC serves every step's global batch; a resize changes how the batch is split
    over ranks, never which samples it holds.
    """
    from models import LOGICAL_RULES

    graphdef, state, _ = build_state(options.model, options.lr, options.seed)
    ptc = PTC.of(state, LOGICAL_RULES, stages[0].config, stages[0].device_ids)
    state = place(state, ptc)
    dataset = DatasetPTC(dataset_source, options.batch, seed=options.seed)
    steps_cache: dict = {}
    trace = Trace()
    write = progress.write if progress is not None else (lambda text: None)
    for step in range(options.steps):
        stage = next((s for s in stages[1:] if s.start == step), None)
        if stage is not None:
            state, ptc, record = _resize(state, ptc, stage, step, options.method, write)
            trace.resizes.append(record)
        layout = BatchLayout(
            options.batch, ranks=ptc.config.data * ptc.config.fsdp, workers=options.workers
        )
        key = (str(ptc.config), ptc.device_ids, layout)
        cached = key in steps_cache
        if not cached:
            steps_cache[key] = make_train_step(graphdef, ptc, layout)
        batch, weights, samples = device_batch(dataset, step, layout, ptc.mesh(), BATCH_AXES)
        dataset.step = step + 1
        tic = time.perf_counter()
        state, loss = steps_cache[key](state, batch, weights)
        trace.losses.append(float(loss))
        trace.samples.append(samples[samples >= 0])
        if step == 0 or stage is not None:
            trace.first_steps[step] = (time.perf_counter() - tic, cached)
        if progress is not None:
            progress.update()
            progress.set_postfix(
                {"loss": f"{loss:.3f}", "devices": len(ptc.device_ids), "config": str(ptc.config)}
            )
    for record in trace.resizes:
        record["compile_seconds"], record["compile_cached"] = trace.first_steps[record["step"]]
    trace.data_state = dataclasses.asdict(dataset.state())
    trace.state_bytes = ptc.nbytes
    return [np.asarray(x) for x in jax.tree.leaves(state)], trace


def run(options: DemoOptions) -> dict:
    """Train with resizes and once more without, write ``loss.png`` and ``summary.json``.

    Returns the summary written to ``summary.json``.
    """
    from tqdm import tqdm

    from models import corpus_samples, stdlib_corpus

    started = time.perf_counter()
    _, abstract, cfg = build_state(options.model, options.lr, options.seed, abstract=True)
    stages = plan_stages(options, abstract)
    if len(jax.devices()) < options.devices:
        raise LayoutError(f"the demo needs {options.devices} devices, found {len(jax.devices())}")
    for stage in stages:  # bad batch layouts fail before any training
        BatchLayout(options.batch, stage.config.data * stage.config.fsdp, options.workers)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, options.samples)

    with tqdm(total=2 * options.steps, desc=options.model, unit="step") as bar:
        state, trace = train(options, stages, source, bar)
        resized_seconds = time.perf_counter() - started
        fixed_state, fixed = train(options, stages[:1], source, bar)
    seen = np.concatenate(trace.samples)
    summary = {
        "model": options.model,
        "param_count": param_count(abstract),
        "state_bytes": trace.state_bytes,
        "global_batch": options.batch,
        "virtual_workers": options.workers,
        "dataset_samples": options.samples,
        "seq_len": cfg.seq_len,
        "steps": options.steps,
        "lr": options.lr,
        "seed": options.seed,
        "method": options.method,
        "devices": options.devices,
        "schedule": [list(s) for s in options.schedule],
        "initial": {
            "config": str(stages[0].config),
            "devices": list(stages[0].device_ids),
            "compile_seconds": trace.first_steps[0][0],
        },
        "resizes": trace.resizes,
        "exactly_once": exactly_once(trace.samples, fixed.samples, options.samples),
        "samples_seen": int(seen.size),
        "samples_expected": options.steps * options.batch,
        "epochs": seen.size / options.samples,
        "data_state": trace.data_state,
        "params_vs_fixed_run": compare_states(state, fixed_state),
        "losses": trace.losses,
        "fixed_run_losses": fixed.losses,
        "final_loss": trace.losses[-1],
        "resized_run_seconds": resized_seconds,
        "total_seconds": time.perf_counter() - started,
    }
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (
        f"GPT {options.model}, global batch {options.batch}, from {stages[0].config} on "
        f"{options.devices} devices"
    )
    write_plot(out / "loss.png", trace.losses, fixed.losses, trace.resizes, title)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _resize(state, ptc: PTC, stage: Stage, step: int, method: str, write):
    """Reshard ``state`` from ``ptc`` onto ``stage``'s layout; (state, new PTC, resize record)."""
    from models import LOGICAL_RULES

    tic = time.perf_counter()
    # the stage fixes the device set; allocate picks their mesh order so the most bytes stay put
    new = allocate(ptc, PTC.of(state, LOGICAL_RULES, stage.config, stage.device_ids))
    plan = make_plan(ptc, new)
    plan_seconds = time.perf_counter() - tic
    write(
        f"\nstep {step}: {len(ptc.device_ids)} -> {len(new.device_ids)} devices\n{plan.summary()}"
    )
    tic = time.perf_counter()
    state, report = reshard(state, plan, method=method)
    seconds = time.perf_counter() - tic
    write(f"  {report}")
    record = {
        "step": step,
        "from": len(ptc.device_ids),
        "to": len(new.device_ids),
        "from_config": str(ptc.config),
        "to_config": str(new.config),
        "from_devices": list(ptc.device_ids),
        "to_devices": list(new.device_ids),
        "bytes_moved": report.bytes_moved,
        "bytes_kept": report.bytes_kept,
        "plan_bytes_moved": plan.bytes_moved,
        "method": report.method,
        "plan_seconds": plan_seconds,
        "seconds": seconds,
    }
    return state, new, record


def exactly_once(samples: list[np.ndarray], fixed: list[np.ndarray], num_samples: int) -> bool:
    """True if every step saw the fixed run's samples, and each epoch saw each sample once."""
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
    """``"bitwise"`` if every leaf has the same bits, else the max abs and relative differences.

    The relative difference of a leaf is its max abs difference over its max abs value.
    """
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


def write_plot(
    path: pathlib.Path,
    losses: list[float],
    fixed: list[float],
    resizes: list[dict],
    title: str,
) -> None:
    """Loss against step for the resized and the fixed run, with an "8→4" label at every resize."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(len(fixed)), fixed, color="tab:orange", lw=3, alpha=0.5, label="no resizes")
    ax.plot(range(len(losses)), losses, color="tab:blue", lw=1.2, label="resized")
    top = max(losses + fixed) if losses else 1.0
    for record in resizes:
        ax.axvline(record["step"] - 0.5, color="gray", ls="--", lw=1)
        ax.annotate(
            f"{record['from']}→{record['to']}\n{record['to_config']}",
            (record["step"] - 0.5, top),
            xytext=(3, 0),
            textcoords="offset points",
            va="top",
            fontsize=8,
        )
    ax.set(xlabel="step", ylabel="loss (next-byte cross entropy)", title=title)
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resize_table(summary: dict) -> str:
    """The resizes of a run as a fixed-width table, for the terminal."""
    head = (
        f"{'step':>5} {'devices':>8} {'config':>42} {'to devices':>16} {'moved MiB':>10} "
        f"{'kept MiB':>10} {'reshard s':>10} {'1st step s':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in summary["resizes"]:
        configs = f"{r['from_config']}->{r['to_config']}"
        compile_s = f"{r['compile_seconds']:.2f}" + ("*" if r["compile_cached"] else "")
        lines.append(
            f"{r['step']:5d} {str(r['from']) + '->' + str(r['to']):>8} {configs:>42} "
            f"{_ids(r['to_devices']):>16} {r['bytes_moved'] / MIB:10.3f} "
            f"{r['bytes_kept'] / MIB:10.3f} {r['seconds']:10.3f} {compile_s:>10}"
        )
    if not summary["resizes"]:
        lines.append("(no resizes)")
    lines.append(
        f"(* step already compiled for that layout; state {summary['state_bytes'] / MIB:.3f} MiB, "
        f"final loss {summary['final_loss']:.4f}, {summary['total_seconds']:.1f} s in all)"
    )
    return "\n".join(lines)


def consistency_line(summary: dict) -> str:
    """One line: did the resized run see the fixed run's data and reach its params?"""
    params = summary["params_vs_fixed_run"]
    if params != "bitwise":
        params = f"max abs diff {params['max_abs']:.2e}, max rel diff {params['max_rel']:.2e}"
    return (
        f"data: exactly once {summary['exactly_once']}, {summary['samples_seen']} samples seen of "
        f"{summary['samples_expected']} expected ({summary['epochs']:.2f} epochs); params vs a run "
        f"without resizes: {params}"
    )


def _ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}..{ids[-1]}"
    return ",".join(map(str, ids))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configs(n: int) -> list[ParallelConfig]:
    """Every ``(data, fsdp)`` mesh of ``n`` devices."""
    return [ParallelConfig(data=n // f, fsdp=f) for f in _divisors(n)]


@functools.cache
def _profile(model: str):
    from models import GPTConfig, profile

    return profile(GPTConfig.by_name(model), name=f"gpt {model}")
