"""Area "lifecycle": ``copy.deepcopy`` of a ``fully_shard`` unit, or of a module holding one, is
refused and leaves the model as it was (P91).
"""

from __future__ import annotations

import copy

from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import expect_error
from conformance.checks.fully_shard.forward_method import _assert_forward_matches, _pair
from conformance.registry import check


@check(area="lifecycle", requires={base.FSDP2_API}, world_sizes=(1, 2))
def deepcopy_refused(ctx):
    """P91: ``copy.deepcopy`` of a ``fully_shard`` unit (the root, a nested unit, or a plain module
    holding one) raises AssertionError "FSDP does not support deepcopy. Please use state dict for
    serialization." rather than copying sharded state; the model still computes the unsharded
    model's output afterwards."""
    model, oracle = _pair(ctx)
    holder = nn.ModuleList([model[0]])
    for what, module in (("the root", model), ("model[0]", model[0]), ("a plain holder", holder)):
        expect_error(
            ctx,
            f"copy.deepcopy({what})",
            AssertionError,
            r"FSDP does not support deepcopy\. Please use state dict for serialization",
            lambda module=module: copy.deepcopy(module),
        )
    _assert_forward_matches(ctx, model, oracle, "after the refused deepcopies")
