"""Per-rank memory of model states under ZeRO (Rajbhandari et al., arXiv 1910.02054).

Model states are parameters, gradients and optimizer states. With ``Ψ``
parameters, ``N`` data-parallel ranks and ``K`` bytes of optimizer state per
parameter, the paper's per-rank totals for mixed-precision training are::

    stage 0: (2 + 2 + K) Ψ          stage 2: 2Ψ + (2 + K) Ψ / N
    stage 1: 2Ψ + 2Ψ + K Ψ / N      stage 3: (2 + 2 + K) Ψ / N

Here the 2s are the parameter and gradient bytes of the training dtype and
``K = master + optimizer`` (12 for mixed-precision Adam: a 4-byte fp32 master
copy plus 8 bytes of Adam moments). Activations, buffers and fragmentation are
not counted. Partitioned states count ``ceil(Ψ / N)`` elements, the most any
rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .errors import ConfigError
from .zero import PartitionPlan

__all__ = ["DtypePolicy", "ModelStateMemory", "model_state_bytes", "plan_state_bytes",
           "OPTIMIZER_STATE_BYTES", "PRECISIONS"]

#: Bytes of optimizer state per parameter, kept in fp32, besides any master copy.
OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8}

#: Training dtypes: (parameter bytes, gradient bytes, fp32 master-copy bytes).
PRECISIONS = {"fp32": (4, 4, 0), "bf16": (2, 2, 4), "fp16": (2, 2, 4)}


def _check_stage(stage: int) -> int:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero stage must be 0, 1, 2 or 3, got {stage!r}")
    return int(stage)


@dataclass(frozen=True)
class DtypePolicy:
    """Bytes per parameter of each kind of model state."""

    param_bytes: int  # one copy of the weights in the training dtype
    grad_bytes: int  # one gradient in the training dtype
    master_bytes: int  # fp32 master weights of mixed precision (0 for fp32 training)
    optimizer_bytes: int  # optimizer moments, fp32

    def __post_init__(self) -> None:
        for name in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")

    @property
    def k(self) -> int:
        """The paper's K: optimizer-state bytes per parameter, master copy included."""
        return self.master_bytes + self.optimizer_bytes

    @classmethod
    def of(cls, precision: str = "bf16", optimizer: str = "adam") -> "DtypePolicy":
        """Policy for a named precision (fp32, bf16, fp16) and optimizer (sgd, momentum, adam, adamw)."""
        key_p, key_o = str(precision).lower(), str(optimizer).lower()
        if key_p not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if key_o not in OPTIMIZER_STATE_BYTES:
            raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, "
                              f"got {optimizer!r}")
        param, grad, master = PRECISIONS[key_p]
        return cls(param_bytes=param, grad_bytes=grad, master_bytes=master,
                   optimizer_bytes=OPTIMIZER_STATE_BYTES[key_o])


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes of model states held by one rank."""

    params: int  # training-dtype parameters
    grads: int  # training-dtype gradients
    optimizer_states: int  # master copy plus optimizer moments
    total: int = field(init=False)  # the sum of the three

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.params + self.grads + self.optimizer_states)

    def gb(self) -> float:
        """``total`` in GB (1e9 bytes), the unit of the ZeRO paper."""
        return self.total / 1e9


def _states(full: int, part: int, stage: int, policy: DtypePolicy) -> ModelStateMemory:
    """Per-rank bytes when a replicated state has ``full`` elements and a partitioned one ``part``."""
    stage = _check_stage(stage)
    return ModelStateMemory(
        params=(part if stage >= 3 else full) * policy.param_bytes,
        grads=(part if stage >= 2 else full) * policy.grad_bytes,
        optimizer_states=(part if stage >= 1 else full) * policy.k,
    )


def model_state_bytes(num_params: int, world_size: int, stage: int, optimizer: str = "adam",
                      precision: str = "bf16", *,
                      policy: Optional[DtypePolicy] = None) -> ModelStateMemory:
    """The paper's per-rank model-state memory; ``policy`` overrides ``optimizer``/``precision``."""
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ConfigError(f"num_params must be a non-negative integer, got {num_params!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    policy = policy if policy is not None else DtypePolicy.of(precision, optimizer)
    return _states(num_params, -(-num_params // world_size), stage, policy)


def plan_state_bytes(plan: PartitionPlan, stage: int, optimizer: str = "adam",
                     precision: str = "bf16", *,
                     policy: Optional[DtypePolicy] = None) -> ModelStateMemory:
    """Exact per-rank bytes for a :class:`~shardwise.core.zero.PartitionPlan`, padding included.

    Replicated states are the padded flat buffer (``plan.padded_numel`` elements);
    partitioned states are one shard (``plan.shard_numel`` elements).
    """
    policy = policy if policy is not None else DtypePolicy.of(precision, optimizer)
    return _states(plan.padded_numel, plan.shard_numel, stage, policy)
