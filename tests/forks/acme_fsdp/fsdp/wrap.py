"""Acme's auto-wrap policies: upstream's ``torch.distributed.fsdp.wrap``."""

import torch.distributed.fsdp.wrap as _upstream


def __getattr__(name: str):
    return getattr(_upstream, name)
