"""Bitwise across processes: the launched example job with ``--bitwise`` on 2 processes x 2
devices as ``tensor=4`` (each unit's gradient computed whole, the state stored over both
processes) loses a process and its store (SIGKILL) and goes on as ``pipe=2`` on the one left;
it ends with every bit of the same job on one device in this process. The survivor holds half
of each tensor-parallel leaf, so its memory cannot serve: the launcher says which leaves forced
the rewind, and with ``--replicas 0`` the commit's copies of the dead process's shards went with
its store, so the job restores the orbax checkpoint of the same step. The launcher's children
inherit the suite's XLA flags."""

from __future__ import annotations

import json

import jax
import numpy as np

import tenplex_jax as tj
from tenplex_jax.multihost import RunDir
from tenplex_jax_models import LOGICAL_RULES, build_state, corpus_samples, stdlib_corpus, train_step
from tests.helpers import LAUNCH_BATCH, LAUNCH_GRAD_UNITS, LAUNCH_SAMPLES, host_copy, reaped
from tests.multihost.launching import (
    TIMEOUT,
    alive,
    kill,
    last,
    launch_example,
    paused,
    wait_for,
)

STEPS = 6


def one_device(steps: int) -> list[np.ndarray]:
    graphdef, _, cfg = build_state("tiny", 3e-3, 0, abstract=True)
    dataset = tj.DatasetPTC(
        corpus_samples(stdlib_corpus(2**20), cfg.seq_len, LAUNCH_SAMPLES), LAUNCH_BATCH
    )
    options = tj.elastic.JobOptions(bitwise=True, compile_ahead=False)
    with tj.ElasticJob(
        LOGICAL_RULES,
        dataset,
        devices=jax.devices()[:1],
        grad_units=LAUNCH_GRAD_UNITS,
        options=options,
    ) as job:
        state = job.start(lambda: build_state("tiny", 3e-3, 0)[1])
        step = job.jit(train_step(graphdef))
        while job.step < steps:
            state, batch = job.next(state)
            state, _ = step(state, batch)
        assert job.bitwise
    return host_copy(state)


def test_a_launched_tensor_to_pipe_change_keeps_every_bit_of_one_device(tmp_path):
    layouts = "4=tensor=4; 2=pipe=2"
    script = ["--bitwise", "--layouts", layouts, "--pause-after", "2"]
    script += ["--log", str(tmp_path / "steps.jsonl")]
    flags = ["--replicas", "0", "--checkpoint-dir", str(tmp_path / "ckpt")]
    flags += ["--checkpoint-every", "2"]
    proc = launch_example(tmp_path, 2, STEPS, flags=flags, script=script)
    with reaped(proc):
        want = one_device(STEPS)  # while the job starts
        wait_for(lambda: paused(tmp_path, 2, 2), "the job to pause after step 2", proc)
        workers = last(tmp_path, "generation")["pids"]
        kill(last(tmp_path, "stores")["slots"]["1"]["pid"])
        kill(workers[1])  # the generation's commit and checkpoint of step 2 have finished
        children = [*workers, *last(tmp_path, "standby")["pids"].values()]
        proc.wait(TIMEOUT)
        children += last(tmp_path, "generation")["pids"]
    assert not alive(children)
    assert proc.returncode == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [s["config"] for s in steps] == ["tensor=4"] * 2 + ["pipe=2"] * (STEPS - 2)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # no step lost or repeated
    rewind = last(tmp_path, "rewind")
    assert (rewind["step"], rewind["source"], rewind["newest"]) == (2, "checkpoint", 2), rewind
    assert any(p.startswith("model/") for p in rewind["leaves"])
    assert "no survivor holds every box" in rewind["detail"]
    assert last(tmp_path, "replicas_lost")["step"] == 2  # the commit's shards of process 1
    gens = [
        (g["restore"], g["step"], g["lost_steps"]) for g in RunDir(tmp_path).events("generation")
    ]
    assert gens == [("init", 0, None), ("checkpoint", 2, 0)]
    got = np.load(tmp_path / "final.npz")
    got = [got[f"arr_{i}"] for i in range(len(got.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
