"""Area "param_subclass": a parameter tensor subclass that implements the all-gather extension hooks
and only the aten ops upstream FSDP2 applies to it trains like the plain model (P14).

[Note: the strict subclass]
``StrictTensor`` wraps one plain tensor ``inner`` (a quantized-training weight from a real library
looks like this: a wrapper that implements the FSDP hooks and a short list of ops). It runs an aten
op on ``inner`` only if the op is in :data:`UPSTREAM_OPS` and raises ``NotImplementedError`` naming
the op otherwise, so an FSDP that asks more of a parameter subclass than upstream does fails here.
Its pre hook (5 arguments) hands FSDP either one all-gather input (``inner``) or two (``hi``, the
value rounded to bfloat16, and ``lo``, the rest), padded to ``ceil(d0/ws)`` rows; its post hook
trims the gathered rows to the global size and returns ``hi + lo`` as a plain tensor, which it also
lists as the tensor to free (later unshards refill it through ``out=``). An FSDP that drops the
second input (upstream at world size 1) fails the post hook's input count.

:data:`UPSTREAM_OPS` is what upstream ``torch.distributed.fsdp.fully_shard`` (torch 2.13, CPU/gloo)
applied to the subclass while :func:`drive` ran at world sizes 1-4, even and uneven rows, one and
two inputs (optimizer and state-dict ops included). Upstream also calls ``aten.new_empty``, but only
where ``torch.chunk`` leaves some rank no rows (it builds the empty chunks with it), so the check
allows it only there (:func:`allowed_ops`). To refresh the set for another torch, run :func:`drive`
against upstream with ``StrictTensor.allowed = None``: every op is then recorded in
``StrictTensor.seen``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from conformance.adapters import base
from conformance.checks._shared.models import distinct_values
from conformance.checks._shared.oracle import assert_close
from conformance.checks._shared.rows import chunk_of
from conformance.registry import check

aten = torch.ops.aten
UPSTREAM_OPS = frozenset(
    {
        aten.add_.Tensor,
        aten.copy_.default,
        aten.detach.default,
        aten.new_zeros.default,
        aten.slice.Tensor,
        aten.split.Tensor,
        aten.view.default,
    }
)


def allowed_ops(rows: int, world_size: int) -> frozenset:
    """The ops upstream uses on a ``rows``-row parameter at ``world_size`` (see the Note)."""
    empty_chunks = math.ceil(rows / math.ceil(rows / world_size)) < world_size
    return UPSTREAM_OPS | {aten.new_empty.default} if empty_chunks else UPSTREAM_OPS


class StrictTensor(torch.Tensor):
    """A wrapper around ``inner`` that implements the FSDP hooks and refuses unknown ops (Note)."""

    allowed: frozenset | None = None  # None: record every op in `seen` instead of refusing
    seen: set = set()
    two_inputs = False

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            requires_grad=False,
        )

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    def __repr__(self):
        return f"{type(self).__name__}({self.inner})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if cls.allowed is None:
            cls.seen.add(func)
        elif func not in cls.allowed:
            raise NotImplementedError(
                f"{cls.__name__} does not implement {func} (upstream FSDP2 "
                "does not call it on this parameter)"
            )
        out = func(
            *tree_map_only(StrictTensor, lambda t: t.inner, args),
            **tree_map_only(StrictTensor, lambda t: t.inner, kwargs or {}),
        )
        if func._schema.is_mutable and args and isinstance(args[0], StrictTensor):
            return args[0]  # in place: the wrapper's inner was mutated
        return tree_map_only(torch.Tensor, cls, out)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = math.ceil(outer_size[0] / mesh.size())
        padded = self.inner.new_zeros((rows, *self.inner.shape[1:]))
        padded[: self.inner.shape[0]].copy_(self.inner)
        if not self.two_inputs:
            return (padded,), outer_size[0]
        hi = padded.bfloat16().float()
        return (hi, padded - hi), outer_size[0]

    def fsdp_post_all_gather(self, outputs, rows, param_dtype, *, out=None):
        expected = 2 if self.two_inputs else 1
        if len(outputs) != expected:
            raise AssertionError(
                f"fsdp_post_all_gather got {len(outputs)} all-gather output(s), "
                f"expected the {expected} that fsdp_pre_all_gather returned"
            )
        full = sum(t[:rows] for t in outputs)
        if out is not None:
            with torch.no_grad():
                out.copy_(full)
            return None
        return full, (full,)


class SplitTensor(StrictTensor):
    """A :class:`StrictTensor` that all-gathers two inputs (``hi`` and ``lo``)."""

    two_inputs = True


class StrictLinear(nn.Module):
    """``x @ weight.T + bias``, the weight a strict subclass of shape ``(rows, 4)``."""

    def __init__(self, rows: int, cls: type[StrictTensor], device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(cls((distinct_values((rows, 4), 1) / 100.0).to(device)))
        self.bias = nn.Parameter((distinct_values((rows,), 2) / 100.0).to(device))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def _inner(t: torch.Tensor) -> torch.Tensor:
    """The plain values of a parameter (a DTensor's local tensor, unwrapped), read without ops."""
    local = getattr(t, "_local_tensor", t)
    return local.inner if isinstance(local, StrictTensor) else local


STEPS = 2
CASES = {
    f"{inputs}-{rows}": {"cls": cls, "uneven": rows == "uneven"}
    for inputs, cls in (("one-input", StrictTensor), ("two-inputs", SplitTensor))
    for rows in ("even", "uneven")
}


def _rows(world_size: int, uneven: bool) -> int:
    """2 rows per rank; uneven adds one (at ws 4: 9 rows, chunks 3, 3, 3 and an empty one)."""
    return 2 * world_size + (1 if uneven else 0)


def drive(ctx, cls: type[StrictTensor], uneven: bool) -> None:
    """Shard, train ``STEPS`` SGD steps and round-trip the state dict, checking every value against
    a plain single-process oracle (rank r holds rows ``r*ceil(d0/ws)`` on)."""
    ws, rank, rows = ctx.world_size, ctx.rank, _rows(ctx.world_size, uneven)
    oracle = nn.Linear(4, rows).to(ctx.device)
    with torch.no_grad():
        oracle.weight.copy_(distinct_values((rows, 4), 1) / 100.0)
        oracle.bias.copy_(distinct_values((rows,), 2) / 100.0)
    model = StrictLinear(rows, cls, ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    oopt = torch.optim.SGD(oracle.parameters(), lr=0.1, foreach=False)
    mine = slice(2 * rank, 2 * rank + 2)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * ws, 4, generator=g), torch.randn(2 * ws, rows, generator=g)
        x, y = x.to(ctx.device), y.to(ctx.device)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        F.mse_loss(oracle(x), y).backward()  # the mean over ranks of the local losses
        for name, param in model.named_parameters():
            expected = chunk_of(oracle.get_parameter(name).grad, 0, ws, rank)
            assert_close(
                ctx,
                f"step {step} {name} sharded grad",
                _inner(param.grad),
                expected,
                dict(rtol=1e-5, atol=1e-6),
            )
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
    state_dict = model.state_dict()
    fresh = StrictLinear(rows, cls, ctx.device)
    ctx.impl.ns.fully_shard(fresh, mesh=ctx.mesh)
    fresh.load_state_dict(state_dict)
    for name in ("weight", "bias"):
        expected = chunk_of(oracle.get_parameter(name), 0, ws, rank)
        for where, tensor in (
            ("after the steps", model.get_parameter(name)),
            ("state dict", state_dict[name]),
            ("after loading the state dict", fresh.get_parameter(name)),
        ):
            assert_close(
                ctx,
                f"{name} {where} (this rank's rows of the oracle's)",
                _inner(tensor),
                expected,
                dict(rtol=1e-5, atol=1e-6),
            )
    with torch.no_grad():
        assert_close(
            ctx,
            "forward of the loaded model",
            fresh(x[mine]),
            oracle(x[mine]),
            dict(rtol=1e-5, atol=1e-6),
        )


@check(
    area="param_subclass", requires={base.EXTENSIONS, base.TRAINING, base.FSDP2_API}, cases=CASES
)
def train_strict_subclass(ctx, cls, uneven):
    """A parameter subclass with only the ops upstream uses on it trains like the oracle (P14).

    It implements the extension hooks (one or two all-gather inputs) and refuses every other op
    (the Note); gradients, stepped values, the state dict and a loaded copy equal the oracle's."""
    StrictTensor.allowed = allowed_ops(_rows(ctx.world_size, uneven), ctx.world_size)
    try:
        drive(ctx, cls, uneven)
    finally:
        StrictTensor.allowed = None
