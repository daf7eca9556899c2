"""Helpers of the wrap checks: reaching an implementation's private wrap utilities, and reading the
FSDP modules an FSDP1 constructor built."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from conformance.adapters.base import NotSupported


def device_id(ctx):
    return torch.device("cpu") if ctx.device.type == "cpu" else ctx.device


def fsdp1_units(ctx, wrapped: nn.Module) -> dict[str, nn.Module]:
    FSDP = ctx.impl.ns.FullyShardedDataParallel
    return {ctx.impl.clean_fqn(n): m for n, m in wrapped.named_modules() if isinstance(m, FSDP)}


def fsdp1_managed(unit_fqn: str, unit: nn.Module) -> list[str]:
    handle = getattr(unit, "_handle", None)
    if handle is None:
        return []
    prefix = f"{unit_fqn}." if unit_fqn else ""
    return [prefix + f for f in handle.flat_param._fqns]


def expect_raise(ctx, what: str, exc_type, message: str, fn):
    try:
        fn()
    except exc_type as e:
        assert str(e) == message, f"{ctx.where()} {what}: message {str(e)!r}, expected {message!r}"
    else:
        raise AssertionError(f"{ctx.where()} {what}: expected {exc_type.__name__}, nothing raised")


class Box(nn.Module):
    """A stand-in wrapper class: holds ``module`` and the kwargs it was built with."""

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs


def wrap_api(ctx, name: str):
    """``name`` from the implementation's wrap module (``ns.wrap``), else from the module that
    defines it in upstream's or the reference's layout; NotSupported when it has none."""
    base_name = ctx.impl.ns.__name__
    for module_name in (
        f"{base_name}.wrap",
        f"{base_name}._wrap_utils",
        f"{base_name}.wrap._wrap_utils",
        f"{base_name}.wrap._wrap_plan",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return getattr(module, name)
    raise NotSupported(f"{name} (not in {base_name}.wrap)")


def module_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> its first name in ``named_modules()``."""
    return {id(m): n for n, m in model.named_modules()}
