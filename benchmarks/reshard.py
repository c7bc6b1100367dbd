"""The reshard matrix: tenplex_jax's reconfiguration against what a JAX user does today.

For each change of parallel config, one GPT + AdamW train state is laid out on the source devices
and moved onto the target layout by four strategies, all in this process:

- ``tenplex``: ``tj.make_plan`` on an allocated target PTC, then ``tj.reshard`` (the plan executor);
- ``orbax``: ``ocp.StandardCheckpointer`` save to a temporary folder, then restore onto a tree of
  ``ShapeDtypeStruct`` with the target shardings (a restart, without the process start-up);
- ``host``: gather every leaf to host memory (``jax.device_get``), then ``jax.device_put``;
- ``device_put``: one ``jax.device_put`` of the whole tree onto the target shardings.

The strategies take turns within each repeat (a warm-up round first), so the machine's noise falls
on all of them alike; donation is off while timing, so every repeat starts from the same state. The
row then records the bytes the executor copied against the plan's minimum and a gather-to-one
strategy, the bandwidth against memcpy, and the peak memory of one donating reshard.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import statistics
import tempfile
import time
import weakref

import jax
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

import tenplex_jax as tj
from tenplex_jax._src import box as boxes
from tenplex_jax_benchmarks.memory import MemorySampler, settle

C = tj.ParallelConfig
STRATEGIES = ("tenplex", "orbax", "host", "device_put")


@dataclasses.dataclass(frozen=True)
class Change:
    """One row of the matrix: a source and a target layout (config + device ids in mesh order)."""

    name: str
    kind: str  # dp, tp, fsdp, pp, mixed, disjoint
    src: tj.ParallelConfig
    src_devices: tuple[int, ...]
    dst: tj.ParallelConfig
    dst_devices: tuple[int, ...]


# At most two data-parallel replicas of the state at any time, so the 114.5M-param GPT with AdamW
# (1.3 GiB per replica) fits with room for the copies on a shared 24 GiB machine.
MATRIX = (
    Change("dp 1->2 (grow onto 4..7)", "dp", C(fsdp=4), range(4), C(data=2, fsdp=4), range(8)),
    Change(
        "tp 2->4 (grow onto 4..7)",
        "tp",
        C(fsdp=2, tensor=2),
        range(4),
        C(fsdp=2, tensor=4),
        range(8),
    ),
    Change("fsdp 8->4 (shrink to 0..3)", "fsdp", C(fsdp=8), range(8), C(fsdp=4), range(4)),
    # the layers dim sharded over pipe: pipeline stages of 8 layers become stages of 4
    Change(
        "pp 2->4 (grow onto 4..7)", "pp", C(pipe=2, fsdp=2), range(4), C(pipe=4, fsdp=2), range(8)
    ),
    Change(
        "dp2,fsdp2,tp2 -> fsdp3,tp2 on 2..7",
        "mixed",
        C(data=2, fsdp=2, tensor=2),
        range(8),
        C(fsdp=3, tensor=2),
        range(2, 8),
    ),
    Change(
        "disjoint 0..3 -> 4..7 (fsdp2,tp2)",
        "disjoint",
        C(fsdp=2, tensor=2),
        range(4),
        C(fsdp=2, tensor=2),
        range(4, 8),
    ),
)


def memcpy_bandwidth(nbytes: int, repeats: int, fresh: bool = False) -> float:
    """Bytes per second of a plain host memcpy (``np.copyto``) of ``nbytes``; median of repeats.

    By default into a buffer whose pages are already mapped. With ``fresh``, into a new buffer
    each time, as a reshard must: the kernel then maps and zeroes every page on first write.
    """
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    runs = []
    for _ in range(repeats):
        if fresh:
            dst = np.empty_like(src)
        tic = time.perf_counter()
        np.copyto(dst, src)
        runs.append(time.perf_counter() - tic)
    return src.nbytes / statistics.median(runs)


def central_bytes(src: tj.PTC, dst: tj.PTC) -> int:
    """Bytes a gather-to-one strategy moves: every leaf to one device, then out to every target.

    The central device is the one that needs the fewest bytes moved (it keeps what it holds).
    """
    best = None
    for c in sorted(set(src.device_ids) | set(dst.device_ids)):
        total = 0
        for s, d in zip(src.leaves, dst.leaves):
            held = _box_bytes(src.boxes(s).get(c), s) if c in src.device_ids else 0
            total += s.nbytes - held  # gather the whole leaf onto c
            total += sum(_box_bytes(box, d) for dev, box in dst.boxes(d).items() if dev != c)
        best = total if best is None else min(best, total)
    return best


def _box_bytes(box, leaf: tj.typing.LeafLayout) -> int:
    return 0 if box is None else boxes.nbytes(box, leaf.itemsize)


class _Strategies:
    """The four ways to move one placed state onto the target layout; each returns the new
    arrays."""

    def __init__(self, state, plan: tj.typing.Plan, workdir: str):
        import orbax.checkpoint as ocp

        self.state, self.plan, self.workdir = state, plan, workdir
        self.arrays = jax.tree.leaves(state)
        self.names = [leaf.path.replace("/", ".") for leaf in plan.src.leaves]
        mesh = plan.dst.mesh()
        self.shardings = [NamedSharding(mesh, leaf.dst.spec) for leaf in plan.leaves]
        self.target = {
            name: jax.ShapeDtypeStruct(leaf.dst.shape, leaf.dst.dtype, sharding=sharding)
            for name, leaf, sharding in zip(self.names, plan.leaves, self.shardings)
        }
        self.checkpointer = ocp.StandardCheckpointer()
        self.saves = 0
        self.report: tj.typing.ReshardReport | None = None

    def run(self, strategy: str):
        if strategy == "tenplex":
            out, self.report = tj.reshard(self.state, self.plan, donate=False)
            return out
        if strategy == "orbax":
            self.saves += 1
            path = f"{self.workdir}/ckpt{self.saves}"
            self.checkpointer.save(path, dict(zip(self.names, self.arrays)))
            self.checkpointer.wait_until_finished()
            return self.checkpointer.restore(path, self.target)
        if strategy == "host":
            return jax.device_put(jax.device_get(self.arrays), self.shardings)
        return jax.device_put(self.arrays, self.shardings)

    def clean(self, strategy: str) -> None:
        if strategy == "orbax":
            shutil.rmtree(f"{self.workdir}/ckpt{self.saves}", ignore_errors=True)


# orbax runs 4-16x longer than the others (half the matrix's time with two timed runs): one
# timed run after its warm-up tells its ratio to within the noise of a ratio of 8-50x
ORBAX_ROUNDS = 1


def run_change(
    change: Change, state, rules, repeats: int, memcpy: float, log, fresh: float | None = None
) -> dict:
    """Time the four strategies on one change, then measure bytes, bandwidth and peak memory.

    ``memcpy`` and ``fresh`` are this machine's memcpy bandwidths into mapped and fresh pages.
    orbax is timed in the first ``ORBAX_ROUNDS`` rounds only (its median then takes fewer runs).
    """
    # allow_replicate: a small model's dims need not divide by 3 (the 114.5M one's all do)
    src = tj.PTC.of(state, rules, change.src, change.src_devices, allow_replicate=True)
    dst = tj.PTC.of(state, rules, change.dst, change.dst_devices, allow_replicate=True)
    dst = tj.allocate(src, dst)
    tic = time.perf_counter()
    plan = tj.make_plan(src, dst)
    plan_seconds = time.perf_counter() - tic
    placed = tj.place(state, src)
    jax.block_until_ready(placed)
    runs: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    workdir = tempfile.mkdtemp(prefix="tenplex-bench-")
    try:
        strategies = _Strategies(placed, plan, workdir)
        rounds = range(repeats + 1)  # round 0 warms up dispatch, compile and file caches
        # a bar on a terminal only (a log keeps the row's line): a change of the 114.5M GPT's
        # matrix takes a minute
        for round_ in tqdm(rounds, desc=change.name, unit="round", leave=False, disable=None):
            for strategy in STRATEGIES:
                if strategy == "orbax" and round_ > ORBAX_ROUNDS:
                    continue
                tic = time.perf_counter()
                out = strategies.run(strategy)
                jax.block_until_ready(out)
                seconds = time.perf_counter() - tic
                del out
                strategies.clean(strategy)
                if round_:
                    runs[strategy].append(seconds)
        report = strategies.report
        del strategies
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    del placed
    memory = peak_memory(state, src, plan)
    medians = {s: statistics.median(r) for s, r in runs.items()}
    moved, central = plan.bytes_moved, central_bytes(src, dst)
    local_copies = sum(
        p.nbytes
        for leaf in plan.leaves
        for shard in leaf.shards
        if shard.kind != "keep"
        for p in shard.pieces
        if p.local
    )
    row = {
        "kind": "reshard",
        "change": change.name,
        "change_kind": change.kind,
        "from": f"{change.src} on {list(change.src_devices)}",
        "to": f"{change.dst} on {list(plan.dst.device_ids)}",
        "state_bytes": src.nbytes,
        "src_bytes_with_replicas": _replicated_bytes(src),
        "dst_bytes_with_replicas": _replicated_bytes(dst),
        "plan_seconds": plan_seconds,
        "repeats": repeats,
        "runs_seconds": runs,
        "median_seconds": medians,
        "speedup": {s: medians[s] / medians["tenplex"] for s in STRATEGIES if s != "tenplex"},
        "min_bytes": moved,
        "kept_bytes": plan.bytes_kept,
        "copied_bytes": report.bytes_moved,
        "bytes_ratio": report.bytes_moved / moved if moved else float(report.bytes_moved == 0),
        "central_bytes": central,
        "central_over_min": central / moved if moved else float("inf"),
        "bandwidth_bytes_per_s": moved / medians["tenplex"],
        "memcpy_bytes_per_s": memcpy,
        "bandwidth_ratio": moved / medians["tenplex"] / memcpy,
        # against a memcpy into fresh pages, as a reshard writes its new shards
        "memcpy_fresh_bytes_per_s": fresh or memcpy,
        "fresh_ratio": moved / medians["tenplex"] / (fresh or memcpy),
        # every byte the executor writes, local splits and merges included, per second
        "local_copy_bytes": local_copies,
        "copy_bandwidth_ratio": (moved + local_copies) / medians["tenplex"] / memcpy,
        # the largest speedup over orbax that moving the minimum bytes at memcpy speed allows
        "orbax_speedup_bound": medians["orbax"] * memcpy / moved if moved else float("inf"),
        **memory,
    }
    log(
        f"  {change.name:36s} tenplex {medians['tenplex'] * 1e3:8.1f} ms | orbax "
        f"{row['speedup']['orbax']:6.1f}x host {row['speedup']['host']:5.2f}x device_put "
        f"{row['speedup']['device_put']:5.2f}x | bytes {row['bytes_ratio']:.2f} bw "
        f"{row['bandwidth_ratio']:.2f} (fresh {row['fresh_ratio']:.2f}) peak "
        f"{row['peak_ratio']:.3f}"
    )
    return row


def peak_memory(state, src: tj.PTC, plan: tj.typing.Plan) -> dict:
    """Peak memory of one donating reshard (the library's default) against the steady states.

    Steady states: the state at rest on the source layout before, and on the target layout after
    (old state dropped). The state is placed afresh: an array timed by the host strategy holds the
    NumPy copy that ``jax.device_get`` caches on it.
    """
    without, baseline = settle(), live_arrays()  # the process without this row's state
    placed = tj.place(state, src)
    jax.block_until_ready(placed)
    before = settle()
    with MemorySampler() as sampler:
        new, _ = tj.reshard(placed, plan, donate=True)
        jax.block_until_ready(new)
        del placed  # rebinding, as a training loop does, frees the replicas no target shard reuses
    after = settle()
    live_after = live_buffer_bytes(since=baseline)
    del new
    steady, peak = max(before, after), max(sampler.peak, before, after)
    return {
        # exact, from JAX's live arrays: the buffers left after the donating reshard, against the
        # target layout's own bytes (with replicas); anything above is an old buffer not freed
        "live_after_bytes": live_after,
        "leaked_bytes": live_after - _replicated_bytes(plan.dst),
        "memory_metric": sampler.metric,
        "memory_without_state_bytes": without,
        "steady_before_bytes": before,
        "steady_after_bytes": after,
        "peak_bytes": peak,
        "peak_ratio": peak / steady,
        # only the memory above the process without this state: the runtime does not dilute it
        "state_peak_ratio": (peak - without) / max(steady - without, 1),
    }


def live_arrays() -> dict[int, weakref.ref]:
    """The JAX arrays alive in this process now, by id (held weakly: a baseline keeps none
    alive)."""
    gc.collect()
    return {id(a): weakref.ref(a) for a in jax.live_arrays() if not a.is_deleted()}


def live_buffer_bytes(since: dict[int, weakref.ref] | None = None) -> int:
    """Bytes of the distinct device buffers held by live JAX arrays made after ``since`` (a
    :func:`live_arrays` baseline; default: all)."""
    since = since or {}
    buffers = {}
    for ref in live_arrays().values():
        array = ref()
        if array is None or (id(array) in since and since[id(array)]() is array):
            continue
        plain = not jax.dtypes.issubdtype(array.dtype, jax.dtypes.extended)
        for shard in array.addressable_shards:
            data = shard.data  # arrays sharing a kept buffer count it once
            where = data.unsafe_buffer_pointer() if plain else (id(array), shard.index)
            buffers[(shard.device.id, where)] = data.nbytes
    return sum(buffers.values())


def _replicated_bytes(ptc: tj.PTC) -> int:
    return sum(_box_bytes(box, leaf) for leaf in ptc.leaves for box in ptc.boxes(leaf).values())
