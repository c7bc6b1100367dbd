"""A byte-level, decoder-only GPT in Flax NNX, laid out for resharding.

Two layout choices make this model a convenient subject for resharding
experiments:

* **Stacked layers.** Every per-layer weight is one array with a leading
  ``layers`` dimension of size ``n_layers``, and the forward pass runs
  ``jax.lax.scan`` over that dimension. Pipeline parallelism then amounts to
  sharding the ``layers`` dimension over the ``pipe`` mesh axis, so changing
  the pipeline degree is an ordinary array resharding rather than a change in
  the shape of the parameter tree. Given a mesh, ``GPT.__call__`` runs the
  layers as a GPipe schedule over ``pipe`` with ``tenplex_jax.pipelining``.

* **Logical axis names.** Every parameter records, in its ``out_sharding``
  metadata, one logical name per dimension (``vocab``, ``embed``, ``mlp``,
  ``heads``, ``kv``, ``layers``; ``None`` marks a dimension that is never
  sharded). ``LOGICAL_RULES`` maps those names to the mesh axes ``data``,
  ``fsdp``, ``tensor`` and ``pipe``, so a parallel configuration is fully
  described by a mesh shape plus these rules, and the same checkpoint can be
  placed on any such configuration.

* **Mixture of experts.** With ``n_experts > 0`` (presets ``moe-tiny``,
  ``moe-small``) each layer's MLP is a mixture of experts: a router picks the
  ``top_k`` experts of every token, tokens go to their experts' buffers of
  ``capacity`` slots per sequence (GShard/Switch dispatch; a token over capacity
  skips that expert and keeps its residual), and the experts' outputs are
  combined with the renormalised router weights. The experts' weights are
  stacked on an ``expert`` logical axis (``MOE_RULES`` maps it to the ``expert``
  mesh axis: expert parallelism), and each sequence adds Switch's
  load-balancing loss. Routing is per sequence, so an example's loss never
  depends on the other examples of the batch.

The forward pass is pure: it places no sharding constraints on activations,
leaving placement to whatever sharding the parameters and inputs carry.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from tenplex_jax import ParallelConfig
from tenplex_jax.pipelining import Stages, pipeline
from tenplex_jax.planner import ModelProfile

# (logical axis, mesh axis or axes) pairs in flax's logical-rules format.
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("layers", "pipe"),
)

# The mixture-of-experts GPT's mesh: the default axes and ``expert``, whose devices hold different
# experts; tensor-parallel groups stay neighbours.
MOE_AXES = ("pipe", "data", "fsdp", "expert", "tensor")
MOE_RULES: tuple[tuple[str, Any], ...] = LOGICAL_RULES + (("expert", "expert"),)


def moe_config(**sizes: int) -> ParallelConfig:
    """A config over ``MOE_AXES``: ``moe_config(expert=4, data=2)``; other axes have size 1."""
    unknown = set(sizes) - set(MOE_AXES)
    if unknown:
        raise ValueError(f"the MoE mesh has axes {MOE_AXES}, got {sorted(unknown)}")
    return ParallelConfig.of({axis: sizes.get(axis, 1) for axis in MOE_AXES})


# GPT-3 paper sizes (Brown et al. 2020, table 2.1): (layers, d_model, heads), the models of the
# Tenplex paper's experiments.
GPT3_DIMS = {"1.3b": (24, 2048, 16), "2.7b": (32, 2560, 32), "6.7b": (32, 4096, 32)}

# The per-layer weights, stacked along a leading ``layers`` dim.
STACKED = ("ln1_scale", "wq", "wk", "wv", "wo", "ln2_scale", "w1", "b1", "w2", "b2")
STACKED_MOE = STACKED + ("router",)
_NORM_EPS = 1e-6
_INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model hyperparameters; frozen so a config can key caches and jit."""

    vocab: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    n_experts: int = 0  # 0: a dense MLP; else that many experts per layer
    top_k: int = 2  # experts per token
    capacity_factor: float = 1.25  # expert buffer slots per sequence, over an even split
    aux_weight: float = 0.01  # weight of Switch's load-balancing loss

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for name in ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must lie in 1..n_experts={self.n_experts}")

    @property
    def capacity(self) -> int:
        """Slots per expert and sequence: ``top_k * seq_len / n_experts`` times the factor."""
        return math.ceil(self.top_k * self.seq_len * self.capacity_factor / self.n_experts)

    @property
    def d_head(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @classmethod
    def tiny(cls) -> GPTConfig:
        """A minimal model for unit tests."""
        return cls(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=32)

    @classmethod
    def small(cls) -> GPTConfig:
        """The defaults: about 136K parameters, fast to train on CPU."""
        return cls()

    @classmethod
    def gpt100m(cls) -> GPTConfig:
        """A GPT-2-small-like model with about 113M parameters."""
        return cls(d_model=768, n_layers=16, n_heads=12, d_ff=3072, seq_len=1024)

    @classmethod
    def moe_tiny(cls) -> GPTConfig:
        """The tiny model with 4 experts of top-2 routing per layer."""
        return dataclasses.replace(cls.tiny(), n_experts=4)

    @classmethod
    def moe_small(cls) -> GPTConfig:
        """The small model with 4 experts of half its MLP width and top-2 routing per layer: each
        token's MLP compute is the dense model's (about 200K parameters)."""
        return dataclasses.replace(cls.small(), n_experts=4, d_ff=128)

    @classmethod
    def gpt3(cls, size: str) -> GPTConfig:
        """A GPT-3 paper model (Brown et al. 2020, table 2.1) by size, ``"1.3b"``, ``"2.7b"`` or
        ``"6.7b"``: context 2048, ``d_ff = 4 * d_model``, the vocabulary of 50257 padded to
        50304 (a multiple of 128, as Megatron-LM pads it, so tensor parallelism divides it).
        For planning and simulating: abstract, never trained here."""
        layers, d_model, heads = GPT3_DIMS[size]
        return cls(
            vocab=50304,
            seq_len=2048,
            d_model=d_model,
            n_layers=layers,
            n_heads=heads,
            d_ff=4 * d_model,
        )

    @classmethod
    def by_name(cls, name: str) -> GPTConfig:
        """Look up a preset by name, e.g. from a command-line flag."""
        presets: dict[str, Callable[[], GPTConfig]] = {
            "tiny": cls.tiny,
            "small": cls.small,
            "gpt100m": cls.gpt100m,
            "moe-tiny": cls.moe_tiny,
            "moe-small": cls.moe_small,
        } | {f"gpt3-{size}": functools.partial(cls.gpt3, size) for size in GPT3_DIMS}
        if name not in presets:
            raise ValueError(f"unknown GPT preset {name!r}; valid names: {sorted(presets)}")
        return presets[name]()


def _param(
    rngs: nnx.Rngs,
    init: Callable[..., jax.Array],
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
) -> nnx.Param:
    """Create a Param whose metadata names the logical axis of every dim."""
    if len(axes) != len(shape):
        raise ValueError(f"axes {axes} do not match shape {shape}")
    return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm over the last dim: cheaper than LayerNorm, no bias to shard."""
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + _NORM_EPS) * scale


class GPT(nnx.Module):
    """Pre-norm decoder-only transformer over bytes with stacked layers."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        L, d, H, Dh, F = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
        normal = nnx.initializers.normal(_INIT_STD)
        ones = nnx.initializers.ones
        zeros = nnx.initializers.zeros

        self.tok_embed = _param(rngs, normal, (cfg.vocab, d), ("vocab", "embed"))
        self.pos_embed = _param(rngs, normal, (cfg.seq_len, d), (None, "embed"))

        self.ln1_scale = _param(rngs, ones, (L, d), ("layers", "embed"))
        qkv_axes = ("layers", "embed", "heads", "kv")
        self.wq = _param(rngs, normal, (L, d, H, Dh), qkv_axes)
        self.wk = _param(rngs, normal, (L, d, H, Dh), qkv_axes)
        self.wv = _param(rngs, normal, (L, d, H, Dh), qkv_axes)
        self.wo = _param(rngs, normal, (L, H, Dh, d), ("layers", "heads", "kv", "embed"))

        self.ln2_scale = _param(rngs, ones, (L, d), ("layers", "embed"))
        if cfg.n_experts:  # experts stacked after the layers: (layers, expert, ...)
            E = cfg.n_experts
            self.router = _param(rngs, normal, (L, d, E), ("layers", "embed", None))
            self.w1 = _param(rngs, normal, (L, E, d, F), ("layers", "expert", "embed", "mlp"))
            self.b1 = _param(rngs, zeros, (L, E, F), ("layers", "expert", "mlp"))
            self.w2 = _param(rngs, normal, (L, E, F, d), ("layers", "expert", "mlp", "embed"))
            self.b2 = _param(rngs, zeros, (L, E, d), ("layers", "expert", "embed"))
        else:
            self.w1 = _param(rngs, normal, (L, d, F), ("layers", "embed", "mlp"))
            self.b1 = _param(rngs, zeros, (L, F), ("layers", "mlp"))
            self.w2 = _param(rngs, normal, (L, F, d), ("layers", "mlp", "embed"))
            self.b2 = _param(rngs, zeros, (L, d), ("layers", "embed"))

        self.final_norm_scale = _param(rngs, ones, (d,), ("embed",))
        self.unembed = _param(rngs, normal, (d, cfg.vocab), ("embed", "vocab"))

    def _layer_params(self) -> dict[str, jax.Array]:
        """The stacked per-layer weights, as the xs of the layer scan."""
        return {name: getattr(self, name)[...] for name in stacked(self.cfg)}

    def __call__(
        self,
        tokens: jax.Array,
        *,
        mesh: Mesh | None = None,
        microbatches: int = 1,
        stages: Stages | None = None,
    ) -> jax.Array:
        """Map int32[B, T] byte tokens to float32[B, T, vocab] logits, T <= seq_len.

        With a ``mesh`` whose ``pipe`` axis is larger than 1, the stacked layers run as a GPipe
        pipeline of ``microbatches`` over it (``tenplex_jax.pipelining``); the embedding and the
        head
        run outside the pipeline. ``stages`` gives uneven layers per stage; the stacked weights are
        then padded (``Stages.pad``). Without a mesh the layers run as one scan.
        """
        return self.forward(tokens, mesh=mesh, microbatches=microbatches, stages=stages)[0]

    def forward(
        self,
        tokens: jax.Array,
        *,
        mesh: Mesh | None = None,
        microbatches: int = 1,
        stages: Stages | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """(logits, float32[B] load-balancing loss per sequence summed over the layers, or None
        for the dense model); arguments as for ``__call__``."""
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
        T = tokens.shape[1]
        if not 1 <= T <= self.cfg.seq_len:
            raise ValueError(f"sequence length {T} not in [1, {self.cfg.seq_len}]")

        x = jnp.take(self.tok_embed[...], tokens, axis=0)
        x = x + self.pos_embed[...][:T]
        block = block_fn(self.cfg)
        params = self._layer_params()
        aux = None
        if self.cfg.n_experts:  # the activations carry each sequence's load-balancing loss
            x = (x, jnp.zeros(x.shape[:1], jnp.float32))
        if mesh is not None or stages is not None:
            mesh = mesh if mesh is not None else ParallelConfig().abstract_mesh()
            x = pipeline(block, params, x, mesh=mesh, microbatches=microbatches, stages=stages)
        else:
            x, _ = jax.lax.scan(lambda h, p: (block(h, p), None), x, params)
        if self.cfg.n_experts:
            x, aux = x
        x = _rms_norm(x, self.final_norm_scale[...])
        return jnp.einsum("btd,dv->btv", x, self.unembed[...]), aux


def stacked(cfg: GPTConfig) -> tuple[str, ...]:
    """The names of the stacked per-layer weights of a model with ``cfg``."""
    return STACKED_MOE if cfg.n_experts else STACKED


def block_fn(cfg: GPTConfig) -> Callable:
    """One layer as ``(activations, layer params) -> activations``: the dense block, or for a
    mixture of experts ``((h, aux), p) -> (h, aux + this layer's load-balancing loss)``."""
    # a Python float, not a traced value: the pipeline's shard_map must not close over tracers
    scale = 1.0 / math.sqrt(cfg.d_head)
    if cfg.n_experts:
        return functools.partial(_moe_block, scale=scale, top_k=cfg.top_k, capacity=cfg.capacity)
    return functools.partial(_block, scale=scale)


def _block(h: jax.Array, p: dict[str, jax.Array], scale: jax.Array) -> jax.Array:
    """One pre-norm transformer layer: causal self-attention, then the MLP."""
    h = _attention(h, p, scale)
    m = _rms_norm(h, p["ln2_scale"])
    m = jax.nn.gelu(jnp.einsum("btd,df->btf", m, p["w1"]) + p["b1"])
    return h + jnp.einsum("btf,fd->btd", m, p["w2"]) + p["b2"]


def _moe_block(hx, p: dict[str, jax.Array], scale: float, top_k: int, capacity: int):
    """One pre-norm layer whose MLP is a mixture of experts; ``hx = (h, aux)``."""
    h, aux = hx
    h = _attention(h, p, scale)
    out, balance = _experts(_rms_norm(h, p["ln2_scale"]), p, top_k, capacity)
    return h + out, aux + balance


def _experts(x: jax.Array, p: dict[str, jax.Array], top_k: int, capacity: int):
    """Top-k routing over ``p["router"]`` and the experts' MLPs: (float32[b, t, d] output,
    float32[b] Switch load-balancing loss of each sequence).

    Every sequence routes on its own: its tokens' k choices fill each expert's ``capacity``
    slots first choices first, then in token order; a choice over capacity is dropped (its
    gate's share of the token is then zero, and the residual carries it).
    """
    b, t, _ = x.shape
    n = p["router"].shape[-1]
    probs = jax.nn.softmax(jnp.einsum("btd,de->bte", x, p["router"]), axis=-1)
    gates, chosen = jax.lax.top_k(probs, top_k)  # [b, t, k]
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    picks = jax.nn.one_hot(chosen, n, dtype=x.dtype)  # [b, t, k, e]
    # a choice's slot in its expert's buffer: the choices before it, first choices first
    order = jnp.swapaxes(picks, 1, 2).reshape(b, top_k * t, n)
    slot = jnp.swapaxes((jnp.cumsum(order, axis=1) - order).reshape(b, top_k, t, n), 1, 2)
    kept = picks * (slot < capacity)
    slots = jax.nn.one_hot(jnp.sum(slot * picks, axis=-1).astype(jnp.int32), capacity)
    dispatch = jnp.einsum("btke,btkc->btec", kept, slots)  # [b, t, e, c]: 0/1
    combine = jnp.einsum("btk,btke,btkc->btec", gates, kept, slots)
    tokens = jnp.einsum("btec,btd->becd", dispatch, x)  # each expert's buffer
    hidden = jax.nn.gelu(jnp.einsum("becd,edf->becf", tokens, p["w1"]) + p["b1"][:, None])
    y = jnp.einsum("becf,efd->becd", hidden, p["w2"]) + p["b2"][:, None]
    out = jnp.einsum("btec,becd->btd", combine, y)
    # Switch: n * sum_e (share of choices routed to e) * (mean router probability of e)
    share = jnp.sum(picks, axis=(1, 2)) / (t * top_k)
    balance = n * jnp.sum(share * jnp.mean(probs, axis=1), axis=-1)
    return out, balance


def _attention(h: jax.Array, p: dict[str, jax.Array], scale: float) -> jax.Array:
    """The causal self-attention half of a layer, with its residual."""
    T = h.shape[1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    a = _rms_norm(h, p["ln1_scale"])
    q = jnp.einsum("btd,dhk->bthk", a, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", a, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", a, p["wv"])
    scores = jnp.einsum("bthk,bshk->bhts", q, k) * scale
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bhts,bshk->bthk", probs, v)
    return h + jnp.einsum("bthk,hkd->btd", attn, p["wo"])


def loss_fn(model: GPT, batch: dict[str, jax.Array], **pipelining) -> jax.Array:
    """Mean next-byte cross entropy of ``batch["targets"]`` given ``batch["inputs"]``.

    ``pipelining`` (``mesh``, ``microbatches``, ``stages``) is passed on to ``GPT.__call__``.
    """
    return jnp.mean(example_losses(model, batch, **pipelining))


def example_losses(model: GPT, batch: dict[str, jax.Array], **pipelining) -> jax.Array:
    """float32[batch]: each example's mean next-byte cross entropy over its positions (plus, for
    a mixture of experts, its load-balancing loss averaged over the layers, weighted)."""
    logits, aux = model.forward(batch["inputs"], **pipelining)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    losses = jnp.mean(losses, axis=-1)
    if aux is None:
        return losses
    return losses + model.cfg.aux_weight / model.cfg.n_layers * aux


def embedded(weights: dict, tokens: jax.Array) -> jax.Array:
    """``tokens`` (``[..., T]``) embedded by the weights ``tok_embed`` and ``pos_embed`` (by
    name), as the model's first layer does, for the stages of a pipeline outside the module."""
    return jnp.take(weights["tok_embed"], tokens, axis=0) + weights["pos_embed"][: tokens.shape[-1]]


def head_logits(weights: dict, h: jax.Array) -> jax.Array:
    """The logits of activations ``h`` (``[b, T, d]``): the final norm (``final_norm_scale``),
    then ``unembed``, as the model's last layer does."""
    return jnp.einsum("btd,dv->btv", _rms_norm(h, weights["final_norm_scale"]), weights["unembed"])


def wave_losses(
    cfg: GPTConfig,
    versions: dict[str, jax.Array],
    batch: dict[str, jax.Array],
    *,
    mesh: Mesh,
    stages: Stages | None = None,
) -> jax.Array:
    """float32[Nm, rows]: each example's loss in HetPipe's pipelined wave of ``Nm`` minibatches,
    minibatch ``j`` on its own weights ``versions[name][j]`` on every stage.

    ``versions`` maps each weight's name (``tok_embed``, ``wq``, ...) to its ``Nm`` versions
    stacked; ``batch`` holds ``inputs`` and ``targets`` of ``[Nm, rows, T]``. The embedding and
    the head run per minibatch; the stacked layers run as one pipeline over the mesh's ``pipe``
    axis with the minibatches in flight (``pipeline(..., versions=True)``, uneven ``stages``
    padded). The dense model only: a mixture of experts' load-balancing loss is not carried.
    """
    if cfg.n_experts:
        raise ValueError("wave_losses runs the dense GPT; this config has experts")
    tokens, n = batch["inputs"], batch["inputs"].shape[0]
    x = jax.vmap(embedded)(versions, tokens)
    layers = {name: versions[name] for name in stacked(cfg)}
    x = pipeline(block_fn(cfg), layers, x, mesh=mesh, microbatches=n, stages=stages, versions=True)

    def head(v, h, targets):
        logits = head_logits(v, h)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets), -1)

    return jax.vmap(head)(versions, x, batch["targets"])


def profile(cfg: GPTConfig, name: str = "gpt") -> ModelProfile:
    """The GPT as the planner sees it: one block's costs, the embedding and head, divisibility.

    Everything comes from abstract values (``nnx.eval_shape``, XLA cost analysis): no weights are
    allocated, so profiling ``gpt100m`` takes a fraction of a second.
    """
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    one_layer = {
        k: jax.ShapeDtypeStruct(getattr(model, k).shape[1:], getattr(model, k).dtype)
        for k in stacked(cfg)
    }
    block = functools.partial(_block, scale=1.0 / jnp.sqrt(jnp.float32(cfg.d_head)))
    if cfg.n_experts:  # the layer's cost, its load-balancing loss carried along
        moe = block_fn(cfg)
        block = lambda h, p: moe((h, jnp.zeros(h.shape[:1], jnp.float32)), p)[0]
    hidden = lambda b: jax.ShapeDtypeStruct((b, cfg.seq_len, cfg.d_model), jnp.float32)
    names = ("tok_embed", "pos_embed", "final_norm_scale", "unembed")
    outer = {k: abstract(getattr(model, k)) for k in names}
    tokens = lambda b: jax.ShapeDtypeStruct((b, cfg.seq_len), jnp.int32)

    def outside(p, tokens):  # embedding, head and loss around an identity stack of layers
        x = jnp.take(p["tok_embed"], tokens, axis=0) + p["pos_embed"]
        logits = jnp.einsum("btd,dv->btv", _rms_norm(x, p["final_norm_scale"]), p["unembed"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens))

    return ModelProfile.measure(
        name,
        (block, one_layer, hidden),
        (outside, outer, tokens),
        cfg.n_layers,
        divides=(
            ("tensor", "heads", cfg.n_heads),
            ("tensor", "d_ff", cfg.d_ff),
            ("tensor", "vocab", cfg.vocab),
            ("fsdp", "d_model", cfg.d_model),
        ),
    )
