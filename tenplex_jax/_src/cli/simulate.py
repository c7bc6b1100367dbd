"""``tenplex-jax simulate``: replay a resource trace on a described cluster, with no devices.

The simulator's core is ``tenplex_jax.simulator``; this module supplies the models (the
repository's GPT presets, the GPT-3 paper's sizes, any dimensions, and a 70B-class decoder, from
``tenplex_jax_models``), the flags and the JSON; :mod:`.simulate_output` the tables and plots.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from tenplex_jax._src.cli.parsing import count, positive

EXAMPLES = """\
examples:
  tenplex-jax simulate --cluster meshes/h100-4096.toml --trace meshes/philly-538.toml
      a 70B-class decoder on 4096 H100s through a 538-minute trace: per event the planner's
      layout, the bytes the plan moves and each policy's seconds; goodput per policy
  tenplex-jax simulate --cluster meshes/tenplex-16.toml --model gpt3-2.7b \\
      --from tensor=4,pipe=2,data=1 --to tensor=4,pipe=2,data=2
      the Tenplex paper's scale-out, one fixed change: each policy's seconds and their parts
  tenplex-jax simulate --cluster meshes/h100-4096.toml --trace meshes/philly-538.toml \\
      --restart-seconds tenplex=5,central=5,checkpoint-restart=60 --compile-seconds 120
      restart costs per policy; compiles as the facts say (announced: ahead, failure: on demand)
  tenplex-jax simulate --cluster meshes/h100-4096.toml --mttf-hours 7.9 --mttf-devices 1024 \\
      --minutes 1440 --seed 1 --out out/sim
      a day of node failures at a published MTTF (7.9 h at 1024 GPUs, scaling as 1/N), each
      node repaired after --repair-minutes; checkpoints at the Young/Daly interval
  tenplex-jax simulate --cluster meshes/8xh100.toml --trace meshes/philly.toml --model gpt100m
      the small trace on one node, the 114.5M-parameter GPT

