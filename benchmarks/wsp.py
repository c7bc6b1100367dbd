"""Wave synchronous parallel on 8 fake CPU devices, one run, side by side.

Three virtual workers as threads (devices 0..3 as a two-stage pipeline, 4..5 and 6..7 data
parallel; ``vw3`` of a device type ``--slowdown`` times slower, simulated by sleeping), ``Nm`` in
proportion to speed (4, 2, 1), against one synchronous SPMD job over the same 8 devices (data
parallel, every step the same ``4 + 2 + 1`` minibatches, each step ``--slowdown`` times longer,
as when one of its devices is that much slower):

1. throughput (samples per second, from the first to the last commit after the VWs compiled) at
   ``D = 0, 1, 4`` and of the synchronous job;
2. loss against samples trained for each (the convergence cost of staleness): the mean of the last
   minibatches' losses, and ``DIR/wsp_loss.png``;
3. a VW killed mid-training (``D = 1``): the longest time no VW commits after the kill, against the
   median time between commits before it, and the launcher's generation restart
   (``benchmarks/RESULTS.md``: 12 to 19 s on this machine);
4. the parameter server's push (stage + commit + accumulate) and pull throughput against a memcpy
   (``np.copyto``) of the same bytes;
5. the loss after a VW joins with the optimizer state another shared, or with fresh moments,
   against a run without a join (``--only-join``: just this);
6. ``--time-to-loss`` (alone): WSP's time to the synchronous job's final loss at ``D`` 0, 1, 4 and
   every VW's ``Nm`` 1, 2, 4, against the synchronous job's (``--lr``, ``--wsp-lr``: AdamW's
   learning rates; ``--budget``: WSP may train that many times the synchronous job's minibatches;
   ``--processes``: each VW in a process of its own, as ``tj.wsp.Processes`` runs it, so that
   the VWs share no interpreter lock; ``--prefetch``: each VW claims its next wave and places
   its data ahead);
7. ``--ceiling`` (alone): the three VWs' plain train steps side by side, in threads, with no
   pull, push, ledger or clock around them (``vw3`` slowed the same), against the synchronous job:
   the most samples per second WSP could reach on these devices.

    python -m tenplex_jax_benchmarks.wsp [--model small] [--minibatches 160] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

GROUPS = ((0, 1, 2, 3), (4, 5), (6, 7))
NM = (4, 2, 1)
LR = 3e-3  # AdamW's learning rate, of the VWs and the synchronous job alike


def _stores(root: pathlib.Path, n: int = 2):
    from tenplex_jax.multihost.store import StoreProcess

    return [StoreProcess.start(root / f"s{i}") for i in range(n)]


def run_wsp(
    model: str,
    total: int,
    distance: int,
    slowdown: float,
    minibatch: int,
    kill: bool = False,
    log=print,
    nm: tuple[int, int, int] = NM,
    lr: float = LR,
    processes: bool = False,
    prefetch: bool = False,
) -> dict:
    """One WSP run; its commits' times, losses by samples, and (with ``kill``) the stall; ``nm``:
    each VW's ``Nm``; ``lr``: AdamW's learning rate; ``processes``: each VW in a process of its
    own (``tj.wsp.Processes``, no interpreter lock shared with another VW), not a thread;
    ``prefetch``: the VWs' ``WorkerOptions(prefetch=True)``."""
    import jax

    from tenplex_jax.wsp import Coordinator, ParameterServer, Processes, Threads, weights_of
    from tenplex_jax_models import wsp as job_parts

    parts = job_parts.job(1, model=model, minibatch=minibatch, lr=lr)
    state = parts["init"]()
    root = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-wsp-bench-"))
    steps = None if processes else job_parts.step_cache(parts, jax.devices())
    stores = _stores(root)
    try:
        addresses = [s.address for s in stores]

        def options_for(name, devices):
            i = GROUPS.index(tuple(devices))
            return ["--minibatches", str(nm[i]), "--slowdown", str(slowdown if i == 2 else 1.0)]

        def make(name, devices):
            p = job_parts.job(len(devices), model=model, minibatch=minibatch, lr=lr)
            i = GROUPS.index(devices)
            return job_parts.virtual_worker(
                p,
                name,
                devices,
                addresses,
                state,
                minibatches=nm[i],
                distance=distance,
                slowdown=slowdown if i == 2 else 1.0,
                timeout=3.0,
                steps=steps,
                prefetch=prefetch,
            )

        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=total)
            if processes:
                job = [f"model={model}", f"minibatch={minibatch}", f"lr={lr}"]
                runner = Processes(
                    "tenplex_jax_models.wsp:job",
                    addresses,
                    root / "run",
                    options=["--distance", str(distance), "--timeout", "3.0"]
                    + (["--prefetch"] if prefetch else [])
                    + [x for option in job for x in ("--option", option)],
                    options_for=options_for,
                )
            else:
                runner = Threads(make)
            with Coordinator(ps, runner) as coordinator:
                coordinator.add(*GROUPS)
                cpu = _cpu_times()
                killed = None
                if kill:
                    ledger = ps.ledger()
                    while ledger.trained_count < total // 3:
                        ledger = ps.wait(1.0)  # the next commit
                    coordinator.kill("vw2")
                    killed = time.time()
                coordinator.wait(timeout=1200)
                cpu = [b - a for a, b in zip(cpu, _cpu_times())]
            records = [dataclasses.asdict(r) for r in coordinator.records()]
    finally:
        for s in stores:
            s.kill()
    ends = sorted(r["ended"] for r in records)
    first = min(ends)
    samples = (sum(len(r["minibatches"]) for r in records) - 1) * minibatch  # after the first
    per_vw = {}
    for r in records:  # where each VW's time went
        v = per_vw.setdefault(
            r["vw"],
            {
                "waves": 0,
                "minibatches": 0,
                "compute": 0.0,
                "wait": 0.0,
                "slowdown": 0.0,
                "push": 0.0,
                "push_wait": 0.0,
            },
        )
        v["waves"] += 1
        v["minibatches"] += len(r["minibatches"])
        for key in ("compute", "wait", "slowdown", "push"):
            v[key] += r[f"{key}_seconds"]
        # what the compute waited for pushes (all of it where the push was on its thread)
        v["push_wait"] += r.get("push_wait_seconds", r["push_seconds"])
    row = {
        "distance": distance,
        "minibatches": total,
        "waves": len(records),
        "seconds": max(ends) - first,
        "samples_per_second": samples / (max(ends) - first),
        "per_vw": per_vw,
        "losses": _curve(records, minibatch),
        "commits": [(r["ended"] - first, len(r["minibatches"])) for r in sorted(records, key=_end)],
        # the machine's cores busy while the VWs trained (this process, the stores, the rest)
        "cpu_busy": cpu[0] / cpu[1] if cpu[1] else None,
    }
    if killed is not None:
        before = [b - a for a, b in itertools.pairwise(ends) if b < killed]
        after = [b - max(a, killed) for a, b in itertools.pairwise(ends) if b >= killed]
        row |= {
            "median_gap_before_kill": statistics.median(before),
            "longest_gap_after_kill": max(after),
        }
    log(
        f"  WSP D={distance}{' with a kill' if kill else ''}: "
        f"{row['samples_per_second']:.1f} samples/s over {row['seconds']:.1f} s; per VW (waves, "
        f"compute / wait / slowdown / push s): "
        + "; ".join(
            f"{vw} {v['waves']}, {v['compute']:.2f} / {v['wait']:.2f} / {v['slowdown']:.2f} / "
            f"{v['push']:.2f}"
            for vw, v in sorted(per_vw.items())
        )
    )
    return row


