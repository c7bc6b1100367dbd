"""The reference workload: a byte-level GPT in Flax NNX, its data and its train steps.

Installed as ``tenplex_jax_models`` (the folder stays ``models/`` in the repository); the library
never imports it, only the command line's demo, the examples, tests and benchmarks do.
"""

from .data import batch_at, corpus_samples, stdlib_corpus
from .gpt import (
    GPT,
    LOGICAL_RULES,
    MOE_AXES,
    MOE_RULES,
    GPTConfig,
    example_losses,
    loss_fn,
    moe_config,
    profile,
    wave_losses,
)
from .train import (
    CPU,
    build_state,
    make_train_step,
    param_count,
    profile_of,
    train_step,
    unbroken_model,
    wave_step,
)

__all__ = [
    "CPU",
    "GPT",
    "LOGICAL_RULES",
    "MOE_AXES",
    "MOE_RULES",
    "GPTConfig",
    "batch_at",
    "build_state",
    "corpus_samples",
    "example_losses",
    "loss_fn",
    "make_train_step",
    "moe_config",
    "param_count",
    "profile",
    "profile_of",
    "stdlib_corpus",
    "train_step",
    "unbroken_model",
    "wave_losses",
    "wave_step",
]
