"""Acme's auto-wrap internals: upstream's ``torch.distributed.fsdp._wrap_utils``."""

import torch.distributed.fsdp._wrap_utils as _upstream


def __getattr__(name: str):
    return getattr(_upstream, name)
