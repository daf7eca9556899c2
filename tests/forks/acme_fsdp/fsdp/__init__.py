"""Acme's FSDP namespace: every public name of ``torch.distributed.fsdp`` (FSDP2's
``fully_shard`` and FSDP1's ``FullyShardedDataParallel`` with their configs), as a fork that keeps
upstream's API exposes it, plus the ``wrap`` / ``_wrap_utils`` submodules."""

import torch.distributed.fsdp as _upstream

from acme_fsdp.fsdp import _wrap_utils, wrap  # noqa: F401 - submodules, as upstream has them


def __getattr__(name: str):
    return getattr(_upstream, name)


def __dir__():
    return sorted(set(dir(_upstream)) | set(globals()))
