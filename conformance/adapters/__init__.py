"""Implementation adapters: the interface (:mod:`.base`), the FSDP2-style and FSDP1-style adapters
shared by upstream torch, the reference and API-compatible forks, and the registry of built-ins."""

from conformance.adapters.base import (
    Implementation,
    NamespaceImplementation,
    NotSupported,
    ShardView,
)
from conformance.adapters.flat_param import FlatParamAdapter
from conformance.adapters.fully_shard import FullyShardAdapter

__all__ = [
    "FlatParamAdapter",
    "FullyShardAdapter",
    "Implementation",
    "NamespaceImplementation",
    "NotSupported",
    "ShardView",
]
