"""``tenplex-jax simulate``: replay a resource trace on a described cluster, with no devices.

The simulator's core is ``tenplex_jax.simulator``; this module supplies the models (the
repository's GPT presets, the GPT-3 paper's sizes, any dimensions, and a 70B-class decoder, from
``tenplex_jax_models``), the flags and the JSON; :mod:`.simulate_output` the tables and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from tenplex_jax._src.cli.parsing import config, count, positive
from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.simulator.costs import Costs, Policy

EXAMPLES = """\
examples:
  tenplex-jax simulate --cluster meshes/h100-4096.toml --trace meshes/philly-538.toml
      a 70B-class decoder on 4096 H100s through a 538-minute trace: per event the planner's
      layout, the bytes the plan moves and each policy's seconds; goodput per policy
  tenplex-jax simulate --cluster meshes/tenplex-16.toml --model gpt3-2.7b \\
      --from tensor=4,pipe=2,data=1 --to tensor=4,pipe=2,data=2
      the Tenplex paper's scale-out, one fixed change: each policy's seconds and their parts
  tenplex-jax simulate --cluster meshes/h100-4096.toml --mttf-hours 7.9 --mttf-devices 1024 \\
      --minutes 1440 --seed 1 --out out/sim
      a day of node failures at a published MTTF (7.9 h at 1024 GPUs, scaling as 1/N), each
      node repaired after --repair-minutes; checkpoints at the Young/Daly interval

