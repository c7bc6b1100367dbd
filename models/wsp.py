"""The reference GPT as an asynchronous job's parts, for virtual workers of any size.

``job(devices)`` gives what a ``tenplex_jax.wsp.VirtualWorker`` (or the process entry ``python -m
tenplex_jax.wsp --job tenplex_jax_models.wsp:job``) needs: rules, dataset, init, train step and the
layout of a VW of ``devices`` devices: a GPipe pipeline of two stages when the VW has 4 devices or
more (``pipe=2``, the rest data parallel), plain data parallelism below. ``virtual_worker``
builds a VW from them in one process (the tests' and benchmarks' threads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

import tenplex_jax as tj
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax.wsp import ParameterServer, VirtualWorker, WorkerOptions

from .data import corpus_samples, stdlib_corpus
from .gpt import LOGICAL_RULES, GPTConfig
from .train import build_state, train_step, unbroken_model, wave_step


def config_for(devices: int) -> tj.ParallelConfig:
    """The VW's layout: pipeline parallel over two stages from 4 devices, data parallel below."""
    if devices >= 4 and devices % 2 == 0:
        return tj.ParallelConfig(pipe=2, data=devices // 2)
    return tj.ParallelConfig(data=devices)


def job(
    devices: int,
    *,
    model: str = "tiny",
    lr: float = 3e-3,
    optimizer: str = "adamw",
    minibatch: int = 8,
    seed: int = 0,
    num_samples: int = 4096,
    layers: int | None = None,
    stages: tj.pipelining.Stages | Sequence[int] | None = None,
    config: str | None = None,
) -> dict:
    """A VW's parts for the GPT ``model`` (with ``layers`` layers instead of its own, if given)
    trained with ``optimizer`` on minibatches of ``minibatch`` sequences of the standard library's
    bytes (the same order in every VW); its step runs the pipeline over ``stages`` if given (the
    VW's ``stages=``: the planner's uneven stages, or their layer counts), laid out as ``config``
    (``ParallelConfig.parse``'s text; default :func:`config_for` the devices)."""
    if stages is not None and not isinstance(stages, tj.pipelining.Stages):
        stages = tj.pipelining.Stages(tuple(stages))
    cfg = GPTConfig.by_name(model)
    if layers is not None:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    graphdef, abstract, cfg = build_state(cfg, lr, seed, abstract=True, optimizer=optimizer)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, num_samples=num_samples)
    return {
        "rules": LOGICAL_RULES,
        "dataset": tj.DatasetPTC(source, minibatch, seed=seed),
        "init": lambda: build_state(cfg, lr, seed, optimizer=optimizer)[1],
        "train_step": train_step(graphdef, stages),
        "wave_step": None if cfg.n_experts else wave_step(graphdef, stages),
        # HetPipe's unbroken pipeline (WorkerOptions(pipeline="unbroken", unbroken=...))
        "unbroken": None if cfg.n_experts else unbroken_model(graphdef, abstract),
        "config": config_for(devices) if config is None else tj.ParallelConfig.parse(config),
        "stages": stages,
    }


def step_cache(parts: dict, devices: Sequence, *, donate: bool = False) -> StepCache:
    """``parts``' ``train_step`` compiled per layout on ``devices``, shared by the VWs of one
    process (``donate=False``: a VW's state outlives its step, :class:`tj.wsp.WorkerOptions`),
    traced on one sample of the job's dataset."""
    sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
    return StepCache(parts["train_step"], sample, devices, donate=donate)


def virtual_worker(
    parts: dict,
    name: str,
    devices: Sequence[int],
    addresses: Sequence[str],
    state,
    **options,
) -> VirtualWorker:
    """The VW ``name`` of a job's ``parts`` (:func:`job`'s) on ``jax.devices()``'s ``devices``
    (indices), starting from ``state``, with a parameter server client of its own on the stores
    at ``addresses``; ``options``: its ``tj.wsp.WorkerOptions`` (``minibatches``, ``steps``,
    ...)."""
    return VirtualWorker(
        name,
        ParameterServer(addresses),
        parts["rules"],
        parts["dataset"],
        state,
        parts["train_step"],
        devices=[jax.devices()[d] for d in devices],
        config=parts["config"],
        options=WorkerOptions(**options),
    )
