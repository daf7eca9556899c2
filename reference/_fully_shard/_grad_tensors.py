"""Finding (and replacing) the tensors of a forward's inputs or output that FSDP2 hooks for
backward.

[Note: walking a forward output]
A unit's forward may return its tensors inside any nesting of tuples (named or not), lists,
dicts and dataclass instances. With grad enabled, the unit registers its pre-backward hook on
every tensor in there that requires grad; anything else (a set, a custom object, an int) is a
leaf and is not looked into. The walk counts containers: the returned object itself is at depth
0 and whatever sits inside ``k`` containers is at depth ``k``. Reaching depth
:data:`MAX_OUTPUT_DEPTH` (anything, tensor or not, 128 containers deep) raises RuntimeError that
names the limit: such a structure is taken for a cycle (a list that holds itself) rather than
walked until Python's recursion limit.

The same walk finds a unit's forward *inputs* that need grad, which the unit routes through its
post-backward identity, and puts the routed tensors back in their places: each container on the
way is rebuilt as its own type (a named tuple from its fields, a dataclass instance with
``dataclasses.replace``), and a container in which nothing changed is kept as it is. A list or
tuple subclass whose constructor does not take one list of items becomes its base type (a plain
list or tuple) with the new items; a dataclass that ``dataclasses.replace`` cannot rebuild (its
own ``__init__`` refuses the fields) is refused with TypeError naming it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

MAX_OUTPUT_DEPTH = 128


def _children(obj: Any) -> list[Any] | None:
    """The items a container holds, in order; None for a leaf."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, (list, tuple)):  # named tuples included
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def collect_grad_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in ``output`` that requires grad, in depth-first order (see the Note)."""
    found: list[torch.Tensor] = []

    def visit(obj: Any, depth: int) -> None:
        if depth >= MAX_OUTPUT_DEPTH:
            raise RuntimeError(
                f"a forward output is nested deeper than the max depth ({MAX_OUTPUT_DEPTH}) of "
                "containers FSDP walks; is it a circular structure?"
            )
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                found.append(obj)
            return
        for child in _children(obj) or ():
            visit(child, depth + 1)

    visit(output, 0)
    return found


def replace_grad_tensors(obj: Any, new: Iterator[torch.Tensor]) -> Any:
    """``obj`` with every tensor :func:`collect_grad_tensors` finds in it replaced by the next
    tensor of ``new``, in the same order; every one of ``new`` must be used. ``new`` comes from
    that walk of ``obj``, which has already held it to the depth limit."""

    def rebuild(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return next(new) if obj.requires_grad else obj
        items = _children(obj)
        if items is None:
            return obj
        done = [rebuild(item) for item in items]
        if all(a is b for a, b in zip(done, items)):
            return obj
        if isinstance(obj, dict):
            out = copy.copy(obj)
            out.update(zip(obj.keys(), done))
            return out
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*done)
        if isinstance(obj, (list, tuple)):
            try:
                return type(obj)(done)
            except TypeError:  # a subclass not built from one list: its base type instead
                return list(done) if isinstance(obj, list) else tuple(done)
        changed = {
            f.name: value
            for f, value, old in zip(dataclasses.fields(obj), done, items)
            if value is not old
        }
        try:
            return dataclasses.replace(obj, **changed)
        except TypeError as e:
            raise TypeError(
                f"cannot rebuild the dataclass {type(obj).__qualname__} of a forward input or "
                f"output with dataclasses.replace(), which FSDP needs: {e}"
            ) from None

    result = rebuild(obj)
    if next(new, None) is not None:
        raise RuntimeError("more replacement tensors than tensors that need grad")
    return result