Costs the network model does not derive are flags (restart, compile, detection, latency, host
work, the stores' rates, intervals); the rest comes from the cluster file (meshes/README.md).
"""

MODELS = ("llm-70b", "tiny", "small", "gpt100m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b")
# global batch in sequences: llm-70b's; the GPT-3 sizes' (of 2048 tokens) is an assumption
DEFAULT_BATCH = {"llm-70b": 1024, "gpt3-1.3b": 128, "gpt3-2.7b": 128, "gpt3-6.7b": 128}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a resource trace on a described cluster of up to thousands of devices",
        description="Replay a resource trace on a cluster without devices: per event the\n"
        "planner's layout, the plan and each policy's seconds from a network model; goodput\n"
        "per policy. Or one fixed change (--from/--to), or failures from a mean time to failure.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(command=run, name="simulate")
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster description (TOML)")
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="resource trace (TOML); not needed with --from/--to, or with --mttf-hours",
    )
    p.add_argument(
        "--batch",
        type=positive,
        default=None,
        help="global batch in sequences (default: 1024 for llm-70b, 128 for the GPT-3 sizes "
        "and --layers models, else 64)",
    )
    p.add_argument(
        "--policy",
        type=_policies,
        default=tuple(Policy),
        help=f"comma-separated policies (default: {','.join(Policy)})",
    )
    p.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write DIR/simulate.json and DIR/simulate.png (a fixed change: DIR/change.json, "
        "DIR/change.png)",
    )
    _model_flags(
        p.add_argument_group("model", "a preset, or a GPT by its dimensions (all of them)")
    )
    f = p.add_argument_group("one fixed change", "no planner choosing the configs, no trace")
    for flag, dest, when in (("--from", "source", "before"), ("--to", "target", "after")):
        f.add_argument(
            flag,
            dest=dest,
            type=config,
            metavar="CONFIG",
            help=f"the config {when}, on the cluster's first devices: e.g. tensor=4,pipe=2,"
            + ("data=1" if when == "before" else "data=2"),
        )
    f.add_argument(
        "--kind",
        choices=("offer", "preempt", "redeploy", "fail"),
        help="the change's kind (default: offer for more devices, preempt for fewer, else "
        "redeploy; fail: no notice, nothing committed first)",
    )
    _cost_flags(p.add_argument_group("costs", "what the network model does not derive"))
    _failure_flags(p.add_argument_group("failures", "node failures from a mean time to failure"))


def _model_flags(m) -> None:
    m.add_argument(
        "--model",
        choices=MODELS,
        default=None,
        help="default: llm-70b. gpt3-1.3b/2.7b/6.7b: the GPT-3 paper's sizes (24 layers, "
        "d_model 2048, 16 heads / 32, 2560, 32 / 32, 4096, 32), vocabulary 50257 padded to "
        "50304, 2048 tokens, global batch 128 (assumed)",
    )
    m.add_argument("--layers", type=positive, help="a GPT's layers (with --d-model, --heads)")
    m.add_argument("--d-model", type=positive, help="a GPT's width")
    m.add_argument("--heads", type=positive, help="a GPT's attention heads")
    m.add_argument("--vocab", type=positive, default=50304, help="default: 50304")
    m.add_argument("--seq-len", type=positive, default=2048, help="tokens (default: 2048)")
    m.add_argument("--d-ff", type=positive, help="MLP width (default: 4 x d_model)")


HOST_WORK = {  # the host work and latency flags: Costs field -> what it is paid per
    "latency_seconds": "a round trip per request or message (store get/put, storage "
    "read/write, a send across nodes), in sequence per node's process",
    "piece_seconds": "host work per piece a node's devices receive (a node's host work adds to "
    "its copies on CPU devices and overlaps them on accelerators)",
    "shard_seconds": "host work per new shard a node builds",
    "leaf_seconds": "host work per leaf a node's process rebuilds",
    "run_seconds": "host work per contiguous run a piece is copied as (CPU devices)",
    "detect_seconds": "from a failure to its notice (health checks, a heartbeat timeout)",
}


def _cost_flags(c) -> None:
    defaults = Costs()
    for name, what in (("restart", "new processes up to their first collective"),
                       ("compile", "a cold compile of a layout's step; paid by every policy "
                        "after a failure, by none at an announced change")):  # fmt: skip
        value = getattr(defaults, f"{name}_seconds")
        c.add_argument(
            f"--{name}-seconds",
            type=_per_policy,
            default=value,
            metavar="S|POLICY=S,...",
            help=f"{what}: one number for every policy, or per policy as tenplex=5,central=5,"
            f"checkpoint-restart=60, the others taking {value:g} (default: {value:g})",
        )
    for flag, what in (
        ("--no-compile-ahead", "announced changes compile on demand too (every policy)"),
        ("--executable-cache", "a failure's layout loads its step from an executable cache: "
         "no policy compiles"),
        ("--trace-checkpoints", "use the trace's checkpoint_every before Young/Daly"),
    ):  # fmt: skip
        c.add_argument(flag, action="store_true", help=what)
    for name, what in HOST_WORK.items():
        c.add_argument(
            "--" + name.replace("_", "-"), type=float, default=0.0, help=f"{what} (default: 0)"
        )
    for op, what in (("get", "serves"), ("put", "takes in")):
        c.add_argument(
            f"--store-{op}-bandwidth",
            type=float,
            metavar="BYTES_PER_S",
            help=f"bytes per second a node's tensor store {what} (default: not a limit)",
        )
    c.add_argument(
        "--commit-every",
        type=positive,
        default=defaults.commit_every,
        help=f"steps between commits to the stores (default: {defaults.commit_every})",
    )
    c.add_argument(
        "--checkpoint-minutes",
        type=float,
        help="minutes between orbax checkpoints, every policy (default: Young/Daly's "
        "sqrt(2 x C x MTTF) for the failure rate of --mttf-hours or the trace's failures; "
        "with none, the trace's checkpoint_every, else 30)",
    )
    c.add_argument(
        "--replicas",
        type=count,
        default=defaults.replicas,
        help=f"store copies beyond the writer's (default: {defaults.replicas})",
    )


def _failure_flags(g) -> None:
    for flag, kind, default, what in (
        ("--mttf-hours", float, None, "mean time to failure at --mttf-devices devices "
         "(published: 7.9 h at 1024 GPUs); generates fail events (one node each), merged with "
         "--trace when given"),
        ("--mttf-devices", positive, 1024, "the device count of --mttf-hours; failures scale as "
         "1/N (default: 1024)"),
        ("--repair-minutes", float, 60.0, "a failed node's devices are offered back after this "
         "long (default: 60)"),
        ("--seed", int, 0, "the failures' random seed (default: 0)"),
        ("--minutes", float, None, "the generated trace's length (default: --trace's minutes, "
         "else 1440)"),
    ):  # fmt: skip
        g.add_argument(flag, type=kind, default=default, help=what)


def model(args):
    """(name, abstract state, rules, planner profile, default batch) of the model the flags
    name: a preset or a GPT by its dimensions."""
    given = [d for d in ("layers", "d_model", "heads") if getattr(args, d) is not None]
    if given:
        if len(given) < 3 or args.model is not None:
            raise PlanError(
                "a GPT by its dimensions needs all of --layers, --d-model and --heads (and no "
                f"--model); got {given}" + (f" and --model {args.model}" if args.model else "")
            )
        from tenplex_jax_models import LOGICAL_RULES, GPTConfig, build_state, profile

        try:
            cfg = GPTConfig(
                vocab=args.vocab,
                seq_len=args.seq_len,
                d_model=args.d_model,
                n_layers=args.layers,
                n_heads=args.heads,
                d_ff=args.d_ff or 4 * args.d_model,
            )
        except ValueError as error:
            raise PlanError(f"--layers/--d-model/--heads: {error}") from None
        name = f"gpt L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}"
        state = build_state(cfg, lr=1e-3, abstract=True)[1]
        return name, state, LOGICAL_RULES, profile(cfg, name=name), 128
    name = args.model or "llm-70b"
    if name == "llm-70b":
        from tenplex_jax_models import llm

        return name, llm.abstract_state(), llm.LLM_RULES, llm.profile(), 1024
    from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of

    state = build_state(name, lr=1e-3, abstract=True)[1]
    return name, state, LOGICAL_RULES, profile_of(name), DEFAULT_BATCH.get(name, 64)


def costs(args) -> Costs:
    """The :class:`Costs` the flags give: each flag sets the field of its name."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Costs) if f.name in args}
    negated = {"compile_ahead": not args.no_compile_ahead, "young_daly": not args.trace_checkpoints}
    return Costs(**given, **negated)


def trace_of(args, cluster):
    """The trace to replay: ``--trace``, failures from ``--mttf-hours``, or both merged."""
    from tenplex_jax._src.elastic.trace import ResourceTrace
    from tenplex_jax._src.simulator.failures import failure_trace, merge
    from tenplex_jax._src.simulator.replay import scale

    trace = ResourceTrace.load(args.trace) if args.trace else None
    if args.mttf_hours is None:
        if trace is None:
            raise PlanError("simulate needs --trace FILE, --mttf-hours H, or --from and --to")
        return trace
    minutes = args.minutes or (trace.minutes if trace is not None else None) or 1440.0
    failures = failure_trace(
        cluster.nodes,
        minutes,
        args.mttf_hours,
        args.mttf_devices,
        repair_minutes=args.repair_minutes,
        seed=args.seed,
    )
    if trace is None:
        return failures
    if trace.minutes is None:
        if args.minutes is None:
            raise PlanError(
                f"merging failures into trace {trace.name!r} needs its length: give --minutes"
            )
        trace = dataclasses.replace(trace, minutes=args.minutes)
    return merge(scale(trace, cluster.num_devices), failures)


def run(args) -> int:
    from tenplex_jax._src.cli import simulate_output as output
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.simulator.fixed import fixed_change
    from tenplex_jax._src.simulator.replay import Simulation, simulate

    if (args.source is None) != (args.target is None):
        raise PlanError("a fixed change needs both --from and --to")
    cluster, charged = Cluster.load(args.cluster), costs(args)  # checked before the model
    trace = trace_of(args, cluster) if args.source is None else None
    name, state, rules, profile, batch = model(args)
    batch = args.batch or batch
    sim = Simulation(cluster, profile, state, rules, batch, charged)
    if trace is None:
        result = fixed_change(sim, args.source, args.target, args.kind, policies=args.policy)
        stem, table, plot = "change", output.change_table, output.change_plot
    else:
        if not args.json:
            print(
                f"simulate: {name} (global batch {batch}) on {cluster}; trace {trace.name} "
                f"({len(trace.events)} events)"
            )
        result = simulate(sim, trace, args.policy, log=None if args.json else print)
        stem, table, plot = "simulate", output.table, output.plot
    print(result.to_json() if args.json else table(result))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(result.to_json() + "\n")
        plot(result, out / f"{stem}.png")
        if not args.json:
            print(f"wrote {out / stem}.json and {out / stem}.png")
    return 0


def _policies(text: str) -> tuple[Policy, ...]:
    """``--policy``: known policies, or argparse's error naming them."""
    try:
        return Policy.parse(filter(None, (n.strip() for n in text.split(","))))
    except PlanError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _per_policy(text: str):
    """``"60"`` -> 60.0 (every policy); ``"tenplex=5,checkpoint-restart=60"`` -> a dict."""
    try:
        return float(text)
    except ValueError:
        pass
    parts = [part.strip().partition("=") for part in text.split(",") if part.strip()]
    try:
        out = {policy: float(seconds) for policy, _, seconds in parts}
        if not out or len(out) < len(parts) or not all(v >= 0 for v in out.values()):
            raise ValueError
        return dict(zip(Policy.parse(out), out.values()))
    except (ValueError, PlanError):
        raise argparse.ArgumentTypeError(
            f"expected seconds, or POLICY=SECONDS,... with each of {', '.join(Policy)} at most "
            f"once and seconds >= 0; got {text!r}"
        ) from None
