"""Observing the collectives an implementation issues: one spy for every check that needs one.

[Note: one spy, at the op level]
A correct FSDP may reduce-scatter through any of torch's paths: ``torch.distributed.
reduce_scatter_tensor`` (or ``_reduce_scatter_base``, ``reduce_scatter`` with a list of inputs,
those calls inside ``_coalescing_manager``), ``torch.distributed._functional_collectives``
(``reduce_scatter_tensor``, its ``_autograd`` variant, the coalesced form) or a DTensor
``redistribute`` from ``Partial`` to ``Shard``. A spy that wraps Python functions sees only the
names it wraps and misses a call bound before it was installed. Every one of those paths reaches
the dispatcher as one op of the ``c10d`` namespace (``c10d._reduce_scatter_base_``,
``c10d.reduce_scatter_``, ``c10d.reduce_scatter_tensor_coalesced_``) or of ``_c10d_functional``
(``reduce_scatter_tensor``, ``reduce_scatter_tensor_coalesced``), so the spy is a
``TorchDispatchMode`` that records those ops: whatever Python entry point issued them.
``tests/harness/test_collectives.py`` drives each path on 2 gloo ranks and asserts it is seen once.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class Collective(NamedTuple):
    """One collective op the spy saw: its op name and the dtypes of its input and output."""

    op: str
    input_dtype: torch.dtype | None
    output_dtype: torch.dtype | None

    @property
    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        return self.input_dtype, self.output_dtype


def _first_tensor(value):
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, torch.Tensor) else None


def _dtype(value):
    tensor = _first_tensor(value)
    return None if tensor is None else tensor.dtype


def _record(name: str, args, result) -> Collective:
    """(input, output) of a reduce-scatter op, by the op's schema: in-place ``c10d`` ops take
    ``(output(s), input(s), ...)``; functional ones take the input(s) and return the output(s)."""
    if name.startswith("c10d."):
        return Collective(name, _dtype(args[1]), _dtype(args[0]))
    return Collective(name, _dtype(args[0]), _dtype(result))


class _Spy(TorchDispatchMode):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.calls: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if name.split(".")[0] in NAMESPACES and self.kind in name:
            self.calls.append(_record(name, args, result))
        return result


@contextlib.contextmanager
def observe(kind: str):
    """Record every collective op whose name contains ``kind`` (``"reduce_scatter"``,
    ``"all_gather"``) issued inside the block, on any path (see the Note)."""
    spy = _Spy(kind)
    with spy:
        yield spy.calls


def observe_reduce_scatter():
    """Record (as :class:`Collective`) every reduce-scatter issued inside the block."""
    return observe("reduce_scatter")


def _numel(value) -> int:
    """Elements of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def output_numel(name: str, args, result) -> int:
    """Elements a collective op wrote: in-place ``c10d`` ops take their output(s) first,
    functional ones return them."""
    return _numel(args[0] if name.startswith("c10d.") else result)


def is_all_gather(name: str) -> bool:
    """Whether the dispatcher op ``name`` (``namespace.op``) is an all-gather of any path."""
    return name.split(".")[0] in NAMESPACES and "allgather" in name.replace("_", "")


class EventSpy(TorchDispatchMode):
    """All-gathers, named by their output size (``sizes``: numel -> a unit's name), and matrix
    products (the ops in ``products``, recorded as "mm"), in dispatch order: what a prefetch
    schedule check compares with the order its rule gives."""

    def __init__(self, sizes: dict[int, str], products=("aten.mm",)):
        super().__init__()
        self.sizes, self.products = sizes, products
        self.events: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket._qualified_op_name).replace("::", ".")
        if is_all_gather(name):
            numel = output_numel(name, args, result)
            self.events.append(self.sizes.get(numel, f"<gather of {numel}>"))
        elif name in self.products:
            self.events.append("mm")
        return result
