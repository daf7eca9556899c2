"""Area "fsdp2_state_dict": a full model state dict loads through
``torch.distributed.checkpoint.state_dict`` (DSD) into a ``fully_shard`` model in which one module
is reachable under two names (P107).

[Note: the oracle of a shared-module load]
The model is ``_SharedNet``: ``a`` is an ``nn.Linear(4, 4)`` and ``b`` an ``nn.Sequential`` holding
that same module, so its plain ``state_dict`` has the keys ``a.*`` and ``b.0.*`` for two parameters.
The oracle is the unsharded model: ``get_model_state_dict`` + ``set_model_state_dict`` with
``full_state_dict=True`` round trips on it (every parameter gets the saved value and ``b[0]`` stays
``a``); the sharded model fed the same dict must end the same way, each rank holding its dim-0
chunk (``_shared/rows.py``) of the saved value under both names. With ``broadcast_from_rank0`` only
rank 0 passes the dict (the others ``{}``).
"""

from __future__ import annotations

import torch
from torch import nn

from conformance.checks._shared.rows import chunk_of
from conformance.checks.fully_shard.dsd_model_edges import MODEL, _dsd
from conformance.registry import check

AREA = "fsdp2_state_dict"
PLANS = {"root": [("", {})], "unit": [("a", {}), ("", {})]}


class _SharedNet(nn.Module):
    """``a`` and ``b[0]`` are one ``nn.Linear(4, 4)``; values drawn from ``salt``."""

    def __init__(self, salt: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(1070 + salt)
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(self.a)
        with torch.no_grad():
            for p in self.a.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.b(self.a(x))


def _saved_and_oracle(ctx, dsd):
    """The full DSD dict of the unsharded ``_SharedNet(0)``, after checking that it round trips
    into an unsharded ``_SharedNet(1)`` (the oracle's own precondition)."""
    full = dsd.StateDictOptions(full_state_dict=True)
    saved = {
        k: v.detach().clone()
        for k, v in dsd.get_model_state_dict(_SharedNet(0), options=full).items()
    }
    plain = _SharedNet(1)
    dsd.set_model_state_dict(plain, dict(saved), options=full)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[name]), (
            f"{ctx.where()} oracle: the unsharded round trip left {name} unloaded"
        )
    assert plain.b[0] is plain.a, f"{ctx.where()} oracle: the unsharded load broke the sharing"
    return saved


@check(
    area=AREA,
    requires=MODEL,
    cases={
        f"{plan}-{mode}": {"plan": plan, "broadcast": mode == "bcast"}
        for plan in PLANS
        for mode in ("all", "bcast")
    },
    world_sizes=(1, 2, 3),
)
def dsd_full_load_shared_module(ctx, plan, broadcast):
    """P107: into a sharded ``_SharedNet`` (``a`` and ``b[0]`` one ``Linear(4, 4)``; one unit at
    the root, or ``a`` a unit of its own under the root), ``set_model_state_dict(model, saved,
    options=StateDictOptions(full_state_dict=True[, broadcast_from_rank0=True]))`` of the unsharded
    model's full DSD dict reports no missing or unexpected key, and every parameter under both
    names then holds this rank's dim-0 chunk of the saved value, ``b[0]`` still being ``a`` (the
    unsharded model's DSD round trip is the oracle; with ``broadcast_from_rank0`` only rank 0 passes
    the dict)."""
    dsd = _dsd()
    saved = _saved_and_oracle(ctx, dsd)
    model = ctx.impl.shard(_SharedNet(1).to(ctx.device), ctx, plan=PLANS[plan])
    options = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    given = {} if broadcast and ctx.rank != 0 else {k: v.to(ctx.device) for k, v in saved.items()}
    result = dsd.set_model_state_dict(model, given, options=options)
    assert not result.missing_keys and not result.unexpected_keys, (
        f"{ctx.where()} full load of the shared-module model reported {result}"
    )
    assert model.b[0] is model.a, f"{ctx.where()} after the load b[0] is no longer a"
    for name in saved:
        owner, leaf = name.rsplit(".", 1)
        param = getattr(model.get_submodule(owner), leaf)
        local = param.to_local() if hasattr(param, "to_local") else param
        want = chunk_of(saved[name], 0, ctx.world_size, ctx.rank)
        assert torch.equal(local.detach().cpu(), want), (
            f"{ctx.where()} {name} after the full load: local shard {local.detach().cpu().tolist()} "
            f"is not this rank's chunk {want.tolist()} of the saved value"
        )
