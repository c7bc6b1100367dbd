"""Models and data used to exercise resharding of training state."""

from models.data import batch_at, corpus_samples, stdlib_corpus
from models.gpt import GPT, LOGICAL_RULES, GPTConfig, example_losses, loss_fn, profile

__all__ = [
    "GPT",
    "LOGICAL_RULES",
    "GPTConfig",
    "batch_at",
    "corpus_samples",
    "example_losses",
    "loss_fn",
    "profile",
    "stdlib_corpus",
]