def _cpu_times() -> tuple[int, int]:
    """The machine's busy and total CPU ticks so far (``/proc/stat``; zeros elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return sum(ticks) - idle, sum(ticks)


def run_sync(
    model: str, steps: int, slowdown: float, minibatch: int, log=print, lr: float = LR
) -> dict:
    """One SPMD job over the 8 devices, each step the wave's sum(NM) minibatches, slowed down."""
    import jax

    import tenplex_jax as tj
    from tenplex_jax_models import LOGICAL_RULES, build_state, make_train_step
    from tenplex_jax_models import wsp as job_parts

    per_step = sum(NM) * minibatch
    graphdef, state, _ = build_state(model, lr)
    dataset = job_parts.job(1, model=model, minibatch=per_step)["dataset"]
    ptc = tj.PTC.of(state, LOGICAL_RULES, tj.ParallelConfig(data=8), jax.devices())
    layout = tj.data.BatchLayout(per_step, ranks=8)
    step = make_train_step(graphdef, ptc, layout)
    state = tj.place(state, ptc)
    ends, losses = [], []
    for k in range(steps + 1):
        batch, weights, _ = tj.data.device_batch(dataset, k, layout, ptc.mesh())
        tic = time.perf_counter()
        state, loss = step(state, batch, weights)
        loss = float(loss)
        time.sleep((slowdown - 1.0) * (time.perf_counter() - tic))  # the slow device's step
        ends.append(time.time())
        losses.append(loss)
    seconds = ends[-1] - ends[0]  # step 0 compiles
    curve = [((k + 1) * per_step, loss) for k, loss in enumerate(losses)]
    row = {
        "steps": steps,
        "seconds": seconds,
        "samples_per_second": steps * per_step / seconds,
        "losses": curve,
    }
    log(f"  synchronous SPMD: {row['samples_per_second']:.1f} samples/s over {seconds:.1f} s")
    return row


