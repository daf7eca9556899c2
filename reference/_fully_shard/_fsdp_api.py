"""The policy objects of ``fully_shard``: plain dataclasses, so equal fields compare equal.
``MixedPrecisionPolicy`` is frozen (it is a shared default argument); the offload policies are
mutable, as upstream's are in torch 2.13."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision; ``FSDPParam.init_dtype_attrs`` clamps it per parameter.

    * ``param_dtype``: dtype of the all-gather and of the unsharded parameter used in compute.
      ``None``, the parameter's own dtype, or a non-floating parameter: keep the original. The
      sharded parameter the optimizer steps on always keeps its original dtype.
    * ``reduce_dtype``: dtype of the gradient reduction; ``None`` means the gradient's dtype
      (``param_dtype`` when set). A value equal to ``param_dtype`` is clamped to ``None``.
    * ``output_dtype``: if set, floating-point forward outputs are cast to it.
    * ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype`` (if set).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters and gradients live on the mesh's device (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU: each all-gather input is copied to the
    device just before the all-gather and each reduced gradient shard back, so the optimizer
    steps on CPU. ``pin_memory`` pins the CPU shards; pinning needs an accelerator (on a CPU-only
    build it raises ``RuntimeError``, like upstream)."""

    pin_memory: bool = True
