"""Models and data used to exercise resharding of training state."""

from models.data import batch_at, stdlib_corpus
from models.gpt import GPT, LOGICAL_RULES, GPTConfig, loss_fn

__all__ = ["GPT", "GPTConfig", "LOGICAL_RULES", "loss_fn", "stdlib_corpus", "batch_at"]
