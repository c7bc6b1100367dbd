"""The reference GPT as an asynchronous job's parts, for virtual workers of any size.

``job(devices)`` gives what a ``tenplex_jax.wsp.VirtualWorker`` (or the process entry ``python -m
tenplex_jax.wsp --job tenplex_jax_models.wsp:job``) needs: rules, dataset, init, train step and the
layout of a VW of ``devices`` devices: a GPipe pipeline of two stages when the VW has 4 devices or
more (``pipe=2``, the rest data parallel), plain data parallelism below.
"""

from __future__ import annotations

import tenplex_jax as tj

from .data import corpus_samples, stdlib_corpus
from .gpt import LOGICAL_RULES
from .train import build_state, train_step


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
) -> dict:
    """A VW's parts for the GPT ``model`` trained with ``optimizer`` on minibatches of
    ``minibatch`` sequences of the standard library's bytes (the same order in every VW)."""
    graphdef, _, cfg = build_state(model, lr, seed, abstract=True, optimizer=optimizer)
    source = corpus_samples(stdlib_corpus(), cfg.seq_len, num_samples=num_samples)
    return {
        "rules": LOGICAL_RULES,
        "dataset": tj.DatasetPTC(source, minibatch, seed=seed),
        "init": lambda: build_state(model, lr, seed, optimizer=optimizer)[1],
        "train_step": train_step(graphdef),
        "config": config_for(devices),
    }
