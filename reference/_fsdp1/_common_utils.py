"""What every FSDP1 helper knows of an FSDP module, so that none of them imports the wrapper class.

:class:`_FSDPState` is the base class of ``FullyShardedDataParallel`` (as upstream's
``_common_utils._FSDPState``); its attributes are listed on the wrapper. The helpers type their
arguments with it and find FSDP modules with :func:`_fsdp_modules`.
"""

from __future__ import annotations

from torch import nn

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."


class _FSDPState(nn.Module):
    """Base of ``FullyShardedDataParallel``; no behaviour of its own."""


def _fsdp_modules(module: nn.Module) -> list[_FSDPState]:
    """Every FSDP module in ``module`` 's tree, in ``modules()`` order (``module`` included)."""
    return [m for m in module.modules() if isinstance(m, _FSDPState)]


def clean_tensor_name(name: str) -> str:
    """``name`` without FSDP's and activation checkpointing's wrapper prefixes."""
    return name.replace(FSDP_PREFIX, "").replace("_checkpoint_wrapped_module.", "")