def _end(record) -> float:
    return record["ended"]


def _curve(records, minibatch) -> list[tuple[int, float]]:
    done, out = 0, []
    for r in sorted(records, key=_end):
        for loss in r["losses"]:
            done += minibatch
            out.append((done, loss))
    return out


def time_to_loss(row: dict, target: float, window: int) -> float | None:
    """Seconds from a run's first commit (after its compile) until the mean loss of its last
    ``window`` minibatches, in commit order, is at most ``target``; None if it never is."""
    losses = [loss for _, loss in row["losses"]]
    if "commits" not in row:  # the synchronous job: a step of sum(NM) minibatches every step
        per = row["seconds"] / row["steps"]
        for k in range(len(losses)):
            if k + 1 >= window and np.mean(losses[k + 1 - window : k + 1]) <= target:
                return k * per
        return None
    seen, ends = 0, []
    for end, count in row["commits"]:
        seen += count
        ends.append((seen, end))
    for k in range(window - 1, len(losses)):
        if np.mean(losses[k + 1 - window : k + 1]) <= target:
            return next(end for seen, end in ends if seen > k)
    return None


def run_time_to_loss(
    model,
    total,
    slowdown,
    minibatch,
    log=print,
    lr: float = LR,
    wsp_lr: float | None = None,
    budget: float = 1.0,
    nms: tuple[int, ...] = (1, 2, 4),
    processes: bool = False,
    prefetch: bool = False,
) -> dict:
    """WSP at D in {0, 1, 4} and every VW's Nm in ``nms``: the time to reach the synchronous
    job's final loss (the mean of its last 3 steps' losses), against the synchronous job's time
    to it (both from their first step after compiling; the slow device slows both the same).
    The synchronous job trains ``total`` minibatches of ``minibatch`` sequences with AdamW at
    ``lr``; each WSP run at most ``budget`` times as many, at ``wsp_lr`` (default ``lr``): the
    time to a loss need not be reached within the synchronous job's samples. ``processes``: the
    VWs in processes of their own, not threads of this one; ``prefetch``: each VW claims its
    next wave and places its data ahead, on a thread of its own."""
    wsp_lr = lr if wsp_lr is None else wsp_lr
    sync = run_sync(model, total // sum(NM), slowdown, minibatch, log=log, lr=lr)
    sync_losses = [loss for _, loss in sync["losses"]]
    target = float(np.mean(sync_losses[-3:]))
    base = time_to_loss(sync, target, 3)
    rows, most = {}, round(total * budget)
    for d, n in itertools.product((0, 1, 4), nms):
        row = run_wsp(
            model,
            most,
            d,
            slowdown,
            minibatch,
            log=log,
            nm=(n, n, n),
            lr=wsp_lr,
            processes=processes,
            prefetch=prefetch,
        )
        t = time_to_loss(row, target, 3 * sum(NM))
        rows[f"D={d} Nm={n}"] = {
            "seconds_to_target": t,
            "over_synchronous": None if t is None else t / base,
            "samples_per_second": row["samples_per_second"],
            "final_loss": float(np.mean([x for _, x in row["losses"][-3 * sum(NM) :]])),
        }
        log(
            f"  D={d} Nm={n}: the synchronous job's loss {target:.3f} after "
            + ("never" if t is None else f"{t:.2f} s ({t / base:.2f}x its {base:.2f} s)")
        )
    return {
        "model": model,
        "minibatch": minibatch,
        "lr": lr,
        "wsp_lr": wsp_lr,
        "slowdown": slowdown,
        "minibatches": total,
        "wsp_minibatches": most,
        "vws": "processes" if processes else "threads",
        "prefetch": prefetch,
        "load_average": os.getloadavg(),
        "target": target,
        "synchronous_seconds": base,
        "synchronous_samples_per_second": sync["samples_per_second"],
        "wsp": rows,
    }


def run_ps(megabytes: int = 64, repeats: int = 5, log=print) -> dict:
    """Push (stage and check, commit, accumulate) and pull of ``megabytes`` of weights in 8
    leaves over two stores, against ``np.copyto`` of the same bytes, and the push's phases
    (``benchmarks/ps_push.py`` compares them with another revision and with their floors)."""
    from tenplex_jax.wsp import ParameterServer

    leaves = 8
    n = megabytes * 2**20 // 4 // leaves
    weights = {f"w{i}": np.zeros(n, np.float32) for i in range(leaves)}
    update = {p: np.full(n, 1e-3, np.float32) for p in weights}
    stores = _stores(pathlib.Path(tempfile.mkdtemp(prefix="tenplex-ps-bench-")))
    try:
        with ParameterServer([s.address for s in stores]) as ps:
            ps.create(weights, total=None)
            ps.update(lambda led: (led.join("b"), None))
            push, pull, phases = [], [], []
            for wave in range(repeats + 1):
                ps.update(lambda led, wave=wave: led.claim("b", wave, 1))
                tic = time.perf_counter()
                ps.push("b", wave, update)
                push.append(time.perf_counter() - tic)
                phases.append(ps.push_seconds)
                tic = time.perf_counter()
                ps.pull()
                pull.append(time.perf_counter() - tic)
    finally:
        for s in stores:
            s.kill()
    src, dst = np.ones(n * leaves, np.float32), np.empty(n * leaves, np.float32)
    copies = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - tic)
    nbytes = n * leaves * 4
    memcpy = nbytes / statistics.median(copies[1:])
    row = {
        "bytes": nbytes,
        "push_bytes_per_s": nbytes / statistics.median(push[1:]),
        "pull_bytes_per_s": nbytes / statistics.median(pull[1:]),
        "memcpy_bytes_per_s": memcpy,
    }
    median = {k: statistics.median(p[k] for p in phases[1:]) for k in phases[-1]}
    row |= {
        "push_over_memcpy": row["push_bytes_per_s"] / memcpy,
        "pull_over_memcpy": row["pull_bytes_per_s"] / memcpy,
        "push_phases_s": median,
    }
    log(
        f"  parameter server, {megabytes} MiB: push {row['push_bytes_per_s'] / 1e9:.2f} GB/s "
        f"({row['push_over_memcpy']:.2f} of memcpy), pull {row['pull_bytes_per_s'] / 1e9:.2f} "
        f"GB/s ({row['pull_over_memcpy']:.2f}); the push's phases: "
        + ", ".join(f"{k} {v:.3f}" for k, v in median.items())
        + " s"
    )
    return row


