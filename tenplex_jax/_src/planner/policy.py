"""The one policy that picks a job's parallel config for a device count.

Every part of tenplex_jax that must lay a state out on ``n`` devices without being told how (an
``ElasticJob`` after a preemption, each generation of a launched job, the demo) asks
:func:`choose_config`, so the same device count always gives the same layout.
"""

from __future__ import annotations

from tenplex_jax._src.data import BatchLayout
from tenplex_jax._src.errors import DataError, LayoutError, PlanError
from tenplex_jax._src.planner.cluster import Cluster, DeviceType
from tenplex_jax._src.planner.profile import ModelProfile
from tenplex_jax._src.planner.search import choose
from tenplex_jax._src.ptc import PTC, ParallelConfig, Rules


def choose_config(
    n: int,
    abstract_state,
    rules: Rules,
    global_batch: int,
    grad_units: int | None = None,
    *,
    profile: ModelProfile | None = None,
    device_type: DeviceType | None = None,
) -> ParallelConfig:
    """The ``(data, fsdp)`` config of ``n`` devices for a state and global batch.

    Candidates lay the state out without replicating an indivisible dim, and give every
    data-parallel rank (``data * fsdp``) at least one unit of the batch (one of ``grad_units``
    gradient units, or one sample each). With a ``profile`` and a ``device_type``, the planner
    (:func:`tenplex_jax.planner.choose`) picks the fastest under its cost model and the devices'
    memory; without them, the least FSDP, which communicates least (pure data parallelism when the
    state divides). Tensor and pipeline degrees stay 1: gradient units keep the params bitwise
    equal across data-parallel and FSDP sizes only.

    >>> from flax import linen as nn
    >>> w = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 4), jnp.float32), ("embed", "mlp"))
    >>> choose_config(6, {"w": w}, [("embed", "fsdp")], global_batch=24, grad_units=8)
    ParallelConfig(data=6, fsdp=1, tensor=1, pipe=1)

    Args:
      n: the device count.
      abstract_state: the train state, abstract or live (what ``PTC.of`` takes).
      rules: its logical-axis rules.
      global_batch: samples per step.
      grad_units: gradient units of the batch layout (``None``: one sample per unit).
      profile: the model's :class:`ModelProfile`; with ``device_type``, the planner chooses.
      device_type: the devices' :class:`DeviceType`.

    Returns:
      ``ParallelConfig(data=n // fsdp, fsdp=fsdp)``.

    Raises:
      LayoutError: no ``(data, fsdp)`` config lays the state and the batch out on ``n``
        devices, or the planner finds none that fits; the message names each config's refusal.
    """
    valid, refused = _configs(n, abstract_state, rules, global_batch, grad_units)
    if profile is None or device_type is None:
        return valid[0]
    try:
        cluster = Cluster.uniform(n, device_type, per_node=n)
        return choose(cluster, profile, global_batch, configs=valid).best.config
    except PlanError as error:
        raise LayoutError(
            f"the planner finds no (data, fsdp) config for {n} devices of {device_type.name} with "
            f"global batch {global_batch}: {error}; refused by the layout: " + "; ".join(refused)
        ) from None


def _configs(n: int, abstract_state, rules, global_batch: int, grad_units):
    """(the ``(data, fsdp)`` configs of ``n`` devices that lay the state and the batch out,
    least FSDP first; the others' refusals); ``LayoutError`` naming each refusal when none does."""
    valid, refused = [], []
    for fsdp in (d for d in range(1, n + 1) if n % d == 0):
        config = ParallelConfig(data=n // fsdp, fsdp=fsdp)
        try:
            PTC.of(abstract_state, rules, config, range(n))
            BatchLayout(global_batch, ranks=n, grad_units=grad_units)
        except (LayoutError, DataError) as error:
            refused.append(f"{config}: {str(error).split(';')[0]}")  # the rule, not the advice
            continue
        valid.append(config)
    if not valid:
        raise LayoutError(
            f"no (data, fsdp) config lays the state out on {n} devices with global batch "
            f"{global_batch}: " + "; ".join(refused)
        )
    return valid, refused
