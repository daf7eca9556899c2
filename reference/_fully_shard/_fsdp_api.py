"""The user-facing policy objects of ``fully_shard``: mixed precision and offloading.

These are plain dataclasses so that two policies with the same fields compare equal and print
readably. ``MixedPrecisionPolicy`` is frozen (it is used as a default argument and shared across
calls); the offload policies are mutable dataclasses, as upstream's are in torch 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for one ``fully_shard`` call.

    Rules (applied per parameter by ``FSDPParam.init_dtype_attrs``):

    * ``param_dtype``: dtype of the all-gather and of the unsharded parameter used in
      forward/backward. ``None`` (or equal to the parameter's own dtype, or a non-floating
      parameter) means "keep the original dtype". The sharded parameter the optimizer steps on
      always stays in its original dtype.
    * ``reduce_dtype``: dtype of the gradient reduction. ``None`` means "the gradient's dtype"
      (that is, ``param_dtype`` when set). A value equal to ``param_dtype`` is clamped to ``None``.
    * ``output_dtype``: if set, floating-point forward outputs are cast to it.
    * ``cast_forward_inputs``: if ``True`` and ``param_dtype`` is set, floating-point forward
      inputs are cast to ``param_dtype`` before the module runs.
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
    """Keep the sharded parameters and sharded gradients in CPU memory.

    Each all-gather input is copied to the compute device just before the all-gather, and each
    reduced gradient shard is copied back to CPU, so the optimizer steps on CPU.

    ``pin_memory``: pin the CPU shards (page-locked memory) for fast host/device copies. Pinning
    needs an accelerator; on a CPU-only build it raises ``RuntimeError`` like upstream.
    """

    pin_memory: bool = True
