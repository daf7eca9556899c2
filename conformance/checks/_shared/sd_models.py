"""Models, wrap plans and helpers for the state-dict checks (``state_dict/``; fsdp1/ and fuzz/ too).

Every model is built from deterministic values (no seed needed, equal on every rank); ``salt``
changes every value, so a "fresh model with different values" is the same class with another salt.
Values are small (|v| < 1) so that a few SGD steps stay well conditioned.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NotSupported
from conformance.checks._shared.rows import chunk_range


def small_values(shape, salt: int, index: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Pairwise-distinct, non-zero values of magnitude < 1 with alternating signs; different for
    every (salt, index)."""
    n = math.prod(shape)
    k = torch.arange(n, dtype=torch.float64)
    sign = 1.0 - 2.0 * (k % 2)
    mag = (k + 1) / (n + 1) * 0.5 + 0.01 * salt + 0.001 * (index + 1)
    return (sign * mag).to(dtype).reshape(tuple(shape))


def fill_(module: nn.Module, salt: int) -> nn.Module:
    """Overwrite every parameter and floating buffer of ``module`` with ``small_values``."""
    with torch.no_grad():
        for i, (_, p) in enumerate(module.named_parameters()):
            p.copy_(small_values(p.shape, salt, i))
        for i, (_, b) in enumerate(module.named_buffers()):
            if b.is_floating_point():  # exact in fp16 too (buffer mixed precision round trips)
                steps = torch.arange(b.numel(), dtype=torch.float32).reshape(b.shape)
                b.copy_(2.0 * (i + 1) + 0.25 * steps + 0.5 * salt)
    return module


