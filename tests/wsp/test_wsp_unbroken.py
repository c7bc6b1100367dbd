"""A VW running HetPipe's unbroken pipeline (``WorkerOptions(pipeline="unbroken")``): one VW of
two stages, ``Nm = 2``, on a parameter server of a store process, trains what the sequential
reference of its schedule does, as the wave program does, with local staleness exactly ``Nm - 1``;
and its pipeline does not drain at wave boundaries: its steady waves' calls leave no stage idle
(measured from the windows the run called), where the wave program's idle ``stages - 1``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src import tree
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp.pipeline import schedule
from tenplex_jax._src.wsp.unbroken import Calls
from tenplex_jax.wsp import Coordinator, ParameterServer, Threads, WorkerOptions, weights_of
from tenplex_jax_models import build_state, unbroken_model, wave_step
from tenplex_jax_models import wsp as job_parts
from tests.wsp import test_wsp_worker as worker_tests
from tests.wsp.test_wsp_worker import LR, MINIBATCHES, _reference

job = worker_tests.job  # the fixture: the tiny GPT's parts and the reference's gradient

NM, STAGES = 2, 2
PIPELINES = {}  # per pipeline, its option: built once, so the VWs share their compiled programs


def _options(pipeline: str) -> dict:
    if not PIPELINES:
        graphdef, abstract, _ = build_state("tiny", LR, optimizer="momentum", abstract=True)
        PIPELINES["wave"] = {"wave_step": wave_step(graphdef)}
        PIPELINES["unbroken"] = {
            "pipeline": "unbroken",
            "unbroken": unbroken_model(graphdef, abstract),
        }
    return PIPELINES[pipeline]


def _run(stores, job, pipeline, distance, name, total=MINIBATCHES, nm=NM, **options):
    parts, state = job[:2]
    parts = dict(parts, config=tj.ParallelConfig(pipe=STAGES))
    sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
    steps = StepCache(parts["train_step"], sample, jax.devices()[:STAGES], donate=False)
    address = stores.start(name).address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=total)
        worker = job_parts.virtual_worker(
            parts,
            "vw",
            list(range(STAGES)),
            [address],
            state,
            minibatches=nm,
            distance=distance,
            steps=steps,
            **_options(pipeline),
            **options,
        )
        records = worker.run()
        return records, ps.pull(), ps.history(), worker


@pytest.mark.parametrize("distance", [0, 1])
def test_a_vw_runs_the_unbroken_pipeline_to_the_reference_and_never_drains_between_waves(
    stores, job, distance
):
    params, gradient = job[3:]
    want = _reference(params, gradient, NM, distance)
    records = {}
    for pipeline in ("wave", "unbroken"):
        records[pipeline], got, ledger, worker = _run(
            stores, job, pipeline, distance, f"{pipeline}{distance}"
        )
        done = records[pipeline]
        # the optimizer's step count: every update, written back from the pipeline too
        paths, leaves, _ = tree.arrays(worker.state)
        assert int(leaves[paths.index("optimizer/step")]) == MINIBATCHES
        # the same pushes, pulls and records as the wave program's
        assert [m for r in done for m in r.minibatches] == list(range(MINIBATCHES))
        assert sorted(ledger.trained()) == list(range(MINIBATCHES))
        assert [v for r in done for v in r.local_versions] == [
            max(p - NM + 1, 0) for p in range(MINIBATCHES)
        ]
        assert [s for r in done for s in r.local_staleness] == [
            min(p, NM - 1) for p in range(MINIBATCHES)
        ]
        assert [r.pulled for r in done] == [
            k > 0 and (distance == 0 or k % 2 == 0) for k in range(MINIBATCHES // NM)
        ]
        assert all(g <= distance for r in done for g in r.global_staleness)
        assert all(np.isfinite(x) for r in done for x in r.losses)
        for path in want:
            diff = np.abs(got[path] - want[path]).max() / np.abs(want[path]).max()
            assert diff <= 1e-6, (pipeline, distance, path, diff)
    # the wave program fills and drains every wave: stages - 1 idle a wave, every wave
    assert [r.idle_ticks for r in records["wave"]] == [STAGES - 1] * (MINIBATCHES // NM)
    assert all(r.stage_idle == () for r in records["wave"])
    # unbroken: the first wave fills, the last drains, none between (what the calls ran)
    idle = [r.stage_idle for r in records["unbroken"]]
    assert idle[1:-1] == [(0,) * STAGES] * (MINIBATCHES // NM - 2), idle
    assert [r.idle_ticks for r in records["unbroken"]][1:-1] == [0] * (MINIBATCHES // NM - 2)
    assert min(idle[0]) > 0 and min(idle[-1]) > 0
    # the wave program's table idles each stage 2 (stages - 1) ticks a wave
    per_wave = schedule(STAGES, NM, [0] * 3, unbroken=False).idle_ticks()
    assert per_wave[1] == (2 * (STAGES - 1),) * STAGES
    # and the losses agree: the same minibatches on the same weights
    for a, b in zip(records["wave"], records["unbroken"]):
        np.testing.assert_allclose(a.losses, b.losses, rtol=1e-5)


def test_a_vw_that_stops_drains_its_pipeline_and_pushes_every_wave_it_claimed(stores, job):
    # a limit of 3 waves: the third is not followed by a claim ahead, the pipeline drains
    parts, state = job[:2]
    address = stores.start("limit3").address
    parts = dict(parts, config=tj.ParallelConfig(pipe=STAGES))
    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=None)
        worker = job_parts.virtual_worker(
            parts, "vw", [0, 1], [address], state, minibatches=NM, **_options("unbroken")
        )
        done = worker.run(waves=3)
        assert [r.wave for r in done] == [0, 1, 2]
        assert sorted(ps.history().trained()) == list(range(3 * NM))
        assert min(done[-1].stage_idle) > 0  # drained


@pytest.mark.parametrize("nm", [1, 4])
def test_fewer_or_more_minibatches_in_flight_than_stages_train_the_reference(stores, job, nm):
    # Nm = 1: a wave's second call has no ticks (wave k + 1 is claimed at its pull point) and a
    # stage idles 2 (stages - Nm) ticks a wave; Nm = 4: more in flight than stages, none idle
    params, gradient = job[3:]
    want = _reference(params, gradient, nm, 1)
    done, got, _, _ = _run(stores, job, "unbroken", 1, f"nm{nm}", nm=nm)
    assert [m for r in done for m in r.minibatches] == list(range(MINIBATCHES))
    assert [s for r in done for s in r.local_staleness] == [
        min(p, nm - 1) for p in range(MINIBATCHES)
    ]
    steady = (2 * max(STAGES - nm, 0),) * STAGES
    assert [r.stage_idle for r in done[1:-1]] == [steady] * (MINIBATCHES // nm - 2)
    for path in want:
        diff = np.abs(got[path] - want[path]).max() / np.abs(want[path]).max()
        assert diff <= 1e-6, (nm, path, diff)


def test_a_last_wave_of_fewer_than_nm_runs_a_pipeline_of_its_own_as_the_wave_program_reads_it(
    stores, job
):
    # 7 minibatches in waves of 2: the claim ahead of the fourth gets one, so the third wave's
    # pipeline drains and the last minibatch runs alone, on the weights holding all six before
    # it, as the wave program's last read does
    runs = {p: _run(stores, job, p, 1, f"{p}7", total=7) for p in ("wave", "unbroken")}
    (wave, want, _, _), (done, got, ledger, worker) = runs["wave"], runs["unbroken"]
    assert worker.unbroken.positions is not None  # a wave's end writes the weights alone
    assert [r.minibatches for r in done] == [(0, 1), (2, 3), (4, 5), (6,)]
    assert sorted(ledger.trained()) == list(range(7))
    for field in ("local_versions", "local_staleness", "global_staleness", "pulled"):
        assert [getattr(r, field) for r in done] == [getattr(r, field) for r in wave], field
    assert done[-1].local_versions == (6,) and min(done[2].stage_idle) > 0  # drained
    for path in want:
        diff = np.abs(got[path] - want[path]).max() / np.abs(want[path]).max()
        assert diff <= 1e-6, (path, diff)


def test_an_unbroken_vw_trains_beside_a_wave_program_vw_each_minibatch_once_within_d(stores, job):
    # two VWs of one job, D = 1: the unbroken one (two stages, Nm = 2) claims its waves ahead of
    # their pull points; the other (one device, Nm = 1) trains its own pace; every minibatch once,
    # staleness within the rules, the unbroken one's steady waves never drained
    parts, state = job[:2]
    address = stores.start("two").address
    piped = dict(parts, config=tj.ParallelConfig(pipe=STAGES))
    sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
    steps = {
        n: StepCache(p["train_step"], sample, devices, donate=False)
        for n, p, devices in ((2, piped, jax.devices()[:2]), (1, parts, jax.devices()[2:3]))
    }

    def make(name, devices):
        if len(devices) == STAGES:
            options = dict(minibatches=NM, steps=steps[2], **_options("unbroken"))
            return job_parts.virtual_worker(
                piped, name, devices, [address], state, distance=1, **options
            )
        return job_parts.virtual_worker(
            parts, name, devices, [address], state, distance=1, steps=steps[1]
        )

    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=4 * MINIBATCHES)
        with Coordinator(ps, Threads(make)) as coordinator:
            coordinator.add([0, 1], [2])
            coordinator.wait(timeout=300)
        assert not coordinator.runner.errors
        assert sorted(ps.history().trained()) == list(range(4 * MINIBATCHES))
        got = ps.pull()
    records = coordinator.records()
    assert {r.vw for r in records} == {"vw1", "vw2"}
    assert all(g <= 1 for r in records for g in r.global_staleness)
    piped_records = sorted((r for r in records if r.vw == "vw1"), key=lambda r: r.wave)
    staleness = [s for r in piped_records for s in r.local_staleness]
    assert staleness == [min(p, NM - 1) for p in range(len(staleness))]
    full = [r for r in piped_records if len(r.minibatches) == NM]
    assert all(r.stage_idle == (0,) * STAGES for r in full[1:-1]), [r.stage_idle for r in full]
    assert all(np.isfinite(x).all() for x in got.values())


def test_calls_repeat_from_the_steady_wave_and_drain_as_the_table_does():
    for stages, nm in ((2, 1), (2, 2), (2, 4), (3, 2), (4, 2)):
        calls = Calls.of(stages, nm)
        k = calls.steady
        assert calls.windows(k) == calls.windows(k + 5)
        table = calls.table
        # the windows cover the table's ticks wave after wave, without gaps
        assert calls.pull(k) < calls.ahead(k) <= calls.pull(k + 1)
        # the steady wave's stages idle 2 max(stages - Nm, 0) ticks, against 2 (stages - 1)
        idle = [sum(w.idle_ticks()[s] for w in calls.windows(k)) for s in range(stages)]
        assert max(idle) == 2 * max(stages - nm, 0), (stages, nm, idle)
        # versions from the table: Nm - 1 own updates missing once full
        versions = calls.versions(k + 3)
        assert [(k + 3) * nm + j - v for j, v in enumerate(versions)] == [nm - 1] * nm
        assert table.landed(0) < table.ticks


@pytest.mark.parametrize(
    "options,rule",
    [
        ({"pipeline": "unbroken"}, r"needs WorkerOptions.unbroken .*got None"),
        ({"pipeline": "gpipe"}, r"WorkerOptions.pipeline is 'wave' or 'unbroken', got 'gpipe'"),
        (
            {"unbroken": "gpt"},
            r"WorkerOptions.unbroken is a tj.wsp.UnbrokenModel or None",
        ),
    ],
)
def test_options_refuse_an_unbroken_pipeline_without_its_model(options, rule):
    with pytest.raises(WSPError, match=rule) as no:
        WorkerOptions(**options)
    assert no.value.reason == "invalid"


@pytest.mark.parametrize(
    "config,devices,extra,rule",
    [
        (tj.ParallelConfig(data=2), [0, 1], {}, r"a 'pipe' axis of 2 stages or more, got pipe=1"),
        (
            tj.ParallelConfig(pipe=2, data=2),
            [0, 1, 2, 3],
            {},
            r"no other axis above 1 .*got \{'data': 2",
        ),
        (tj.ParallelConfig(pipe=2), [0, 1], {"prefetch": True}, r"no prefetch"),
    ],
)
def test_a_vw_the_unbroken_pipeline_does_not_run_yet_is_refused(
    stores, job, config, devices, extra, rule
):
    parts, state = job[:2]
    address = stores.start("refused").address
    with pytest.raises(WSPError, match=rule) as no:
        job_parts.virtual_worker(
            dict(parts, config=config),
            "vw",
            devices,
            [address],
            state,
            minibatches=NM,
            **_options("unbroken"),
            **extra,
        )
    assert no.value.reason == "invalid" and "'vw'" in str(no.value)


def test_the_gpts_unbroken_model_maps_adamws_state_to_the_stages_and_back():
    graphdef, state, _ = build_state("tiny", LR)  # AdamW: a count beside the moments
    adapter = unbroken_model(graphdef, jax.eval_shape(lambda: state))
    (layers, outer), opt = adapter.split(state)
    assert "wq" in layers and "tok_embed" in outer and not set(layers) & set(outer)
    assert jax.tree.structure(opt) == jax.tree.structure(adapter.optimizer.init((layers, outer)))
    before = {p: np.asarray(x) for p, x in zip(*tree.arrays(state)[:2])}
    moved = adapter.merge(
        state, jax.tree.map(lambda x: x + 2, (layers, outer)), jax.tree.map(lambda x: x + 1, opt), 3
    )
    paths, leaves, _ = tree.arrays(moved)
    for path, x in zip(paths, leaves):
        step = 3 if path == "optimizer/step" else 1 if path.startswith("optimizer/") else 2
        np.testing.assert_allclose(np.asarray(x) - before[path], step, atol=1e-5, err_msg=path)
    # the state it was given is as it was (the merged nodes' Variables are new)
    for path, x in zip(*tree.arrays(state)[:2]):
        np.testing.assert_array_equal(np.asarray(x), before[path], err_msg=path)
