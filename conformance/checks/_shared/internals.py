"""Upstream's private modules, for the few checks that build on them (a custom comm's base class,
a mesh info, a context manager only a private module exports).

A fork need not keep upstream's private layout: where ``<ns>.<path>`` cannot be imported the case
is not supported there, with the reason, rather than failing on an ImportError that says nothing
about the fork's behaviour."""

from __future__ import annotations

import importlib
from types import ModuleType

from conformance.adapters import base


def ns_module(ctx, path: str) -> ModuleType:
    """``<namespace>.<path>`` of the implementation under test (``path`` like
    ``"_fully_shard._fsdp_common"``), or :class:`base.NotSupported`."""
    name = f"{ctx.impl.ns.__name__}.{path}"
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise base.NotSupported(
            f"{name} cannot be imported ({exc}); this check builds on upstream's private module"
        ) from exc