def run_join(model: str, minibatch: int, before: int = 150, after: int = 12, log=print) -> dict:
    """The loss after a VW joins, against a run without a join: VW ``a`` (one device, ``Nm``
    2) trains ``before`` waves and leaves; ``b`` joins and trains ``after`` waves, taking the
    optimizer state ``a`` shared, or (``a`` sharing nothing) with ``init()``'s fresh moments;
    against ``a`` training all ``before + after`` waves. One VW at a time, so the three runs
    differ only in the joiner's optimizer state (the weights come from the parameter server)."""
    import jax

    from tenplex_jax.wsp import ParameterServer, weights_of
    from tenplex_jax_models import wsp as job_parts

    parts = job_parts.job(1, model=model, minibatch=minibatch)
    state = parts["init"]()
    steps = job_parts.step_cache(parts, jax.devices()[:1])
    losses = {}
    for case in ("no join", "join, optimizer shared", "join, fresh optimizer"):
        (store,) = _stores(pathlib.Path(tempfile.mkdtemp(prefix="tenplex-wsp-join-")), 1)
        try:

            def vw(name, address=store.address, **kwargs):
                return job_parts.virtual_worker(
                    parts, name, [0], [address], state, minibatches=2, steps=steps, **kwargs
                )

            with ParameterServer([store.address]) as ps:
                ps.create(weights_of(state), total=None)
                if case == "no join":
                    records = vw("a").run(waves=before + after)[before:]
                else:
                    vw("a", optimizer_every=4 if "shared" in case else 0).run(waves=before)
                    records = vw("b").run(waves=after)
            losses[case] = [x for r in records for x in r.losses]
        finally:
            store.kill()
    first = 4  # the joiner's first minibatches: where fresh AdamW moments take steps of lr
    row = {
        "before_waves": before,
        "after_waves": after,
        "losses_after": losses,
        "mean_first": {k: float(np.mean(v[:first])) for k, v in losses.items()},
        "mean_after": {k: float(np.mean(v)) for k, v in losses.items()},
    }
    log(
        f"  a VW joins after {before} waves of 2 minibatches; mean loss of its first {first} / "
        f"all {2 * after} minibatches: "
        + "; ".join(f"{k} {row['mean_first'][k]:.4f} / {row['mean_after'][k]:.4f}" for k in losses)
    )
    return row


