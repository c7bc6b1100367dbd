"""Models and data used to exercise resharding of training state."""

from models.data import batch_at, stdlib_corpus
from models.gpt import GPT, LOGICAL_RULES, GPTConfig, loss_fn, profile

__all__ = ["GPT", "LOGICAL_RULES", "GPTConfig", "batch_at", "loss_fn", "profile", "stdlib_corpus"]
