"""HetPipe's pipeline within a VW: what the wave program's fill and drain cost today, measured,
and the unbroken pipeline's tick table (``tenplex_jax._src.wsp.pipeline``) run against it.

1. One VW of two pipeline stages (devices 0 and 1, the GPT with 4 layers) runs ``--waves`` waves
   alone with ``wave_step`` at ``Nm`` 1, 2, 4 (and 8), in turns for ``--rounds`` rounds; the
   first wave (it compiles) is left out. Measured per ``Nm``: samples per second (from the
   second wave's start to the last wave's push) and compute seconds per wave. In the SPMD GPipe
   program every stage computes at every tick, idle ones on nothing, so a wave's compute is
   ``c + (Nm + S - 1) tick``: the line through the compute per wave against ``Nm`` gives the
   tick (its slope) and the fill and drain (its intercept over its slope: ``S - 1``
   forward-and-backward ticks, plus the fixed cost of a wave in ticks). The tick tables give
   each stage's idle ticks per wave in steady state, per wave program and unbroken.
2. Both tables run (``tenplex_jax._src.wsp.hetpipe``, the GPT over two stages, AdamW,
   ``--tables-nm``): seconds per wave, and the ratio of their ticks. Only this with
   ``--only-tables``.
3. The real VW both ways (``--both-nm``, only this with ``--only-both``): the same VW (two
   stages, a store process, ``--waves`` waves, ``D = 1``) with the wave program and with
   ``pipeline="unbroken"``, in turns, for ``--rounds`` rounds after one that compiles: samples
   per second over the waves between the first (it fills) and the last (it drains), the
   unbroken one's over the wave program's per round (the median), and each stage's idle ticks
   per steady wave from the records (the calls the run made).

    python -m tenplex_jax_benchmarks.wsp_pipeline [--model tiny] [--only-tables | --only-both]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

import numpy as np

STAGES = 2
TABLES = ("per wave", "unbroken")


def _tables(nm: int, waves: int = 8) -> dict:
    """Per stage, the idle ticks of a steady wave (a tick: one forward or one backward of one
    minibatch on one stage) and the ticks per wave, per wave program and unbroken."""
    from tenplex_jax._src.wsp.pipeline import schedule

    out = {}
    for name, unbroken in (("per wave", False), ("unbroken", True)):
        table = schedule(STAGES, nm, [0] * waves, unbroken=unbroken)
        steady = table.idle_ticks()[waves // 2]
        span = table.entered((waves // 2 + 1) * nm) - table.entered(waves // 2 * nm)
        out[name] = {"idle_ticks_per_stage": list(steady), "ticks_per_wave": span}
    return out


def run_tables(model: str, minibatch: int, nms, waves: int, rounds: int, log=print) -> dict:
    """The tick tables run (``tenplex_jax._src.wsp.hetpipe``): the GPT over two stages (its
    embedding on the first, its head and loss on the last), AdamW,
    ``waves`` waves of ``Nm`` minibatches, the wave program's table against the unbroken one,
    each compiled first, then in turns ``rounds`` times; seconds per wave."""
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tenplex_jax._src.wsp import hetpipe
    from tenplex_jax._src.wsp.pipeline import schedule
    from tenplex_jax_models.gpt import GPT, GPTConfig, block_fn, stacked

    cfg = GPTConfig.by_name(model)
    with nnx.use_eager_sharding(False):
        gpt = GPT(cfg, rngs=nnx.Rngs(0))
    devices = jax.devices()[:STAGES]
    mesh = jax.make_mesh((STAGES,), ("pipe",), devices=devices, axis_types=(AxisType.Explicit,))
    weights = nnx.to_pure_dict(nnx.state(gpt, nnx.Param))
    layers = {k: jnp.asarray(v) for k, v in weights.items() if k in stacked(cfg)}
    outer = {k: jnp.asarray(v) for k, v in weights.items() if k not in layers}
    params = (
        jax.device_put(layers, NamedSharding(mesh, P("pipe"))),
        jax.device_put(outer, NamedSharding(mesh, P())),
    )
    rng = np.random.default_rng(0)

    def first(outer, tokens):  # the GPT's embedding, on the first stage
        return jnp.take(outer["tok_embed"], tokens, axis=0) + outer["pos_embed"][: tokens.shape[-1]]

    def loss(outer, h, targets):  # its head and loss, on the last
        norm = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)
        logits = (norm * outer["final_norm_scale"]) @ outer["unembed"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    gpt_stages = hetpipe.StageModel(first, block_fn(cfg), loss)
    optimizer = optax.adamw(1e-3)
    out = {}
    for nm in nms:
        n = nm * waves
        xs = jnp.asarray(rng.integers(0, cfg.vocab, (n, minibatch, cfg.seq_len)), jnp.int32)
        targets = jnp.roll(xs, -1, axis=-1)
        tables = {k: schedule(STAGES, nm, [0] * waves, unbroken=k == "unbroken") for k in TABLES}
        starts = {
            k: hetpipe.start(t, gpt_stages, params, optimizer.init(params), xs, mesh=mesh)
            for k, t in tables.items()
        }
        run = lambda k, tables=tables, starts=starts, xs=xs, targets=targets: jax.block_until_ready(
            hetpipe.run(tables[k], gpt_stages, optimizer, starts[k], xs, targets, mesh=mesh)
        )
        seconds = {k: [] for k in TABLES}
        for k in TABLES:
            run(k)  # compiles
        for _ in range(rounds):
            for k in TABLES:
                tic = time.perf_counter()
                run(k)
                seconds[k].append((time.perf_counter() - tic) / waves)
        wave = {k: statistics.median(v) for k, v in seconds.items()}
        ratio = statistics.median(a / b for a, b in zip(seconds["per wave"], seconds["unbroken"]))
        ticks = {k: tables[k].ticks for k in TABLES}
        out[str(nm)] = {
            "seconds_per_wave": wave,
            "ticks": ticks,
            "per_wave_over_unbroken": ratio,
            "runs": seconds,
        }
        log(
            f"  tables run, Nm {nm}: {wave['per wave'] * 1e3:.1f} ms a wave per wave program, "
            f"{wave['unbroken'] * 1e3:.1f} ms unbroken ({ratio:.2f}x; ticks "
            f"{ticks['per wave']} -> {ticks['unbroken']} for {waves} waves, "
            f"{ticks['per wave'] / ticks['unbroken']:.2f}x)"
        )
    return out


def run_pipeline(model: str, minibatch: int, nms, waves: int, rounds: int, log=print) -> dict:
    from tenplex_jax_benchmarks.wsp import one_vw, two_stage_job

    parts, state, steps = two_stage_job(model, minibatch)
    runs = {nm: {"samples_per_second": [], "compute_seconds_per_wave": []} for nm in nms}
    idle = {}
    for _ in range(rounds):
        for nm in nms:
            records = one_vw(parts, state, steps, nm, waves, wave_step=parts["wave_step"])
            records = records[1:]  # the first compiles
            seconds = records[-1].ended - records[0].started
            runs[nm]["samples_per_second"].append(len(records) * nm * minibatch / seconds)
            runs[nm]["compute_seconds_per_wave"].append(
                statistics.median(r.compute_seconds for r in records)
            )
            idle[nm] = records[0].idle_ticks
    median = {nm: {k: statistics.median(v) for k, v in row.items()} for nm, row in runs.items()}
    slope, intercept = np.polyfit(
        list(nms), [median[nm]["compute_seconds_per_wave"] for nm in nms], 1
    )
    row = {
        "kind": "wsp_pipeline",
        "model": model,
        "minibatch": minibatch,
        "stages": STAGES,
        "waves": waves,
        "rounds": rounds,
        "load": os.getloadavg()[0],
        "measured": {str(nm): {**median[nm], "record_idle_ticks": idle[nm]} for nm in nms},
        "tick_seconds": float(slope),
        "fill_and_drain_ticks": float(intercept / slope),
        "tables": {str(nm): _tables(nm) for nm in nms},
        "runs": {str(nm): row for nm, row in runs.items()},
    }
    log(
        f"  a tick (one minibatch's forward and backward on a stage) {slope * 1e3:.1f} ms; a "
        f"wave's fill, drain and fixed cost {intercept / slope:.2f} ticks (the schedule's "
        f"{STAGES - 1} fill and drain)"
    )
    for nm in nms:
        tables, measured = row["tables"][str(nm)], median[nm]
        bound = tables["per wave"]["ticks_per_wave"] / tables["unbroken"]["ticks_per_wave"]
        log(
            f"  Nm {nm}: {measured['samples_per_second']:.1f} samples/s, "
            f"{measured['compute_seconds_per_wave'] * 1e3:.0f} ms a wave, record idle_ticks "
            f"{idle[nm]}; steady idle ticks per stage per wave (forward or backward slots): "
            f"per wave {tables['per wave']['idle_ticks_per_stage']}, unbroken "
            f"{tables['unbroken']['idle_ticks_per_stage']}; ticks per wave "
            f"{tables['per wave']['ticks_per_wave']} -> {tables['unbroken']['ticks_per_wave']} "
            f"({bound:.2f}x, the unbroken pipeline's bound on the compute)"
        )
    return row


def run_both(model: str, minibatch: int, nms, waves: int, rounds: int, log=print) -> dict:
    """The VW with the wave program and unbroken, in turns (see the module's docstring, 3)."""
    from tenplex_jax_benchmarks.wsp import one_vw, two_stage_job

    parts, state, steps = two_stage_job(model, minibatch)
    ways = {"wave": {"wave_step": parts["wave_step"]}}
    ways["unbroken"] = {"pipeline": "unbroken", "unbroken": parts["unbroken"]}
    rate = {(w, nm): [] for w in ways for nm in nms}
    compute = {(w, nm): [] for w in ways for nm in nms}
    idle = {}
    for round_ in range(rounds + 1):  # the first compiles every call (its waves left out)
        for nm in nms:
            for way, options in ways.items():
                records = one_vw(parts, state, steps, nm, waves, distance=1, **options)
                if not round_:
                    continue
                steady = records[1:-1]  # the first fills, the last drains
                seconds = steady[-1].ended - steady[0].started
                rate[way, nm].append(len(steady) * nm * minibatch / seconds)
                compute[way, nm].append(statistics.median(r.compute_seconds for r in steady))
                idle[way, nm] = {
                    "record_idle_ticks": [r.idle_ticks for r in records],
                    "stage_idle_ticks": [list(r.stage_idle) for r in records],
                }
    out = {}
    for nm in nms:
        ratio = statistics.median(
            u / w for u, w in zip(rate["unbroken", nm], rate["wave", nm], strict=True)
        )
        out[str(nm)] = {
            way: {
                "samples_per_second": statistics.median(rate[way, nm]),
                "compute_seconds_per_wave": statistics.median(compute[way, nm]),
                "runs": rate[way, nm],
                **idle[way, nm],
            }
            for way in ways
        }
        out[str(nm)]["unbroken_over_wave_samples_per_second"] = ratio
        table = _tables(nm)
        out[str(nm)]["steady_idle_ticks_per_stage"] = {
            "wave (table)": table["per wave"]["idle_ticks_per_stage"],
            "unbroken (records)": idle["unbroken", nm]["stage_idle_ticks"][waves // 2],
        }
        log(
            f"  VW Nm {nm}: wave program {out[str(nm)]['wave']['samples_per_second']:.1f} "
            f"samples/s, unbroken {out[str(nm)]['unbroken']['samples_per_second']:.1f} "
            f"({ratio:.2f}x); steady idle ticks per stage per wave: wave program "
            f"{table['per wave']['idle_ticks_per_stage']} (record idle_ticks "
            f"{idle['wave', nm]['record_idle_ticks'][waves // 2]}), unbroken "
            f"{idle['unbroken', nm]['stage_idle_ticks'][waves // 2]} (record idle_ticks "
            f"{idle['unbroken', nm]['record_idle_ticks'][waves // 2]})"
        )
    return {"load": os.getloadavg()[0], "waves": waves, "rounds": rounds, "by_nm": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--minibatch", type=int, default=8)
    parser.add_argument("--nm", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tables-nm", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only-tables", action="store_true", help="only the tables run")
    parser.add_argument("--both-nm", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--only-both", action="store_true", help="only the VW both ways")
    parser.add_argument("--waves", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/wsp-pipeline"))
    args = parser.parse_args(argv)
    from tenplex_jax_benchmarks.suite import configure_jax

    configure_jax()
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"HetPipe's pipeline in a VW of {STAGES} stages, GPT {args.model}, minibatches of "
        f"{args.minibatch}, load {os.getloadavg()[0]:.1f}"
    )
    row = {}
    if not (args.only_tables or args.only_both):
        row = run_pipeline(args.model, args.minibatch, args.nm, args.waves, args.rounds)
    if not args.only_both:
        row["tables_run"] = run_tables(
            args.model, args.minibatch, args.tables_nm, args.waves, args.rounds
        )
    if not args.only_tables:
        row["vw_both_ways"] = run_both(
            args.model, args.minibatch, args.both_nm, args.waves, args.rounds
        )
    (args.out / "wsp_pipeline.json").write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
