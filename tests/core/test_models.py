"""Tests for the GPT model and the stdlib corpus.

The model is the subject of every resharding test, so these tests pin down the
properties resharding relies on: every parameter carries a logical name per
dimension, stacked layers lead with the ``layers`` dimension, and the data
pipeline is a pure function of its arguments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tenplex_jax_models import GPT, LOGICAL_RULES, GPTConfig, batch_at, loss_fn, stdlib_corpus

STACKED = ("ln1_scale", "wq", "wk", "wv", "wo", "ln2_scale", "w1", "b1", "w2", "b2")


def _build(cfg: GPTConfig, seed: int = 0) -> GPT:
    with nnx.use_eager_sharding(False):
        return GPT(cfg, rngs=nnx.Rngs(seed))


def _params(model: GPT) -> dict[str, nnx.Variable]:
    return {
        "/".join(map(str, path)): var
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.fixture(scope="module")
def tiny() -> GPT:
    return _build(GPTConfig.tiny())


def test_every_param_has_one_logical_name_per_dim(tiny: GPT) -> None:
    known = {logical for logical, _ in LOGICAL_RULES}
    params = _params(tiny)
    assert params
    for name, var in params.items():
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None, name
        assert len(axes) == len(var.shape), (name, axes, var.shape)
        for axis in axes:
            assert axis is None or axis in known, (name, axis)
    # Every named dim is covered; at most the positional table's seq dim is None.
    nones = {name for name, var in params.items() if None in var.get_metadata()["out_sharding"]}
    assert nones == {"pos_embed"}


def test_rules_use_known_mesh_axes() -> None:
    mesh_axes = {"data", "fsdp", "tensor", "pipe"}
    for _, target in LOGICAL_RULES:
        targets = target if isinstance(target, tuple) else (target,)
        assert all(t is None or t in mesh_axes for t in targets)


def test_stacked_params_lead_with_layers(tiny: GPT) -> None:
    cfg = tiny.cfg
    params = _params(tiny)
    for name, var in params.items():
        axes = var.get_metadata()["out_sharding"]
        if name in STACKED:
            assert axes[0] == "layers", name
            assert var.shape[0] == cfg.n_layers, name
        else:
            assert "layers" not in axes, name


@pytest.mark.parametrize("length", [1, 7, GPTConfig.tiny().seq_len])
def test_forward_shapes(tiny: GPT, length: int) -> None:
    tokens = jnp.zeros((3, length), jnp.int32)
    logits = tiny(tokens)
    assert logits.shape == (3, length, tiny.cfg.vocab)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causality(tiny: GPT) -> None:
    T, t = tiny.cfg.seq_len, 11
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, 256, jnp.int32)
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 256)
    before, after = tiny(tokens), tiny(changed)
    np.testing.assert_allclose(before[:, :t], after[:, :t], rtol=1e-6, atol=1e-6)
    assert not np.allclose(before[:, t:], after[:, t:])


def test_training_reduces_loss() -> None:
    cfg = GPTConfig.tiny()
    model = _build(cfg)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    corpus = stdlib_corpus(2**16)
    batch = {k: jnp.asarray(v) for k, v in batch_at(corpus, 0, 8, cfg.seq_len).items()}

    @nnx.jit
    def step(model: GPT, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    initial = float(loss_fn(model, batch))
    assert math.isclose(initial, math.log(256), rel_tol=0.05)
    for _ in range(10):
        step(model, optimizer, batch)
    assert float(loss_fn(model, batch)) < 0.8 * initial


def test_param_counts() -> None:
    def count(cfg: GPTConfig) -> int:
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
        return sum(math.prod(v.shape) for v in _params(abstract).values())

    assert count(GPTConfig.gpt100m()) >= 100e6
    assert 100e3 <= count(GPTConfig.small()) <= 200e3
    assert count(GPTConfig.tiny()) < count(GPTConfig.small())


def test_config_presets() -> None:
    assert GPTConfig.by_name("small") == GPTConfig()
    assert GPTConfig.by_name("tiny") == GPTConfig.tiny()
    assert GPTConfig.gpt100m().d_head == 64
    with pytest.raises(ValueError, match="tiny"):
        GPTConfig.by_name("huge")
    with pytest.raises(ValueError):
        GPTConfig(d_model=30, n_heads=4)


def test_stdlib_corpus() -> None:
    corpus = stdlib_corpus(2**16)
    assert corpus.dtype == np.uint8
    assert corpus.shape == (2**16,)
    assert not corpus.flags.writeable
    stdlib_corpus.cache_clear()
    again = stdlib_corpus(2**16)
    assert again is not corpus
    np.testing.assert_array_equal(corpus, again)
    # A shorter corpus is a prefix of a longer one.
    np.testing.assert_array_equal(stdlib_corpus(2**10), corpus[: 2**10])


def test_batch_at() -> None:
    corpus = stdlib_corpus(2**16)
    a = batch_at(corpus, 5, 4, 16)
    b = batch_at(corpus, 5, 4, 16)
    c = batch_at(corpus, 6, 4, 16)
    assert a["inputs"].shape == a["targets"].shape == (4, 16)
    assert a["inputs"].dtype == a["targets"].dtype == np.int32
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["inputs"], c["inputs"])
    assert not np.array_equal(a["inputs"], batch_at(corpus, 5, 4, 16, seed=1)["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
    # Each window is a contiguous slice of the corpus.
    windows = np.lib.stride_tricks.sliding_window_view(corpus, 17).astype(np.int32)
    row = np.concatenate([a["inputs"][0], a["targets"][0, -1:]])
    assert (windows == row).all(axis=1).any()


def test_bad_inputs(tiny: GPT) -> None:
    corpus = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="seq_len"):
        batch_at(corpus, 0, 2, 10)
    batch_at(corpus, 0, 2, 9)  # exactly seq_len + 1 bytes is enough
    with pytest.raises(ValueError, match="global_batch"):
        batch_at(corpus, 0, 0, 4)
    with pytest.raises(ValueError):
        batch_at(corpus, -1, 2, 4)
    with pytest.raises(ValueError):
        stdlib_corpus(0)
    with pytest.raises(ValueError, match="sequence length"):
        tiny(jnp.zeros((1, tiny.cfg.seq_len + 1), jnp.int32))
    with pytest.raises(ValueError):
        tiny(jnp.zeros((4,), jnp.int32))


# -- the mixture-of-experts variant -----------------------------------------------------------


def _reference_experts(x, p, top_k, capacity):
    """A loop over sequences, tokens and choices: what ``_experts`` computes with einsums."""
    b, t, _ = x.shape
    n = p["router"].shape[-1]
    out, balance = np.zeros_like(x), np.zeros(b, np.float32)
    gelu = lambda v: np.asarray(jax.nn.gelu(jnp.asarray(v)))
    for s in range(b):
        logits = x[s] @ p["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        filled = np.zeros(n, int)
        for choice in range(top_k):  # first choices fill the buffers first, then token order
            for token in range(t):
                e = chosen[token, choice]
                if filled[e] < capacity:
                    gate = probs[token, e] / probs[token, chosen[token]].sum()
                    h = gelu(x[s, token] @ p["w1"][e] + p["b1"][e])
                    out[s, token] += gate * (h @ p["w2"][e] + p["b2"][e])
                filled[e] += 1
        share = np.bincount(chosen.ravel(), minlength=n) / (t * top_k)
        balance[s] = n * np.sum(share * probs.mean(0))
    return out, balance


def test_experts_route_each_token_to_its_top_k_within_capacity() -> None:
    from tenplex_jax_models.gpt import _experts

    rng = np.random.default_rng(0)
    d, f, n, t = 8, 16, 4, 12
    p = {
        "router": rng.normal(size=(d, n)).astype(np.float32),
        "w1": rng.normal(size=(n, d, f)).astype(np.float32) * 0.3,
        "b1": rng.normal(size=(n, f)).astype(np.float32) * 0.1,
        "w2": rng.normal(size=(n, f, d)).astype(np.float32) * 0.3,
        "b2": rng.normal(size=(n, d)).astype(np.float32) * 0.1,
    }
    x = rng.normal(size=(3, t, d)).astype(np.float32)
    for top_k, capacity in ((2, 4), (1, 2), (2, 12)):  # tight buffers drop choices; 12 none
        got, balance = jax.jit(_experts, static_argnums=(2, 3))(x, p, top_k, capacity)
        want, want_balance = _reference_experts(x, p, top_k, capacity)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(balance), want_balance, rtol=1e-5)


def test_moe_params_stack_experts_after_layers() -> None:
    cfg = GPTConfig.moe_tiny()
    model = _build(cfg)
    params = _params(model)
    for name in ("w1", "b1", "w2", "b2"):
        axes = params[name].get_metadata()["out_sharding"]
        assert axes[:2] == ("layers", "expert") and params[name].shape[:2] == (2, 4), name
    assert params["router"].shape == (cfg.n_layers, cfg.d_model, cfg.n_experts)
    assert GPTConfig.by_name("moe-small").capacity == math.ceil(2 * 64 * 1.25 / 4)


def test_moe_loss_adds_the_load_balancing_loss_and_trains() -> None:
    from tenplex_jax_models import example_losses

    cfg = GPTConfig.moe_tiny()
    model = _build(cfg)
    batch = {k: jnp.asarray(v) for k, v in batch_at(stdlib_corpus(2**16), 0, 4, 32).items()}
    logits, aux = model.forward(batch["inputs"])
    cross = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean(-1)
    assert aux.shape == (4,) and bool(jnp.all(aux > 0))
    np.testing.assert_allclose(
        example_losses(model, batch), cross + cfg.aux_weight / cfg.n_layers * aux, rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"top_k=5 must lie in 1\.\.n_experts=4"):
        GPTConfig(n_experts=4, top_k=5)