class Scale(nn.Module):
    """A module with one (1,)-parameter: as its own unit it leaves ranks >= 1 without data."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.weight


class Net(nn.Module):
    """inner Linear(4,4) (own unit) -> outer Linear(4,5) -> head Linear(5,1) -> scale (own unit).

    Buffers: persistent ``buf`` (3,) on the root and ``inner_buf`` (2,) on ``inner`` (each with
    its own value), non-persistent ``scratch`` (2,) which a state dict must never contain.
    Shapes chosen for sharding: head.weight (1,5) and scale.weight (1,) have dim 0 < ws.
    """

    def __init__(self, salt: int = 0):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 5)
        self.head = nn.Linear(5, 1)
        self.scale = Scale()
        self.register_buffer("buf", torch.zeros(3))
        self.inner.register_buffer("inner_buf", torch.zeros(2))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        fill_(self, salt)

    def forward(self, x):
        h = torch.relu(self.inner(x))
        return self.scale(self.head(self.outer(h)))


NET_PLAN = [("inner", {}), ("scale", {}), ("", {})]  # children first, root last


class InnerHeadNet(nn.Module):
    """inner Linear(4, 6) -> tanh -> head Linear(6, 3), for a two-unit plan (inner its own unit,
    30 elements; the root's head, 21): head.bias (3,) leaves rank 3 without rows at world size 4."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


class CheckpointedNet(nn.Module):
    """``Net``-like model whose ``inner`` is wrapped with ``checkpoint_wrapper`` (activation
    checkpointing) when ``wrap_ac``; its clean keys equal ``PlainNet``'s."""

    def __init__(self, salt: int = 0, wrap_ac: bool = True):
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        inner = nn.Linear(4, 4)
        self.inner = checkpoint_wrapper(inner) if wrap_ac else inner
        self.outer = nn.Linear(4, 5)
        fill_(self, salt)

    def forward(self, x):
        return self.outer(torch.relu(self.inner(x)))


AC_PLAN = [("inner", {}), ("", {})]


class TiedNet(nn.Module):
    """Shared module (``net3 is net2``) and shared parameter (``shared_parameter is
    random_parameter``), as upstream's TestDummyModel."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.net1 = nn.Linear(4, 4)
        self.net2 = nn.Sequential(nn.Linear(4, 4))
        self.net3 = self.net2
        self.random_parameter = nn.Parameter(torch.zeros(4))
        self.shared_parameter = self.random_parameter
        fill_(self, salt)

    def forward(self, x):
        return self.net3(self.net2(self.net1(x))) + self.shared_parameter


class SharedWeightNet(nn.Module):
    """Two Linear(4, 4) modules sharing one weight (``b.weight is a.weight``, two FQNs across two
    distinct modules; TiedNet's aliases live in one module), each with its own bias."""

    def __init__(self, salt: int = 0):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        fill_(self, salt)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


# ------------------------------------------------------------------------------------- helpers
def inputs(rank: int, batch: int = 2, step: int = 0, features: int = 4) -> torch.Tensor:
    """The batch ``rank`` uses at ``step`` (distinct per rank and step)."""
    return small_values((batch, features), salt=17 * step + 3 * rank + 5) * 2.0


def train(
    model: nn.Module, ctx, steps: int = 2, lr: float = 0.1, local: bool = False
) -> list[torch.Tensor]:
    """A few SGD steps; returns each step's loss (detached). Sharded (``local=False``): each rank
    uses its own batch and the implementation averages gradients. ``local=True``: an unwrapped copy
    trained on the global batch (every rank's batch, concatenated) with the mean loss, which is
    what the sharded model must compute."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        if local:
            x = torch.cat([inputs(r, step=step) for r in range(ctx.world_size)])
        else:
            x = inputs(ctx.rank, step=step)
        loss = model(x.to(ctx.device)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def expected_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unwrapped model's state dict, detached and cloned on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def full_params(ctx, module: nn.Module, impl=None) -> dict[str, torch.Tensor]:
    """Every original parameter (clean FQN), reassembled on every rank from the layout view
    (``impl.local_shards``) and an all-gather: independent of the state-dict code under test."""
    impl = impl or ctx.impl
    flat = base.FLAT_PARAM in impl.capabilities
    mine = {
        fqn: (v.global_shape, v.local.detach().cpu().clone(), v.offset)  # clean FQN keys
        for fqn, v in impl.local_shards(module).items()
    }
    gathered = [None] * ctx.world_size
    if ctx.world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    out = {}
    for fqn, (shape, local, _) in mine.items():
        numel = math.prod(shape)
        full = torch.zeros(numel, dtype=local.dtype)
        for piece in gathered:
            _, part, offset = piece[fqn]
            if part.numel() == 0:
                continue
            row = 1 if flat else math.prod(shape[1:])
            start = offset * row
            full[start : start + part.numel()] = part.reshape(-1)
        out[fqn] = full.reshape(shape)
    return out


def first_error_everywhere(ctx, fn):
    """Run ``fn()`` on every rank; if it raised on any rank, raise on every rank (so no rank waits
    in a later collective for a rank that already failed). Returns ``fn()``'s value."""
    error = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below
        error, value = exc, None
    if ctx.world_size > 1:
        flag = torch.tensor([1.0 if error is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and error is None:
            raise AssertionError(f"{ctx.where()} the same call raised on another rank")
    if error is not None:
        raise error
    return value


def broadcast_from_rank0(ctx, obj):
    """Rank 0's object on every rank (``broadcast_object_list``)."""
    if ctx.world_size == 1:
        return obj
    box = [obj if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------ kinds and assertions
AREA = "state_dict"
KIND_CAPABILITY = {
    "full": base.FULL_STATE_DICT,
    "sharded": base.SHARDED_STATE_DICT,
    "local": base.LOCAL_STATE_DICT,
    "dtensor": base.DTENSOR_STATE_DICT,
    "dcp-full": base.DTENSOR_STATE_DICT,
    "dcp-sharded": base.DTENSOR_STATE_DICT,
}
FULL_KINDS = ("full", "dcp-full")
KIND_CASES = {k: {"kind": k} for k in KIND_CAPABILITY}


# ------------------------------------------------------------------------------------- helpers
def require_kind(ctx, kind: str, impl=None) -> None:
    impl = impl or ctx.impl
    if KIND_CAPABILITY[kind] not in impl.capabilities:
        raise NotSupported.undeclared(KIND_CAPABILITY[kind])


def full_kind(impl) -> str:
    """The kind that gives an implementation's full (plain-tensor) state dict."""
    if base.FULL_STATE_DICT in impl.capabilities:
        return "full"
    if base.DTENSOR_STATE_DICT in impl.capabilities:
        return "dcp-full"
    raise NotSupported.undeclared(base.FULL_STATE_DICT, base.DTENSOR_STATE_DICT, any_of=True)


def build(ctx, cls=Net, salt: int = 0, plan=NET_PLAN, impl=None, **options):
    impl = impl or ctx.impl
    return impl.shard(cls(salt).to(ctx.device), ctx, plan=plan, **options)


def is_full_kind(ctx, kind: str) -> bool:
    """Whether ``kind`` yields plain full tensors here (FSDP1 at world size 1 is NO_SHARD: S8)."""
    return kind in FULL_KINDS or (
        ctx.world_size == 1
        and kind in ("sharded", "local")
        and base.FLAT_PARAM in ctx.impl.capabilities
    )


def _sharded_types():
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return ShardedTensor, DTensor


def assert_clean_keys(ctx, sd: dict) -> None:
    """Every key is clean: the implementation's ``clean_fqn`` (which knows its wrappers' name
    components, torch's by default) leaves it as it is."""
    for key in sd:
        clean = ctx.impl.clean_fqn(key)
        assert clean == key, (
            f"{ctx.where()} state-dict key {key!r} carries a wrapper prefix (clean: {clean!r})"
        )


def assert_entry(ctx, name: str, got, exp: torch.Tensor, *, full: bool, exact: bool = True) -> None:
    """``got`` holds ``exp``: as a plain tensor when ``full``, else as this rank's dim-0 chunk
    (ShardedTensor or DTensor, rows ``[r*ceil(d0/ws), ...)``)."""
    ShardedTensor, DTensor = _sharded_types()

    def same(a, b, what):
        a = a.detach().cpu()
        ok = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-5)
        assert ok, (
            f"{ctx.where()} {name}: {what} {a.reshape(-1)[:6].tolist()} != expected {b.reshape(-1)[:6].tolist()}"
        )

    if full:
        assert type(got) is torch.Tensor or (
            isinstance(got, torch.Tensor) and not isinstance(got, (ShardedTensor, DTensor))
        ), f"{ctx.where()} {name}: {type(got).__name__}, expected a plain tensor"
        assert tuple(got.shape) == tuple(exp.shape), (
            f"{ctx.where()} {name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
        )
        assert got.dtype == exp.dtype, f"{ctx.where()} {name}: dtype {got.dtype} != {exp.dtype}"
        same(got, exp, "value")
        return
    start, end = chunk_range(exp.shape[0], ctx.world_size, ctx.rank) if exp.dim() else (0, 1)
    if isinstance(got, ShardedTensor):
        size = tuple(got.metadata().size)
        assert size == tuple(exp.shape), (
            f"{ctx.where()} {name}: ShardedTensor size {size} != {tuple(exp.shape)}"
        )
        shards = got.local_shards()
        if end == start:
            assert not shards or all(s.tensor.numel() == 0 for s in shards), (
                f"{ctx.where()} {name} {tuple(exp.shape)}: expected no local shard past the last chunk, "
                f"got {[tuple(s.tensor.shape) for s in shards]}"
            )
            return
        assert len(shards) == 1, f"{ctx.where()} {name}: {len(shards)} local shards, expected 1"
        offsets = list(shards[0].metadata.shard_offsets)
        want = [start] + [0] * (exp.dim() - 1)
        assert offsets == want, f"{ctx.where()} {name}: shard offsets {offsets}, expected {want}"
        local = shards[0].tensor
    elif isinstance(got, DTensor):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        assert tuple(got.shape) == tuple(exp.shape), (
            f"{ctx.where()} {name}: DTensor size {tuple(got.shape)}"
        )
        assert tuple(got.placements) == (Shard(0),), (
            f"{ctx.where()} {name}: placements {got.placements}"
        )
        local = got.to_local()
        if end > start:
            _, offset = compute_local_shape_and_global_offset(
                got.shape, got.device_mesh, got.placements
            )
            assert offset[0] == start, (
                f"{ctx.where()} {name}: DTensor local offset {offset[0]}, expected {start}"
            )
    else:
        raise AssertionError(
            f"{ctx.where()} {name}: {type(got).__name__}, expected a ShardedTensor or DTensor"
        )
    assert local.dtype == exp.dtype, (
        f"{ctx.where()} {name}: local shard dtype {local.dtype} != {exp.dtype}"
    )
    want_shape = (end - start, *exp.shape[1:])
    assert tuple(local.shape) == want_shape, (
        f"{ctx.where()} {name} {tuple(exp.shape)}: local shard shape {tuple(local.shape)}, expected "
        f"{want_shape} (rows {start}:{end})"
    )
    same(local, exp[start:end], f"local rows {start}:{end}")


def assert_loaded(ctx, model, expected: dict, what: str, impl=None, params=None) -> None:
    """``model``'s full parameters (``params`` when the caller gathered them its own way, else
    :func:`full_params`) and its buffers equal ``expected`` (a plain state dict)."""
    got = full_params(ctx, model, impl) if params is None else params
    for fqn, value in got.items():
        assert fqn in expected, f"{ctx.where()} {what}: parameter {fqn} not in the saved model"
        assert torch.equal(value, expected[fqn]), (
            f"{ctx.where()} {what}: {fqn} is {value.reshape(-1)[:4].tolist()}, expected the saved "
            f"{expected[fqn].reshape(-1)[:4].tolist()}"
        )
    for name, buf in model.named_buffers():
        name = (impl or ctx.impl).clean_fqn(name)
        if name in expected:
            assert torch.equal(buf.detach().cpu().to(expected[name].dtype), expected[name]), (
                f"{ctx.where()} {what}: buffer {name} is {buf.tolist()}, expected {expected[name].tolist()}"
            )


def plain_reference(cls=Net, salt: int = 0) -> dict:
    return expected_state_dict(cls(salt))
