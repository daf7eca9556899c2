"""What every FSDP1 helper knows of an FSDP module, so that none of them imports the wrapper class.

:class:`_FSDPState` is the base class of ``FullyShardedDataParallel`` (as upstream's
``_common_utils._FSDPState``); its attributes are listed on the wrapper. The helpers type their
arguments with it and find FSDP modules with :func:`_fsdp_modules`. Every FSDP1 warning is raised
with :func:`_warn` (see ``[Note: caller attribution]``).
"""

from __future__ import annotations

import sys
import traceback
import warnings

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


# top-level packages whose frames are never "the caller" of a public API
_INTERNAL = frozenset({"reference", "torch", "contextlib"})


def _warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn about how a public API was called, attributed to the caller's call of that API.

    [Note: caller attribution]
    Rule (X5): a warning about a call records the file and line of the user's call of the public
    API, not a line of the implementation. The depth of that call varies (a state-dict hook runs
    once per unit inside ``nn.Module.state_dict``; ``torch.no_grad`` and ``contextlib`` add wrapper
    frames; a unit built by auto-wrap runs the constructor again), so no fixed ``stacklevel`` fits:
    the warning points at the first frame, going up, whose module is outside this package, torch
    and contextlib (the frame that warns when every one is inside).
    """
    frames = traceback.walk_stack(sys._getframe(1))  # the function that warns is level 1
    outside = (n for n, (f, _) in enumerate(frames, 1) if not _internal(f.f_globals))
    warnings.warn(message, category, stacklevel=next(outside, 1) + 1)  # +1: this helper


def _internal(module_globals: dict) -> bool:
    return module_globals.get("__name__", "").partition(".")[0] in _INTERNAL
