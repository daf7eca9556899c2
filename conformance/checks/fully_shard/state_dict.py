"""Area "fsdp2_state_dict": a ``fully_shard`` module's own ``state_dict()`` / ``load_state_dict()``
(P8, P9).

[Note: the rules]
* ``state_dict()`` maps each clean FQN to the registered sharded DTensor itself: no copy, the
  value's local tensor has the parameter's local tensor's ``data_ptr``; a dict kept across optimizer
  steps still aliases the parameters (it shows the new values).
* Saving and loading reshard first: after a ``reshard_after_forward=False`` forward the dict holds
  SHARDED DTensors and the parameters are SHARDED again.
* Loading DTensors copies their values into the shards (``assign=False``: the local storage is kept
  where the dim 0 is even), or, with ``assign=True``, registers new Parameters which FSDP re-pads
  into a fresh padded buffer (``reset_sharded_param``): the local tensor is a narrow view of a 1-D
  buffer of ``ceil(d0/ws)*row`` elements whose tail is zero, whatever the loaded tensor's storage
  held. When the loaded local tensor *is* the current one (the model's own dict) nothing is
  re-padded. Either way the values, the forward output and training follow the loaded values.
* Plain (non-DTensor) tensors are rejected: ``RuntimeError: Error(s) in loading state_dict``
  (pytorch#136336: FSDP2 loads sharded dicts only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
from conformance.checks._shared.rows import chunk_range, chunk_size
from conformance.registry import check


class Net(nn.Module):
    """lin1.weight (10, 4), lin2.weight (3, 10), lin2.bias (3,): uneven for ws 3/4, empty ranks at 4."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.lin1 = nn.Linear(4, 10)
        self.lin2 = nn.Linear(10, 3)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(distinct_values(tuple(p.shape), salt * 10 + i) / 1000.0)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


PLAN = [("lin1", {}), ("lin2", {}), ("", {})]
REQ = {base.DTENSOR_STATE_DICT, base.DTENSOR_PARAMS, base.FSDP2_API}


def build(ctx, salt=0, **options):
    model = Net(salt).to(ctx.device)
    plain = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    return ctx.impl.shard(model, ctx, plan=PLAN, **options), plain


def batch(ctx):
    return (distinct_values((3, 4), 5) / 100.0).to(ctx.device)


def assert_values(ctx, model, expected, what):
    for fqn, param in model.named_parameters():
        full = param.full_tensor().detach().cpu()
        assert torch.equal(full, expected[fqn]), (
            f"{ctx.where()} {fqn} {what}: full_tensor() differs from the expected values"
        )


def assert_repadded(ctx, model, expected, what):
    """Every parameter's local tensor aliases a 1-D buffer of the padded size with a zero tail."""
    views = ctx.impl.local_shards(model)
    for fqn, view in views.items():
        orig = expected[fqn]
        start, end = chunk_range(orig.shape[0], ctx.world_size, ctx.rank)
        chunk = chunk_size(orig.shape[0], ctx.world_size)
        row = math.prod(orig.shape[1:])
        padded = view.padded
        assert padded is not None, f"{ctx.where()} {fqn}: no padded storage exposed"
        assert padded.dim() == 1 and padded.numel() == chunk * row, (
            f"{ctx.where()} {fqn} {what}: padded storage {tuple(padded.shape)}, expected ({chunk * row},)"
        )
        n = (end - start) * row
        assert torch.equal(padded[:n].cpu(), orig[start:end].reshape(-1)), (
            f"{ctx.where()} {fqn} {what}: padded storage does not start with rows {start}:{end}"
        )
        assert not padded[n:].any(), (
            f"{ctx.where()} {fqn} {what}: padding {n}:{padded.numel()} is not zero: {padded[n:].tolist()[:6]}"
        )
        if n:
            assert view.local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr(), (
                f"{ctx.where()} {fqn} {what}: the local tensor does not alias the padded storage"
            )