Costs the network model does not derive are flags (restart, compile, failure detection, latency
and host work per request, piece, shard, leaf and run, the stores' rates, commit and checkpoint
intervals); everything else comes from the cluster description (meshes/README.md).
"""

PRESETS = ("llm-70b", "tiny", "small", "gpt100m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b")
MODELS = PRESETS
# global batch in sequences: llm-70b's; the GPT-3 sizes' is an assumption (the Tenplex paper's
# experiments are not in the seed text), of sequences of 2048 tokens as in the GPT-3 paper
DEFAULT_BATCH = {"llm-70b": 1024, "gpt3-1.3b": 128, "gpt3-2.7b": 128, "gpt3-6.7b": 128}
DIMS = ("layers", "d_model", "heads", "vocab", "seq_len", "d_ff")


def add_parser(sub) -> None:
    from tenplex_jax._src.simulator.costs import POLICIES, Costs

    defaults = Costs()
    p = sub.add_parser(
        "simulate",
        help="replay a resource trace on a described cluster of up to thousands of devices",
        description="Replay a resource trace (scaled to the cluster) without devices: per event "
        "the\n"
        "planner's layout, the abstract plan and each policy's estimated seconds from a\n"
        "network model (tenplex: pulls from the tensor stores as the plan says; central:\n"
        "every byte through one node; checkpoint-restart); goodput per policy. Or one\n"
        "fixed change (--from/--to), or failures drawn from a mean time to failure.",
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
    m = p.add_argument_group("model", "a preset, or a GPT by its dimensions (all of them)")
    m.add_argument(
        "--model",
        choices=PRESETS,
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
    p.add_argument(
        "--batch",
        type=positive,
        default=None,
        help="global batch in sequences (default: 1024 for llm-70b, 128 for the GPT-3 sizes "
        "and --layers models, else 64)",
    )
    p.add_argument(
        "--policy",
        default=",".join(POLICIES),
        help=f"comma-separated policies (default: {','.join(POLICIES)})",
    )
    f = p.add_argument_group("one fixed change", "no planner choosing the configs, no trace")
    f.add_argument(
        "--from",
        dest="source",
        type=_config,
        metavar="CONFIG",
        help="the config before, on the cluster's first devices: e.g. tensor=4,pipe=2,data=1",
    )
    f.add_argument(
        "--to",
        dest="target",
        type=_config,
        metavar="CONFIG",
        help="the config after, on the cluster's first devices: e.g. tensor=4,pipe=2,data=2",
    )
    f.add_argument(
        "--kind",
        choices=("offer", "preempt", "redeploy", "fail"),
        help="the change's kind (default: offer for more devices, preempt for fewer, else "
        "redeploy; fail: no notice, nothing committed first)",
    )
    c = p.add_argument_group("costs", "what the network model does not derive")
    c.add_argument(
        "--restart-seconds",
        type=_per_policy,
        default=defaults.restart_seconds,
        metavar="S|POLICY=S,...",
        help="new processes up to their first collective: one number for every policy, or per "
        "policy as tenplex=5,central=5,checkpoint-restart=60, the others taking "
        f"{defaults.restart_seconds:g} (default: {defaults.restart_seconds:g})",
    )
    c.add_argument(
        "--compile-seconds",
        type=_per_policy,
        default=defaults.compile_seconds,
        metavar="S|POLICY=S,...",
        help="a cold compile of a layout's step, as --restart-seconds (default: "
        f"{defaults.compile_seconds:g}); paid by every policy after a failure, by none at an "
        "announced change",
    )
    c.add_argument(
        "--no-compile-ahead",
        action="store_true",
        help="announced changes compile on demand too (every policy)",
    )
    c.add_argument(
        "--executable-cache",
        action="store_true",
        help="a failure's layout loads its step from an executable cache: no policy compiles",
    )
    for name, what in (
        (
            "latency_seconds",
            "a round trip per request or message (store get/put, storage "
            "read/write, a send across nodes), in sequence per node's process",
        ),
        (
            "piece_seconds",
            "host work per piece a node's devices receive (a node's host work adds to its "
            "copies on CPU devices and overlaps them on accelerators)",
        ),
        ("shard_seconds", "host work per new shard a node builds"),
        ("leaf_seconds", "host work per leaf a node's process rebuilds"),
        ("run_seconds", "host work per contiguous run a piece is copied as (CPU devices)"),
        ("detect_seconds", "from a failure to its notice (health checks, a heartbeat timeout)"),
    ):
        c.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            default=getattr(defaults, name),
            help=f"{what} (default: 0)",
        )
    for op, what in (("get", "serves"), ("put", "takes in")):
        c.add_argument(
            f"--store-{op}-bandwidth",
            type=float,
            default=None,
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
        default=None,
        help="minutes between orbax checkpoints, every policy (default: Young/Daly's "
        "sqrt(2 x C x MTTF) for the failure rate of --mttf-hours or the trace's failures; "
        "with none, the trace's checkpoint_every, else 30)",
    )
    c.add_argument(
        "--trace-checkpoints",
        action="store_true",
        help="use the trace's checkpoint_every before Young/Daly",
    )
    c.add_argument(
        "--replicas",
        type=count,
        default=defaults.replicas,
        help=f"store copies beyond the writer's (default: {defaults.replicas})",
    )
    g = p.add_argument_group("failures", "node failures from a mean time to failure")
    g.add_argument(
        "--mttf-hours",
        type=float,
        help="mean time to failure at --mttf-devices devices (published: 7.9 h at 1024 GPUs); "
        "generates fail events (one node each), merged with --trace when given",
    )
    g.add_argument(
        "--mttf-devices",
        type=positive,
        default=1024,
        help="the device count of --mttf-hours; failures scale as 1/N (default: 1024)",
    )
    g.add_argument(
        "--repair-minutes",
        type=float,
        default=60.0,
        help="a failed node's devices are offered back after this long (default: 60)",
    )
    g.add_argument("--seed", type=int, default=0, help="the failures' random seed (default: 0)")
    g.add_argument(
        "--minutes",
        type=float,
        help="the generated trace's length (default: --trace's minutes, else 1440)",
    )
    p.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write DIR/simulate.json and DIR/simulate.png (a fixed change: DIR/change.json, "
        "DIR/change.png)",
    )


def model(args):
    """(name, abstract state, rules, planner profile, default batch) of the model the flags
    name: a preset or a GPT by its dimensions."""
    given = [d for d in DIMS[:3] if getattr(args, d) is not None]
    if given:
        from tenplex_jax._src.errors import PlanError

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


def costs(args):
    """The :class:`Costs` the flags give."""
    from tenplex_jax._src.simulator.costs import FIXED, Costs

    return Costs(
        restart_seconds=args.restart_seconds,
        compile_seconds=args.compile_seconds,
        commit_every=args.commit_every,
        checkpoint_minutes=args.checkpoint_minutes,
        replicas=args.replicas,
        compile_ahead=not args.no_compile_ahead,
        executable_cache=args.executable_cache,
        young_daly=not args.trace_checkpoints,
        mttf_hours=args.mttf_hours,
        mttf_devices=args.mttf_devices,
        detect_seconds=args.detect_seconds,
        store_get_bandwidth=args.store_get_bandwidth,
        store_put_bandwidth=args.store_put_bandwidth,
        **{name: getattr(args, name) for name in FIXED},
    )


def trace_of(args, cluster):
    """The trace to replay: ``--trace``, failures from ``--mttf-hours``, or both merged."""
    from tenplex_jax._src.elastic.trace import ResourceTrace
    from tenplex_jax._src.errors import PlanError
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
        import dataclasses

        trace = dataclasses.replace(trace, minutes=args.minutes)
    return merge(scale(trace, cluster.num_devices), failures)


def run(args) -> int:
    from tenplex_jax._src.cli import simulate_output as output
    from tenplex_jax._src.errors import PlanError
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.simulator.replay import Simulation, simulate

    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    cluster = Cluster.load(args.cluster)
    name, state, rules, profile, batch = model(args)
    batch = args.batch or batch
    sim = Simulation(cluster, profile, state, rules, batch, costs(args))
    quiet = args.json
    if (args.source is None) != (args.target is None):
        raise PlanError("a fixed change needs both --from and --to")
    if args.source is not None:
        from tenplex_jax._src.simulator.costs import POLICIES
        from tenplex_jax._src.simulator.fixed import fixed_change

        unknown = set(policies) - set(POLICIES)
        if unknown:
            raise PlanError(f"policies are {POLICIES}, got {sorted(unknown)}")
        result = fixed_change(sim, args.source, args.target, args.kind)
        result["policies"] = {p: result["policies"][p] for p in policies}
        result["assumptions"] = {p: result["assumptions"][p] for p in policies}
        files = ("change.json", "change.png", output.change_plot)
        text = output.change_table
    else:
        trace = trace_of(args, cluster)
        if not quiet:
            print(
                f"simulate: {name} (global batch {batch}) on {cluster}; trace {trace.name} "
                f"({len(trace.events)} events)"
            )
        result = simulate(sim, trace, policies, log=None if quiet else print)
        files = ("simulate.json", "simulate.png", output.plot)
        text = output.table
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=_plain)
        print()
    else:
        print(text(result))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / files[0]).write_text(json.dumps(result, indent=1, default=_plain) + "\n")
        files[2](result, out / files[1])
        if not quiet:
            print(f"wrote {out / files[0]} and {out / files[1]}")
    return 0


def _config(text: str):
    from tenplex_jax._src.ptc import ParallelConfig

    try:
        return ParallelConfig.parse(text)
    except ValueError as error:  # argparse would hide a ValueError's message
        raise argparse.ArgumentTypeError(str(error)) from None


def _per_policy(text: str):
    """``"60"`` -> 60.0 (every policy); ``"tenplex=5,checkpoint-restart=60"`` -> a dict."""
    from tenplex_jax._src.simulator.costs import POLICIES

    try:
        return float(text)
    except ValueError:
        pass
    out = {}
    for part in filter(None, (s.strip() for s in text.split(","))):
        policy, _, value = part.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if policy not in POLICIES or policy in out or not seconds >= 0:
            raise argparse.ArgumentTypeError(
                f"expected seconds, or POLICY=SECONDS,... with each of {', '.join(POLICIES)} at "
                f"most once and seconds >= 0; got {text!r}"
            )
        out[policy] = seconds
    if not out:
        raise argparse.ArgumentTypeError(f"no seconds in {text!r}")
    return out


def _plain(value):
    """JSON for NumPy scalars and the rest of a result."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
