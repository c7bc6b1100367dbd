"""Plan scaling: ``tj.make_plan`` time against the number of tensors and devices, abstract only.

The tensors are the 114.5M-param GPT's train-state leaves (params, both AdamW moments, counters:
44 leaves), repeated under new paths up to the tensor count, as in
a model whose layers are separate tensors; the devices are bare ids. Two changes per size:

- ``reshape``: the same devices, from ``tensor=4`` to ``tensor=2`` with twice the FSDP;
- ``shrink``: onto the upper half of the devices, with half the data parallelism.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import tenplex_jax as tj

C = tj.ParallelConfig


def changes(n: int):
    """(name, src PTC args, dst PTC args) for ``n`` devices, a power of two >= 8."""
    f_src, f_dst = min(8, n // 4), min(16, n // 2)
    src = C(data=n // (4 * f_src), fsdp=f_src, tensor=4)
    half = n // 2
    f_half = min(16, half // 2)
    yield "reshape", (src, range(n)), (C(data=n // (2 * f_dst), fsdp=f_dst, tensor=2), range(n))
    yield (
        "shrink",
        (src, range(n)),
        (C(data=half // (2 * f_half), fsdp=f_half, tensor=2), range(half, n)),
    )


def synthetic_ptc(abstract_state, rules, config, device_ids, tensors: int) -> tj.PTC:
    """The PTC of ``tensors`` leaves cycling through the GPT state's leaf layouts."""
    base = tj.PTC.of(abstract_state, rules, config, tuple(device_ids))
    leaves = tuple(
        dataclasses.replace(
            base.leaves[i % len(base.leaves)], path=f"t{i}/{base.leaves[i % len(base.leaves)].path}"
        )
        for i in range(tensors)
    )
    return tj.PTC(config, base.device_ids, base.hosts, leaves, treedef=("synthetic", tensors))


def run_plan_scaling(
    devices: tuple[int, ...], tensors: tuple[int, ...], repeats: int, log, model: str = "gpt100m"
):
    """One row per device count x tensor count x change: ``make_plan`` seconds (median of
    ``repeats``) and the target shards planned. ``model`` is the GPT preset whose leaf layouts
    the tensors cycle through."""
    from tenplex_jax_models import LOGICAL_RULES, build_state

    _, abstract, _ = build_state(model, lr=1e-3, abstract=True)
    rows = []
    for n in devices:
        for t in tensors:
            for name, (src_cfg, src_ids), (dst_cfg, dst_ids) in changes(n):
                src = synthetic_ptc(abstract, LOGICAL_RULES, src_cfg, src_ids, t)
                dst = synthetic_ptc(abstract, LOGICAL_RULES, dst_cfg, dst_ids, t)
                runs = []
                for _ in range(repeats):
                    tic = time.perf_counter()
                    plan = tj.make_plan(src, dst)
                    runs.append(time.perf_counter() - tic)
                shards = sum(len(leaf.shards) for leaf in plan.leaves)
                row = {
                    "kind": "plan",
                    "change": f"plan {name} {n} devices x {t} tensors",
                    "plan_change": name,
                    "devices": n,
                    "tensors": t,
                    "from": str(src_cfg),
                    "to": f"{dst_cfg} on devices {dst_ids[0]}..{dst_ids[-1]}",
                    "target_shards": shards,
                    "bytes_moved": plan.bytes_moved,
                    "runs_seconds": runs,
                    "median_seconds": {"make_plan": statistics.median(runs)},
                    "microseconds_per_shard": statistics.median(runs) / shards * 1e6,
                }
                rows.append(row)
                log(
                    f"  plan {name:8s} {n:5d} devices x {t:5d} tensors: "
                    f"{row['median_seconds']['make_plan'] * 1e3:9.1f} ms ({shards:,} target shards)"
                )
    return rows