@check(area="fsdp2_state_dict", requires=REQ)
def state_dict_aliases_shards(ctx):
    """``state_dict()`` returns, under the clean FQNs, DTensors whose local tensors are the
    parameters' local tensors (same data_ptr, no copy) and whose full values are the originals;
    a dict kept across SGD steps shows the updated values."""
    from torch.distributed.tensor import DTensor

    model, plain = build(ctx)
    sd = model.state_dict()
    assert list(sd) == list(plain), f"{ctx.where()} keys {list(sd)}, expected {list(plain)}"
    params = dict(model.named_parameters())
    for fqn, value in sd.items():
        assert isinstance(value, DTensor), (
            f"{ctx.where()} {fqn}: {type(value).__name__}, expected a DTensor"
        )
        local, plocal = value.to_local(), params[fqn].to_local()
        if plocal.numel():
            assert local.data_ptr() == plocal.data_ptr(), (
                f"{ctx.where()} {fqn}: state_dict value is a copy (data_ptr differs from the parameter's)"
            )
        assert torch.equal(value.full_tensor().detach().cpu(), plain[fqn]), (
            f"{ctx.where()} {fqn}: values differ"
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        model(batch(ctx)).sum().backward()
        opt.step()
        opt.zero_grad()
    for fqn, param in model.named_parameters():
        assert torch.equal(sd[fqn].to_local(), param.to_local()), (
            f"{ctx.where()} {fqn}: the kept state_dict no longer shows the parameter after 2 steps"
        )
        assert not torch.equal(param.full_tensor().detach().cpu(), plain[fqn]), (
            f"{ctx.where()} {fqn}: training did not change the parameter (check is vacuous)"
        )


@check(area="fsdp2_state_dict", requires=REQ | {base.RESHARD_AFTER_FORWARD})
def state_dict_reshards_first(ctx):
    """After a ``reshard_after_forward=False`` forward (parameters registered unsharded),
    ``state_dict()`` returns sharded DTensors with the original values and leaves the parameters
    registered as sharded DTensors."""
    from torch.distributed.tensor import DTensor

    model, plain = build(ctx, reshard_after_forward=False)
    with torch.no_grad():
        model(batch(ctx))
    assert not isinstance(model.lin1.weight, DTensor), (
        f"{ctx.where()} setup: lin1.weight is sharded after a reshard_after_forward=False forward"
    )
    sd = model.state_dict()
    for fqn, value in sd.items():
        assert isinstance(value, DTensor), (
            f"{ctx.where()} {fqn}: state_dict value {type(value).__name__}"
        )
        assert torch.equal(value.full_tensor().detach().cpu(), plain[fqn]), (
            f"{ctx.where()} {fqn}: values differ"
        )
    for fqn, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{ctx.where()} {fqn}: not resharded by state_dict()"
        assert (
            sd[fqn].to_local().numel() == 0
            or sd[fqn].to_local().data_ptr() == param.to_local().data_ptr()
        ), f"{ctx.where()} {fqn}: state_dict value does not alias the resharded parameter"


def foreign_dtensors(ctx, source: dict, garbage: float = 777.0):
    """DTensors with ``source``'s values whose local tensors sit at the start of larger buffers filled
    with ``garbage`` (so an implementation that reuses the loaded storage as padding shows it)."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for fqn, full in source.items():
        start, end = chunk_range(full.shape[0], ctx.world_size, ctx.rank)
        chunk = chunk_size(full.shape[0], ctx.world_size)
        row = math.prod(full.shape[1:])
        buf = torch.full(((chunk + 1) * row,), garbage, dtype=full.dtype, device=ctx.device)
        n = (end - start) * row
        buf[:n] = full[start:end].reshape(-1).to(ctx.device)
        local = buf[:n].view(end - start, *full.shape[1:])
        out[fqn] = DTensor.from_local(
            local, ctx.mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    return out


@check(
    area="fsdp2_state_dict",
    requires=REQ | {base.PADDED_STORAGE},
    cases={"copy": {"assign": False}, "assign": {"assign": True}},
)
def load_dtensors(ctx, assign):
    """Loading DTensors with other values (whose storage holds garbage past the data) gives those
    values, re-padded storage with a zero tail, and the forward output of an unsharded model with
    those values; without ``assign`` the parameters stay the same objects (and keep their storage
    where dim 0 is even), with ``assign=True`` they are the new Parameters."""
    model, _ = build(ctx)
    target = Net(salt=3)
    expected = {k: v.detach().clone().cpu() for k, v in target.state_dict().items()}
    before = dict(model.named_parameters())
    ptrs = {k: p.to_local().data_ptr() for k, p in before.items()}
    result = model.load_state_dict(foreign_dtensors(ctx, expected), assign=assign)
    assert not result.missing_keys and not result.unexpected_keys, (
        f"{ctx.where()} load result {result}"
    )
    after = dict(model.named_parameters())
    for fqn in expected:
        if assign:
            assert after[fqn] is not before[fqn], (
                f"{ctx.where()} {fqn}: load_state_dict(assign=True) kept the old Parameter object"
            )
        else:
            assert after[fqn] is before[fqn], (
                f"{ctx.where()} {fqn}: load (copy) replaced the Parameter"
            )
            even = expected[fqn].shape[0] % ctx.world_size == 0
            if even and after[fqn].to_local().numel():
                assert after[fqn].to_local().data_ptr() == ptrs[fqn], (
                    f"{ctx.where()} {fqn}: load (copy) of an evenly sharded parameter moved its storage"
                )
    assert_values(ctx, model, expected, "after load_state_dict")
    assert_repadded(ctx, model, expected, "after load_state_dict")
    out = model(batch(ctx))
    ref = target.to(ctx.device)(batch(ctx))
    assert torch.allclose(out.detach().cpu(), ref.detach().cpu(), rtol=1e-6, atol=1e-7), (
        f"{ctx.where()} forward after loading differs from the unsharded model with the loaded values"
    )
    out.sum().backward()
    for fqn, param in model.named_parameters():
        assert param.grad is not None, (
            f"{ctx.where()} {fqn}: no gradient after loading (assign={assign})"
        )


@check(area="fsdp2_state_dict", requires=REQ | {base.PADDED_STORAGE})
def assign_own_state_dict(ctx):
    """``load_state_dict(model.state_dict(), assign=True)``: new Parameter objects, but the local
    tensors are the same storage (nothing to re-pad), values and padding unchanged."""
    model, plain = build(ctx)
    before = dict(model.named_parameters())
    ptrs = {k: p.to_local().data_ptr() for k, p in before.items()}
    model.load_state_dict(model.state_dict(), assign=True)
    for fqn, param in model.named_parameters():
        assert param is not before[fqn], (
            f"{ctx.where()} {fqn}: assign=True kept the old Parameter object"
        )
        if param.to_local().numel():
            assert param.to_local().data_ptr() == ptrs[fqn], (
                f"{ctx.where()} {fqn}: assigning the module's own (already padded) shard moved it"
            )
    assert_values(ctx, model, plain, "after assigning its own state dict")
    assert_repadded(ctx, model, plain, "after assigning its own state dict")


@check(area="fsdp2_state_dict", requires=REQ)
def plain_tensors_rejected(ctx):
    """Loading full plain tensors into a sharded module raises RuntimeError 'Error(s) in loading
    state_dict' (FSDP2 loads DTensor dicts only, pytorch#136336) on every rank."""
    import re

    model, plain = build(ctx)
    sd = {k: (v + 1).to(ctx.device) for k, v in plain.items()}
    try:
        model.load_state_dict(sd)
    except RuntimeError as exc:
        assert re.search(r"Error\(s\) in loading state_dict", str(exc)), (
            f"{ctx.where()} message {str(exc)[:200]!r} does not say 'Error(s) in loading state_dict'"
        )
    else:
        raise AssertionError(
            f"{ctx.where()} loading plain tensors was accepted; expected RuntimeError"
        )