def two_stage_job(model: str, minibatch: int) -> tuple[dict, object, object]:
    """The GPT with 4 layers as a job of VWs of two pipeline stages: its parts (``pipe=2``), its
    initial state, and a step cache on devices 0 and 1 its VWs share."""
    import jax

    import tenplex_jax
    from tenplex_jax_models import wsp as job_parts

    parts = dict(job_parts.job(2, model=model, minibatch=minibatch, layers=4))
    parts["config"] = tenplex_jax.ParallelConfig(pipe=2)
    return parts, parts["init"](), job_parts.step_cache(parts, jax.devices()[:2])


def one_vw(parts: dict, state, steps, nm: int, waves: int, **options) -> list:
    """The records of ``waves`` waves of one VW of ``parts`` on devices 0 and 1, ``Nm`` ``nm``,
    alone on a parameter server of a fresh store (killed after); ``options``: more of its
    ``WorkerOptions``."""
    from tenplex_jax.wsp import ParameterServer, weights_of
    from tenplex_jax_models import wsp as job_parts

    (store,) = _stores(pathlib.Path(tempfile.mkdtemp(prefix="tenplex-wsp-vw-")), 1)
    try:
        with ParameterServer([store.address]) as ps:
            ps.create(weights_of(state), total=None)
            vw = job_parts.virtual_worker(
                parts,
                "vw",
                [0, 1],
                [store.address],
                state,
                minibatches=nm,
                steps=steps,
                optimizer_every=0,
                **options,
            )
            return vw.run(waves=waves)
    finally:
        store.kill()


