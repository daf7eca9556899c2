"""A small, readable FSDP: the executable specification behind the conformance suite.

``import reference as fsdp`` reads like ``import torch.distributed.fsdp as fsdp`` for the subset it
covers:

* FSDP2 (per-parameter sharding): :func:`fully_shard`, :class:`FSDPModule`,
  :class:`MixedPrecisionPolicy`, :class:`OffloadPolicy`, :class:`CPUOffloadPolicy`,
  :func:`share_comm_ctx` (``reference/_fully_shard/``).
* FSDP1 (flat-parameter sharding): :class:`FullyShardedDataParallel`, :class:`StateDictType`,
  the state-dict configs, :class:`MixedPrecision`, :class:`ShardingStrategy`
  (``reference/_fsdp1/``).
* Auto-wrap policies, applying and planning them: :mod:`reference.wrap` (``reference/wrap/``).

This package imports torch only; it never imports the conformance harness.
Names resolve lazily so that reading one part never requires importing the others.

Imports run one way (``tests/reference/test_structure.py`` checks it, function-level imports
included; no cycles inside a part either). A part may import only the parts below it:

* ``reference.api``: FSDP1's configuration types; imports no other part.
* ``reference.wrap``: policies, applying and planning; may import ``api``. It recognises an FSDP
  module by its class name (``FullyShardedDataParallel`` / ``FSDPModule`` in its MRO), never by
  import, and builds units with the ``wrapper_cls`` it is given.
* ``reference._fsdp1``: may import ``api`` and ``wrap`` (its constructor applies the
  ``auto_wrap_policy``, as upstream's does).
* ``reference._fully_shard``: may import ``api``; independent of FSDP1 and wrap.
"""

from __future__ import annotations

import importlib

# public name -> module that defines it
_EXPORTS = {
    # FSDP2
    "fully_shard": "reference._fully_shard",
    "FSDPModule": "reference._fully_shard",
    "UnshardHandle": "reference._fully_shard",
    "MixedPrecisionPolicy": "reference._fully_shard",
    "OffloadPolicy": "reference._fully_shard",
    "CPUOffloadPolicy": "reference._fully_shard",
    "share_comm_ctx": "reference._fully_shard",
    # FSDP1
    "FullyShardedDataParallel": "reference._fsdp1.fully_sharded_data_parallel",
    "StateDictType": "reference.api",
    "StateDictConfig": "reference.api",
    "FullStateDictConfig": "reference.api",
    "ShardedStateDictConfig": "reference.api",
    "LocalStateDictConfig": "reference.api",
    "MixedPrecision": "reference.api",
    "ShardingStrategy": "reference.api",
    "BackwardPrefetch": "reference.api",
    "CPUOffload": "reference.api",
}

__all__ = sorted(_EXPORTS) + ["wrap"]


def __getattr__(name: str):
    if name == "wrap":
        return importlib.import_module("reference.wrap")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'reference' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
