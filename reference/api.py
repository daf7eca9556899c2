"""Public configuration types of the flat-parameter FSDP (FSDP1), named as in torch.distributed.fsdp

Everything here is plain data: enums that name a strategy or a state-dict layout, and dataclasses
that carry user choices into ``FullyShardedDataParallel``.
No behaviour lives in this file; the rules each value selects are stated in its docstring and
implemented next to the code that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]


class ShardingStrategy(Enum):
    """How one wrapped module's flat parameter is spread over the ranks of its process group.

    * ``FULL_SHARD``: each rank keeps ``1/world_size`` of the flat parameter; it is all-gathered
      before forward and again before backward, and gradients are reduce-scattered.
    * ``SHARD_GRAD_OP``: as ``FULL_SHARD`` but the gathered parameter is kept from forward to
      backward (no second all-gather).
    * ``NO_SHARD``: every rank keeps the whole flat parameter; gradients are all-reduced. A process
      group of size 1 always runs as ``NO_SHARD`` (with a warning when another value was asked for).
    * ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``: shard inside a node, replicate across nodes. Named
      for API parity; the reference raises ``NotImplementedError`` for them.
    """

    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


class BackwardPrefetch(Enum):
    """When to issue the next all-gather in backward. Only an overlap hint: the reference stores it
    and computes the same values either way."""

    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Dtypes used while computing; the sharded flat parameter always keeps its original dtype.

    Attributes:
        param_dtype: dtype of the all-gathered (unsharded) parameters used in forward/backward.
        reduce_dtype: dtype of the gradient reduction; when ``None`` and ``param_dtype`` is set, the
            reduction runs in ``param_dtype``.
        buffer_dtype: dtype the module buffers are cast to at lazy init. State dicts still save
            buffers in their original dtype.
        keep_low_precision_grads: leave the sharded gradient in the reduce dtype instead of casting
            it back to the parameter dtype.
        cast_forward_inputs: cast floating-point forward inputs of this (non-root) FSDP module to
            ``param_dtype``.
        cast_root_forward_inputs: cast floating-point forward inputs of the root to ``param_dtype``.
        _module_classes_to_ignore: with an ``auto_wrap_policy``, instances of these classes are
            wrapped on their own with mixed precision disabled (see ``reference.wrap``).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """Keep sharded parameters on CPU between uses. Named for API parity; the reference computes on
    the device it is given and rejects ``offload_params=True``."""

    offload_params: bool = False


class StateDictType(Enum):
    """Layout of ``state_dict()`` / ``load_state_dict()`` for FSDP modules.

    * ``FULL_STATE_DICT``: one unsharded, unflattened tensor per original parameter, keyed by the
      original (unwrapped) names: the same keys as the module without FSDP.
    * ``SHARDED_STATE_DICT``: same keys, each value this rank's ``torch.chunk`` of dim 0 of the
      parameter as a ``ShardedTensor`` (a ``DTensor`` when FSDP was built with a ``device_mesh``).
    * ``LOCAL_STATE_DICT``: one ``_flat_param`` key per FSDP module, the value this rank's shard of
      the flat parameter with its padding removed, as a 1-D ``ShardedTensor``.
    """

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    """Options shared by every state-dict type.

    Attributes:
        offload_to_cpu: move the saved tensors (or the local shards) to CPU.
    """

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """Options of ``FULL_STATE_DICT``.

    Attributes:
        rank0_only: only rank 0 keeps the FSDP-managed entries; every other rank returns them
            dropped (an FSDP root gives ``{}`` there). All ranks still take part in the gathers.
    """

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Options of ``LOCAL_STATE_DICT`` (only ``offload_to_cpu``)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Options of ``SHARDED_STATE_DICT``.

    Attributes:
        _use_dtensor: private; set by the save/load hooks when the FSDP module was built with a
            ``device_mesh``, which turns the values into ``DTensor`` s.
    """

    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    """Optimizer-state counterpart of :class:`StateDictConfig` (stored, unused by the reference)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    """What ``set_state_dict_type`` returns: the settings that were active before the call."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