def run_ceiling(
    model: str, minibatch: int, slowdown: float, seconds: float = 8.0, log=print
) -> dict:
    """What the three VWs' devices can train with no wave around their steps: each VW's own
    layout (``GROUPS``, ``config_for``) running its plain train step on minibatches of
    ``minibatch`` in a thread of its own for ``seconds``, ``vw3`` sleeping ``slowdown - 1``
    times each step, with no pull, push, ledger or clock, beside the synchronous job's
    samples per second in the same run: the most WSP's samples per second could be here; and
    with the same ``Nm`` in every VW, where no VW can lead the slowest by more than ``D`` waves,
    three times the slowest VW's, at any ``D``."""
    import threading

    import jax

    import tenplex_jax as tj
    from tenplex_jax_models import LOGICAL_RULES, build_state, make_train_step
    from tenplex_jax_models import wsp as job_parts

    sync = run_sync(model, 20, slowdown, minibatch, log=log)
    graphdef, state, _ = build_state(model, LR)
    dataset = job_parts.job(1, model=model, minibatch=minibatch)["dataset"]
    go, counts, steps = threading.Barrier(len(GROUPS)), [0] * len(GROUPS), []
    for devices in GROUPS:
        config = job_parts.config_for(len(devices))
        ptc = tj.PTC.of(state, LOGICAL_RULES, config, [jax.devices()[d] for d in devices])
        layout = tj.data.BatchLayout(minibatch, ranks=config.data)
        steps.append((make_train_step(graphdef, ptc, layout), tj.place(state, ptc), ptc, layout))

    def train(i: int) -> None:
        step, placed, ptc, layout = steps[i]
        slow = slowdown if i == len(GROUPS) - 1 else 1.0
        for k in range(2):  # compiled and warm before the clock starts
            batch, weights, _ = tj.data.device_batch(dataset, k, layout, ptc.mesh())
            placed, loss = step(placed, batch, weights)
            float(loss)
        go.wait()
        end, k = time.perf_counter() + seconds, 2
        while time.perf_counter() < end:
            batch, weights, _ = tj.data.device_batch(dataset, k, layout, ptc.mesh())
            tic = time.perf_counter()
            placed, loss = step(placed, batch, weights)
            float(loss)
            time.sleep((slow - 1.0) * (time.perf_counter() - tic))
            counts[i], k = counts[i] + minibatch, k + 1

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(GROUPS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ceiling = sum(counts) / seconds
    # with every VW's Nm the same, a VW leads the slowest by at most D waves: over a long run
    # each trains as many minibatches as the slowest, at any D
    lockstep = len(GROUPS) * min(counts) / seconds
    row = {
        "model": model,
        "minibatch": minibatch,
        "slowdown": slowdown,
        "seconds": seconds,
        "samples_per_second_per_vw": [c / seconds for c in counts],
        "samples_per_second": ceiling,
        "synchronous_samples_per_second": sync["samples_per_second"],
        "over_synchronous": ceiling / sync["samples_per_second"],
        "equal_nm_samples_per_second": lockstep,
        "equal_nm_over_synchronous": lockstep / sync["samples_per_second"],
    }
    log(
        f"  the VWs' steps with no wave: {ceiling:.1f} samples/s "
        f"({', '.join(f'{c / seconds:.0f}' for c in counts)}), "
        f"{row['over_synchronous']:.2f}x the synchronous job; with the same Nm in every VW "
        f"(the slowest's pace, at any D) {lockstep:.1f} samples/s, "
        f"{row['equal_nm_over_synchronous']:.2f}x"
    )
    return row


def run_pipeline(
    model: str, minibatch: int, waves: int = 12, nm: int = 4, rounds: int = 3, log=print
) -> dict:
    """HetPipe's pipelined wave against one step per minibatch: a VW of two pipeline stages
    (devices 0 and 1, the GPT with 4 layers), ``Nm`` minibatches a wave, alone; each round runs
    both, one after the other. Per minibatch: the compute seconds (the first wave, which
    compiles, left out) and the idle ticks of each stage by the schedule."""
    parts, state, steps = two_stage_job(model, minibatch)
    seconds, idle = {"pipelined wave": [], "a step per minibatch": []}, {}
    for _ in range(rounds):
        for case in seconds:
            wave = parts["wave_step"] if case == "pipelined wave" else None
            records = one_vw(parts, state, steps, nm, waves, wave_step=wave)[1:]
            seconds[case].append(sum(r.compute_seconds for r in records) / (nm * len(records)))
            idle[case] = records[0].idle_ticks
    row = {
        "nm": nm,
        "stages": 2,
        "idle_ticks_per_wave": idle,
        "compute_seconds_per_minibatch": {k: float(np.median(v)) for k, v in seconds.items()},
        "rounds": seconds,
    }
    piped, each = (row["compute_seconds_per_minibatch"][k] for k in seconds)
    log(
        f"  two stages, Nm {nm}: idle ticks per wave {idle['pipelined wave']} pipelined, "
        f"{idle['a step per minibatch']} a step per minibatch; compute per minibatch "
        f"{piped * 1e3:.1f} ms against {each * 1e3:.1f} ms ({each / piped:.2f}x)"
    )
    return row


def plot(rows: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, row in rows.items():
        xs, ys = zip(*row["losses"])
        window = 8
        smooth = np.convolve(ys, np.ones(window) / window, mode="valid")
        ax.plot(xs[window - 1 :], smooth, label=name)
    ax.set_xlabel("samples trained")
    ax.set_ylabel("loss (moving mean of 8 minibatches)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--minibatches", type=int, default=161)
    parser.add_argument("--minibatch", type=int, default=8)
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument(
        "--lr", type=float, default=LR, help="AdamW's learning rate (--time-to-loss)"
    )
    parser.add_argument(
        "--wsp-lr", type=float, default=None, help="the VWs' learning rate (default: --lr)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1.0,
        help="each WSP run trains at most this many times the synchronous job's minibatches",
    )
    parser.add_argument(
        "--nm", default="1,2,4", help="the Nm values of the D x Nm table (--time-to-loss)"
    )
    parser.add_argument(
        "--processes",
        action="store_true",
        help="each VW in a process of its own, not a thread of this one (--time-to-loss)",
    )
    parser.add_argument(
        "--prefetch",
        action="store_true",
        help="the VWs claim their next wave and place its data ahead (--time-to-loss)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/wsp-bench"))
    parser.add_argument(
        "--only-join", action="store_true", help="only the join row (the joiner's optimizer)"
    )
    parser.add_argument(
        "--only-pipeline",
        action="store_true",
        help="only the pipelined wave against a step per minibatch (two stages)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="only the VWs' plain steps side by side, no wave, against the synchronous job",
    )
    parser.add_argument(
        "--time-to-loss",
        action="store_true",
        help="only WSP's time to the synchronous job's loss, D x Nm",
    )
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.time_to_loss:
        print(
            f"time to the synchronous job's loss, GPT {args.model}, minibatches of "
            f"{args.minibatch}, lr {args.lr:g} (WSP {args.wsp_lr or args.lr:g}), vw3 "
            f"{args.slowdown:g}x slow, WSP up to {args.budget:g}x the samples, VWs as "
            f"{'processes' if args.processes else 'threads'}"
            f"{', prefetching' if args.prefetch else ''}"
        )
        row = run_time_to_loss(
            args.model,
            args.minibatches,
            args.slowdown,
            args.minibatch,
            lr=args.lr,
            wsp_lr=args.wsp_lr,
            budget=args.budget,
            nms=tuple(int(n) for n in args.nm.split(",")),
            processes=args.processes,
            prefetch=args.prefetch,
        )
        (args.out / "wsp_time_to_loss.json").write_text(json.dumps(row, indent=1) + "\n")
        return 0
    if args.ceiling:
        print(
            f"the VWs' steps with no wave, GPT {args.model}, minibatches of {args.minibatch}, "
            f"vw3 {args.slowdown:g}x slow"
        )
        row = run_ceiling(args.model, args.minibatch, args.slowdown)
        (args.out / "wsp_ceiling.json").write_text(json.dumps(row, indent=1) + "\n")
        return 0
    if args.only_pipeline:
        print(f"HetPipe's pipelined wave, GPT {args.model}, minibatches of {args.minibatch}")
        row = run_pipeline(args.model, args.minibatch)
        (args.out / "wsp_pipeline.json").write_text(json.dumps(row, indent=1) + "\n")
        return 0
    if args.only_join:
        print(f"a joining VW's optimizer state, GPT {args.model}, minibatches of {args.minibatch}")
        row = run_join(args.model, args.minibatch)
        (args.out / "wsp_join.json").write_text(json.dumps(row, indent=1) + "\n")
        return 0
    print(
        f"wave synchronous parallel, GPT {args.model}, {args.minibatches} minibatches of "
        f"{args.minibatch}, vw3 {args.slowdown:g}x slower, load {os.getloadavg()[0]:.1f}"
    )
    runs = {
        f"WSP D={d}": run_wsp(args.model, args.minibatches, d, args.slowdown, args.minibatch)
        for d in (0, 1, 4)
    }
    runs["synchronous"] = run_sync(
        args.model, args.minibatches // sum(NM), args.slowdown, args.minibatch
    )
    killed = run_wsp(args.model, args.minibatches, 1, args.slowdown, args.minibatch, kill=True)
    ps = run_ps()
    join = run_join(args.model, args.minibatch)
    tail = 21
    summary = {
        "model": args.model,
        "minibatch": args.minibatch,
        "slowdown": args.slowdown,
        "load_average": os.getloadavg(),
        "samples_per_second": {k: r["samples_per_second"] for k, r in runs.items()},
        "over_synchronous": {
            k: r["samples_per_second"] / runs["synchronous"]["samples_per_second"]
            for k, r in runs.items()
        },
        "final_loss": {  # the same samples: 21 minibatches, or the synchronous job's 3 steps
            k: float(
                np.mean([x for _, x in r["losses"][-(tail // sum(NM) if "steps" in r else tail) :]])
            )
            for k, r in runs.items()
        },
        "kill": {k: killed[k] for k in ("median_gap_before_kill", "longest_gap_after_kill")},
        "parameter_server": ps,
        "join": join,
        "runs": runs,
    }
    plot(runs, args.out / "wsp_loss.png")
    (args.out / "wsp.json").write_text(json.dumps(summary, indent=1) + "\n")
    for k in runs:
        print(
            f"  {k:12s} {summary['samples_per_second'][k]:7.1f} samples/s "
            f"({summary['over_synchronous'][k]:.2f}x synchronous), loss of the last {tail} "
            f"minibatches {summary['final_loss'][k]:.3f}"
        )
    print(
        f"  a VW killed: no commit for {summary['kill']['longest_gap_after_kill']:.2f} s "
        f"(median gap between commits before: {summary['kill']['median_gap_before_kill']:.3f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
