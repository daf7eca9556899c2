"""Area "wrap": FSDP1's ``auto_wrap_policy`` at construction, on a child registered under the
empty name (W25).

[Note: a child registered under the empty name]
``nn.Module.add_module`` refuses the empty name, but ``setattr(parent, "", child)`` registers a
child whose name is ``""`` (``named_children`` yields ``("", child)``, its state-dict keys would
start with a bare "."). FSDP1's auto-wrap puts each unit back under its name in its parent, and a
unit with no name has no place to go: ``FullyShardedDataParallel(root, auto_wrap_policy=...)``
whose policy selects such a child is refused with AssertionError naming the empty module name, and
the child is not replaced (W25).
"""

from __future__ import annotations

import re

from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import _kwargs
from conformance.registry import check


@check(area="wrap", requires={base.AUTO_WRAP, base.FSDP1_API}, world_sizes=(1,))
def fsdp1_wrap_empty_child_name(ctx):
    """W25: ``FullyShardedDataParallel(root, auto_wrap_policy=ModuleWrapPolicy({Linear}))`` on a
    ``Sequential`` whose first Linear child is registered under the empty name (``setattr(root,
    "", Linear(4, 4))``) and whose second is ``b`` raises AssertionError whose message says the
    module has an empty module name; the child under ``""`` is still the plain Linear."""
    ns = ctx.impl.ns
    root = nn.Sequential()
    nameless = nn.Linear(4, 4).to(ctx.device)
    setattr(root, "", nameless)
    root.add_module("b", nn.Linear(4, 4).to(ctx.device))
    assert [n for n, _ in root.named_children()] == ["", "b"], "setup: '' is not a child"
    policy = ns.wrap.ModuleWrapPolicy({nn.Linear})
    try:
        ns.FullyShardedDataParallel(root, auto_wrap_policy=policy, **_kwargs(ctx))
    except AssertionError as exc:
        assert re.search(r"empty module name", str(exc)), (
            f"{ctx.where()} W25: AssertionError message {str(exc)[:300]!r} does not say the "
            "module has an empty module name"
        )
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"{ctx.where()} W25: raised {type(exc).__name__}: {str(exc)[:300]}, expected "
            "AssertionError naming the empty module name"
        ) from exc
    else:
        raise AssertionError(
            f"{ctx.where()} W25: a policy-selected child registered under the empty name was "
            "wrapped; expected AssertionError naming the empty module name"
        )
    assert root._modules[""] is nameless, (
        f"{ctx.where()} W25: the child under '' was replaced by {type(root._modules['']).__name__}"
        " although the wrap was refused"
    )
