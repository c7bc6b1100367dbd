"""The tables and plots of ``tenplex-jax simulate``: a trace's events and goodput, or one fixed
change's seconds per policy and their parts."""

from __future__ import annotations

import pathlib

from tenplex_jax._src.simulator.results import ChangeResult, Outcome, SimulationResult

GB = 1e9


def table(result: SimulationResult) -> str:
    """The per-event table, the goodput per policy, and what each policy was charged."""
    policies = list(result.policies)
    head = (
        f"{'min':>6} {'event':8} {'devices':>13} {'layout after':34} {'moved GB':>10} "
        + " ".join(f"{p[:18] + ' s':>20}" for p in policies)
    )
    lines = [head, "-" * len(head)]
    for r in result.events:
        cells = [
            f"{c.seconds:12.1f}{' (orbax)' if c.fallback else '':>8}" for c in r.policies.values()
        ]
        devices = f"{r.devices_before}->{r.devices_after}"
        layout = r.config_after if r.decision != Outcome.STAY else "(growth declined)"
        lines.append(
            f"{r.minute:6.1f} {r.kind:8} {devices:>13} {layout[:34]:34} "
            f"{r.bytes_moved / GB:10.1f} " + " ".join(cells)
        )
    lines += [
        "",
        f"{'policy':20} {'goodput':>8} {'stalled s':>10} {'lost s':>9} {'useful samples':>15}",
    ]
    for p, s in result.policies.items():
        lines.append(
            f"{p:20} {s.goodput:8.1%} {s.stall_seconds:10.0f} "
            f"{s.lost_seconds:9.0f} {s.useful_samples:15,.0f}"
        )
    lines += _assumptions(result)
    lines.append(f"(simulated in {result.seconds:.1f} s)")
    return "\n".join(lines)


def change_table(r: ChangeResult) -> str:
    """One fixed change: the plan, then each policy's seconds and their parts."""
    fits = "" if r.fits_before and r.fits_after else "  (a layout exceeds memory)"
    lines = [
        f"change: {r.model} (global batch {r.global_batch}) on {r.cluster}, {r.kind}",
        f"  {r.config_before} on {r.devices_before} devices -> "
        f"{r.config_after} on {r.devices_after} devices{fits}",
        f"  state {r.state_bytes / GB:.1f} GB; the plan moves {r.bytes_moved / GB:.2f} GB and "
        f"keeps {r.bytes_kept / GB:.2f} GB (planned in {r.plan_seconds:.2f} s); step "
        f"{r.step_seconds_before:.2f} s -> {r.step_seconds_after:.2f} s",
        "",
    ]
    head = (
        f"{'policy':20} {'seconds':>9} {'network GB':>10} {'commit/save':>11} "
        f"{'transfer/restore':>16} {'detect':>7} {'restart':>8} {'compile':>8} {'latency':>8}  "
        "bottleneck"
    )
    lines += [head, "-" * len(head)]
    for p, c in r.policies.items():
        network = f"{c.network_bytes / GB:10.2f}" if c.network_bytes is not None else f"{'-':>10}"
        lines.append(
            f"{p:20} {c.seconds:9.2f} {network} {c.commit + c.save:11.2f} "
            f"{c.transfer + c.restore:16.2f} {c.detect:7.1f} {c.restart:8.1f} {c.compile:8.1f} "
            f"{c.latency:8.3f}  {c.bottleneck}" + ("  (orbax fallback)" if c.fallback else "")
        )
    lines += _assumptions(r)
    return "\n".join(lines)


def _assumptions(result: SimulationResult | ChangeResult) -> list[str]:
    lines = ["", "assumptions:"]
    for p, said in result.assumptions.items():
        lines.append(f"  {p}: " + "; ".join(said))
    return lines


def plot(result: SimulationResult, path: pathlib.Path) -> None:
    """Devices over time, each event's seconds per policy, and each policy's productive time as
    a share of the time so far."""
    plt = _pyplot()
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    first = next(iter(result.timeline.values()))
    top.step([p.minute for p in first], [p.devices for p in first], where="post")
    top.set_ylabel("devices")
    top.set_title(f"{result.model} on {result.cluster}: trace {result.trace}")
    policies, events = list(result.policies), result.events
    width = max(result.minutes / max(len(events), 1) / (len(policies) + 1), 1e-3)
    for i, policy in enumerate(policies):
        xs = [r.minute + (i - (len(policies) - 1) / 2) * width for r in events]
        middle.bar(xs, [r.policies[policy].seconds for r in events], width=width, label=policy)
    for r in events:
        middle.annotate(r.kind, (r.minute, 0), fontsize=7, rotation=90, va="bottom")
    middle.set_ylabel("seconds per event")
    middle.legend(loc="upper right", fontsize=8)
    for policy, points in result.timeline.items():
        xs = [m for m, _, _ in points if m > 0]
        ys = [p / (m * 60) for m, _, p in points if m > 0]
        label = f"{policy} ({result.policies[policy].goodput:.1%})"
        bottom.plot(xs, ys, marker="o", label=label)
    bottom.set_ylabel("goodput so far")
    bottom.set_xlabel("minutes")
    bottom.set_ylim(0, 1.05)
    bottom.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PARTS = ("detect", "commit", "save", "transfer", "restore", "restart", "compile")


def change_plot(result: ChangeResult, path: pathlib.Path) -> None:
    """One fixed change: each policy's seconds as a stacked bar of its parts."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    policies = list(result.policies)
    bottoms = [0.0] * len(policies)
    for part in PARTS:
        values = [getattr(result.policies[p], part) for p in policies]
        if any(values):
            ax.bar(policies, values, bottom=bottoms, label=part)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, cost in enumerate(result.policies.values()):
        ax.annotate(f"{cost.seconds:.1f} s", (i, bottoms[i]), ha="center")
    ax.set_ylabel("seconds")
    ax.set_title(
        f"{result.model} on {result.cluster}:\n{result.source} -> {result.target} "
        f"({result.kind}, {result.bytes_moved / GB:.1f} GB moved)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
