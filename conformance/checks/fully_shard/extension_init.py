"""Area "extensions": a half-defined all-gather extension is refused by ``fully_shard`` itself.

[Note: when the hook pair is checked]
``extensions.py``'s ``extension_error_contracts`` accepts the "Both fsdp_pre_all_gather and
fsdp_post_all_gather should be defined" AssertionError at ``fully_shard`` or at the first forward.
Bad input must raise at once (P14): a local shard that defines exactly one of the two hooks is
already visible when ``fully_shard`` builds the parameter's sharded form, so the call itself raises
and no forward is needed to find out. (A pre hook with the wrong number of arguments is only
called at the first all-gather, so its error may come then; that stays with
``extension_error_contracts``.)
"""

from __future__ import annotations

from conformance.adapters import base
from conformance.checks.fully_shard import _subclasses
from conformance.checks.fully_shard.extensions import PairLinear
from conformance.registry import check

PATTERN = "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined"
HALF_DEFINED = {"pre-only": _subclasses.PreOnly, "post-only": _subclasses.PostOnly}


@check(
    area="extensions",
    requires={base.EXTENSIONS, base.FSDP2_API},
    cases={k: {"name": k} for k in HALF_DEFINED},
)
def extension_hook_pair_checked_at_fully_shard(ctx, name):
    """A parameter whose local shard defines only one of ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` makes the ``fully_shard`` call itself raise AssertionError 'Both
    fsdp_pre_all_gather and fsdp_post_all_gather should be defined ...' on every rank, before
    any forward (P14)."""
    module = PairLinear(2 * ctx.world_size, HALF_DEFINED[name]).to(ctx.device)
    try:
        ctx.impl.ns.fully_shard(module, mesh=ctx.mesh)
    except AssertionError as exc:
        assert PATTERN in str(exc), f"{ctx.where()} {name}: fully_shard raised {str(exc)[:300]!r}"
        return
    raise AssertionError(
        f"{ctx.where()} {name}: fully_shard accepted the shard; expected AssertionError {PATTERN!r}"
    )
