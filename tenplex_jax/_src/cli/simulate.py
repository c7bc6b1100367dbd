"""``tenplex-jax simulate``: replay a resource trace on a described cluster, with no devices.

The simulator's core is ``tenplex_jax.simulator``; this module supplies the models (the
repository's GPT presets and a 70B-class decoder, from ``tenplex_jax_models``), the table, the
plot and the JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

EXAMPLES = """\
examples:
  tenplex-jax simulate --cluster meshes/h100-4096.toml --trace meshes/philly-538.toml
      a 70B-class decoder on 4096 H100s through a 538-minute trace: per event the planner's
      layout, the bytes the plan moves and each policy's seconds; goodput per policy
  tenplex-jax simulate --cluster meshes/cloud-1024.toml --trace meshes/philly-538.toml \\
      --policy tenplex,checkpoint-restart --out out/sim
      two policies on a heterogeneous cloud mix; DIR/simulate.json and DIR/simulate.png
  tenplex-jax simulate --cluster meshes/8xh100.toml --trace meshes/philly.toml --model gpt100m
      the small trace on one node, the 114.5M-parameter GPT

Costs the network model does not derive are flags (restart, compile, commit and checkpoint
intervals); everything else comes from the cluster description (meshes/README.md).
"""

MODELS = ("llm-70b", "tiny", "small", "gpt100m")
DEFAULT_BATCH = {"llm-70b": 1024}


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
        "every byte through one node; checkpoint-restart); goodput per policy.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(command=run, name="simulate")
    p.add_argument("--cluster", required=True, metavar="FILE", help="cluster description (TOML)")
    p.add_argument("--trace", required=True, metavar="FILE", help="resource trace (TOML)")
    p.add_argument("--model", choices=MODELS, default="llm-70b", help="default: llm-70b")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch in sequences (default: 1024 for llm-70b, else 64)",
    )
    p.add_argument(
        "--policy",
        default=",".join(POLICIES),
        help=f"comma-separated policies (default: {','.join(POLICIES)})",
    )
    p.add_argument(
        "--restart-seconds",
        type=float,
        default=defaults.restart_seconds,
        help=f"new processes up to their first collective (default: {defaults.restart_seconds:g})",
    )
    p.add_argument(
        "--compile-seconds",
        type=float,
        default=defaults.compile_seconds,
        help=f"a cold compile of a layout's step (default: {defaults.compile_seconds:g})",
    )
    p.add_argument(
        "--commit-every",
        type=int,
        default=defaults.commit_every,
        help=f"steps between commits to the stores (default: {defaults.commit_every})",
    )
    p.add_argument(
        "--checkpoint-minutes",
        type=float,
        default=None,
        help="minutes between orbax checkpoints (default: the trace's, else 30)",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=defaults.replicas,
        help=f"store copies beyond the writer's (default: {defaults.replicas})",
    )
    p.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    p.add_argument("--out", metavar="DIR", help="write DIR/simulate.json and DIR/simulate.png")


def model(name: str):
    """(abstract state, rules, planner profile) of a model preset."""
    if name == "llm-70b":
        from tenplex_jax_models import llm

        return llm.abstract_state(), llm.LLM_RULES, llm.profile()
    from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of

    return build_state(name, lr=1e-3, abstract=True)[1], LOGICAL_RULES, profile_of(name)


def run(args) -> int:
    from tenplex_jax._src.elastic.trace import ResourceTrace
    from tenplex_jax._src.errors import PlanError
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.simulator.costs import Costs
    from tenplex_jax._src.simulator.replay import Simulation, simulate

    policies = tuple(p.strip() for p in args.policy.split(",") if p.strip())
    cluster, trace = Cluster.load(args.cluster), ResourceTrace.load(args.trace)
    if args.commit_every < 1 or args.replicas < 0:
        raise PlanError(
            f"--commit-every must be >= 1 and --replicas >= 0, got "
            f"{args.commit_every} and {args.replicas}"
        )
    costs = Costs(
        args.restart_seconds,
        args.compile_seconds,
        args.commit_every,
        args.checkpoint_minutes,
        args.replicas,
    )
    state, rules, profile = model(args.model)
    batch = args.batch or DEFAULT_BATCH.get(args.model, 64)
    sim = Simulation(cluster, profile, state, rules, batch, costs)
    quiet = args.json
    if not quiet:
        print(
            f"simulate: {args.model} (global batch {batch}) on {cluster}; trace {trace.name} "
            f"({len(trace.events)} events)"
        )
    result = simulate(sim, trace, policies, log=None if quiet else print)
    if args.json:
        json.dump(result, sys.stdout, indent=1, default=_plain)
        print()
    else:
        print(table(result))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps(result, indent=1, default=_plain) + "\n")
        plot(result, out / "simulate.png")
        if not quiet:
            print(f"wrote {out / 'simulate.json'} and {out / 'simulate.png'}")
    return 0


def table(result: dict) -> str:
    """The per-event table and the goodput per policy."""
    policies = list(result["policies"])
    head = (
        f"{'min':>6} {'event':8} {'devices':>13} {'layout after':34} {'moved GB':>10} "
        + " ".join(f"{p[:18] + ' s':>20}" for p in policies)
    )
    lines = [head, "-" * len(head)]
    for r in result["events"]:
        cells = []
        for p in policies:
            c = r["policies"][p]
            note = " (orbax)" if c.get("fallback") else ""
            cells.append(f"{c['seconds']:12.1f}{note:>8}")
        devices = f"{r['devices_before']}->{r['devices_after']}"
        layout = r["config_after"] if r["decision"] != "stay" else "(growth declined)"
        lines.append(
            f"{r['minute']:6.1f} {r['kind']:8} {devices:>13} {layout[:34]:34} "
            f"{r['bytes_moved'] / 1e9:10.1f} " + " ".join(cells)
        )
    lines.append("")
    lines.append(
        f"{'policy':20} {'goodput':>8} {'stalled s':>10} {'lost s':>9} {'useful samples':>15}"
    )
    for p, s in result["policies"].items():
        lines.append(
            f"{p:20} {s['goodput']:8.1%} {s['stall_seconds']:10.0f} "
            f"{s['lost_seconds']:9.0f} {s['useful_samples']:15,.0f}"
        )
    lines.append(f"(simulated in {result['seconds']:.1f} s)")
    return "\n".join(lines)


def plot(result: dict, path: pathlib.Path) -> None:
    """Devices over time, and each policy's productive time as a share of the time so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    first = next(iter(result["timeline"].values()))
    minutes = [m for m, _, _ in first]
    top.step(minutes, [d for _, d, _ in first], where="post")
    top.set_ylabel("devices")
    top.set_title(f"{result['model']} on {result['cluster']}: trace {result['trace']}")
    for policy, points in result["timeline"].items():
        xs = [m for m, _, _ in points if m > 0]
        ys = [p / (m * 60) for m, _, p in points if m > 0]
        bottom.plot(
            xs, ys, marker="o", label=f"{policy} ({result['policies'][policy]['goodput']:.1%})"
        )
    bottom.set_ylabel("goodput so far")
    bottom.set_xlabel("minutes")
    bottom.set_ylim(0, 1.05)
    bottom.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plain(value):
    """JSON for NumPy scalars and the rest of a result."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
