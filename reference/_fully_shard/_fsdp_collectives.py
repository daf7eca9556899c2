"""The two collectives of one parameter group: all-gather (unshard) and reduce-scatter (grads).

[Note: all-gather layout]
A group gathers all its parameters in ONE collective. Each rank's contribution is the
concatenation of its parameters' all-gather inputs (``i_0 | i_1 | ...``, sizes ``s_0, s_1, ...``);
the output is ``world_size`` such rows back to back. *Copy-in* writes each input straight into
this rank's own row of the output (no intermediate concatenation), and the all-gather fills the
other rows in place. *Copy-out* views the output as ``(world_size, sum(s_k))`` and splits its
columns into each parameter's all-gather output viewed as ``(world_size, s_k)``, in one
``split_with_sizes_copy``. Inputs of different dtypes are gathered as raw bytes (``uint8``).
A parameter sharded on dim ``d != 0`` comes out as its rank chunks stacked on dim 0, so it goes
through a temporary from which the chunks are interleaved along ``d`` (not when it is gathered
from its post-forward pieces: those are slices of the interleaved output already).
With one rank there is nothing to exchange: each all-gather input (every one an extension returns,
not only the first) is copied straight into its all-gather output, with no collective.

[Note: reduce-scatter layout and divide factors]
Each unsharded gradient is padded on dim 0 to a multiple of ``world_size`` and cut into
``world_size`` row chunks; row ``r`` of the reduce-scatter input concatenates every gradient's
chunk ``r`` (``torch._chunk_cat``), so rank ``r`` receives its shards in the padded layout of
``_sharded_param_data``; a zero-numel gradient has no elements in any row, so it is left out of
that input (``_chunk_cat`` rejects empty tensors) and its shard is an empty tensor. Averaging over
the data-parallel size ``N`` (spec P6): fp32/bf16 use ``AVG`` (``SUM`` when ``N`` is 1); other
dtypes (fp16) risk overflow, so they ``SUM`` between a pre-divide by ``pre`` (doubled from 1 while
``N % pre == 0 and N / pre > pre``) and a post-divide by ``N / pre``. A custom
``gradient_divide_factor`` ``f`` replaces ``N``; for fp32/bf16 it uses ``AVG`` when ``f`` is the
reduce-scatter size, else upstream's ``PREMUL_SUM(1 / f)``, which the reference spells as a divide
by ``f`` before a ``SUM`` (the same sum, on backends without ``PREMUL_SUM`` such as gloo). With one
rank the reduce-scatter is skipped; the divides alone apply.

[Note: collective names across torch versions]
torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` and made the old names warn; 2.11 and 2.12 have only the old names. The
two helpers at the end call the new name where it exists, else the old one (the same collective).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ._fsdp_common import _to_dtype_if_needed
from ._fsdp_param import FSDPParam, ShardedState
from ._shard_math import dim0_padded_size


class AllGatherResult(NamedTuple):
    all_gather_output: torch.Tensor | None  # 1D, world_size * sum(split sizes); None at one rank
    all_gather_work: dist.Work | None  # set iff async
    param_all_gather_input_dtypes: list[list[torch.dtype]]
    param_all_gather_input_numels: list[list[int]]
    all_gather_input_split_sizes: list[int]


@torch.no_grad()
def foreach_all_gather(
    fsdp_params: list[FSDPParam], group: dist.ProcessGroup, async_op: bool, device: torch.device
) -> AllGatherResult:
    """Copy-in every parameter's inputs into this rank's row, then all-gather once (one rank:
    copy each input straight into its all-gather output instead, see the Note)."""
    world_size, rank = group.size(), group.rank()
    param_inputs = [fsdp_param.all_gather_inputs for fsdp_param in fsdp_params]
    if world_size == 1:  # no exchange, and no metadata for the copy-out (see the Note)
        outputs = []
        for fsdp_param, inputs in zip(fsdp_params, param_inputs):
            numels, dtypes = [t.numel() for t in inputs], [t.dtype for t in inputs]
            fsdp_param.init_all_gather_outputs(numels, dtypes, 1, device)  # or regrow them
            outputs += fsdp_param.all_gather_outputs
        with _preserve_version_counters(outputs):
            torch._foreach_copy_(outputs, [t for inputs in param_inputs for t in inputs])
        return AllGatherResult(None, None, [], [], [])
    dtypes = [[t.dtype for t in inputs] for inputs in param_inputs]
    numels = [[t.numel() for t in inputs] for inputs in param_inputs]
    flat_inputs = [t for inputs in param_inputs for t in inputs]
    dtype = flat_inputs[0].dtype
    if any(t.dtype != dtype for t in flat_inputs):
        dtype = torch.uint8
        flat_inputs = [t.view(torch.uint8) for t in flat_inputs]
    split_sizes = [t.numel() for t in flat_inputs]
    input_numel = sum(split_sizes)
    output = torch.empty(input_numel * world_size, dtype=dtype, device=device)
    my_row = output.narrow(0, input_numel * rank, input_numel)
    torch._foreach_copy_(list(torch.split(my_row, split_sizes)), flat_inputs)
    work = _all_gather_single(output, my_row, group, async_op)
    return AllGatherResult(output, work if async_op else None, dtypes, numels, split_sizes)


@torch.no_grad()
def foreach_all_gather_copy_out(
    result: AllGatherResult, fsdp_params: list[FSDPParam], group: dist.ProcessGroup
) -> None:
    """Split the gathered rows into each parameter's (re-allocated) all-gather outputs."""
    if result.all_gather_work is not None:
        result.all_gather_work.wait()
    world_size, output = group.size(), result.all_gather_output
    if output is None:
        return  # one rank: foreach_all_gather filled the outputs
    destinations: list[torch.Tensor] = []
    non_dim0: list[tuple[FSDPParam, list[torch.Tensor]]] = []
    numels_dtypes = zip(result.param_all_gather_input_numels, result.param_all_gather_input_dtypes)
    for (numels, dtypes), fsdp_param in zip(numels_dtypes, fsdp_params):
        fsdp_param.init_all_gather_outputs(numels, dtypes, world_size, output.device)
        outs = fsdp_param.all_gather_outputs
        post_forward = fsdp_param.sharded_state == ShardedState.SHARDED_POST_FORWARD
        if fsdp_param.fsdp_placement.dim != 0 and not post_forward:
            outs = [torch.empty_like(t) for t in outs]
            non_dim0.append((fsdp_param, outs))
        destinations.extend(outs)
    views = [t.view(world_size, -1) for t in destinations]
    if output.dtype == torch.uint8:
        views = [v.view(torch.uint8) for v in views]
    with _preserve_version_counters(views):
        split_sizes = result.all_gather_input_split_sizes
        torch.split_with_sizes_copy(output.view(world_size, -1), split_sizes, dim=1, out=views)
    for fsdp_param, temps in non_dim0:  # interleave the stacked rank chunks along dim d
        d, padded = fsdp_param.fsdp_placement.dim, fsdp_param.padded_sharded_param_size
        outs = fsdp_param.all_gather_outputs
        with _preserve_version_counters(outs):
            for temp, out in zip(temps, outs):
                rank_chunks = temp.view(world_size, *padded).movedim(0, d)
                out.view(*padded[:d], world_size, *padded[d:]).copy_(rank_chunks)


def _preserve_version_counters(tensors: list[torch.Tensor]):
    """The unsharded parameters alias the all-gather outputs; refilling them must not bump the
    version counters that autograd checks for tensors it saved in forward."""
    tracked = tuple(t for t in tensors if not t.is_inference())
    return torch.autograd._unsafe_preserve_version_counter(tracked) if tracked else nullcontext()


@torch.no_grad()
def foreach_reduce(
    fsdp_params: list[FSDPParam],
    unsharded_grads: list[torch.Tensor],
    reduce_scatter_group: dist.ProcessGroup,
    orig_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    device: torch.device,
    gradient_divide_factor: float | None,
    all_reduce_group: dist.ProcessGroup | None,  # set iff HSDP
    force_sum: bool = False,
) -> None:
    """Reduce-scatter the group's gradients (HSDP: then all-reduce them) and accumulate them
    into the sharded parameters' DTensor ``.grad``. ``unsharded_grads`` is cleared on the way, so
    that the full gradients are freed as soon as the reduce-scatter input holds them."""
    if len(grad_dtypes := {grad.dtype for grad in unsharded_grads}) != 1:
        raise AssertionError(f"FSDP reduce-scatter expects uniform gradient dtype: {grad_dtypes}")
    reduce_dtype = reduce_dtype or unsharded_grads[0].dtype
    predivide, postdivide, rs_op, ar_op = _get_gradient_divide_factors(
        reduce_scatter_group, all_reduce_group, reduce_dtype, gradient_divide_factor, force_sum
    )
    world_size = reduce_scatter_group.size()
    for i, (fsdp_param, grad) in enumerate(zip(fsdp_params, unsharded_grads)):
        if (shard_dim := fsdp_param.fsdp_placement.dim) != 0:  # into the dim-0 chunk layout
            unsharded_grads[i] = torch.cat(torch.chunk(grad, world_size, shard_dim), dim=0)
    padded_sizes = [dim0_padded_size(grad.size(), world_size) for grad in unsharded_grads]
    input_numel = sum(math.prod(s) for s in padded_sizes)
    reduce_scatter_input = torch.empty(input_numel, dtype=reduce_dtype, device=device)
    # _chunk_cat rejects empty tensors; a zero-numel gradient has no elements in any row anyway
    if nonempty := [grad for grad in unsharded_grads if grad.numel() > 0]:
        torch._chunk_cat(nonempty, 0, world_size, out=reduce_scatter_input.view(world_size, -1))
    unsharded_grads.clear()
    _div_if_needed(reduce_scatter_input, predivide)
    if world_size > 1:
        output = torch.empty(input_numel // world_size, dtype=reduce_dtype, device=device)
        _reduce_scatter_single(output, reduce_scatter_input, rs_op, reduce_scatter_group)
    else:  # one rank: SUM and AVG leave the input as it is
        output = reduce_scatter_input
    if all_reduce_group is not None:
        dist.all_reduce(output, op=ar_op, group=all_reduce_group)
    _div_if_needed(output, postdivide)
    output = _to_dtype_if_needed(output, orig_dtype)
    offset = 0
    for padded_size, fsdp_param in zip(padded_sizes, fsdp_params):
        sharded_param = fsdp_param.sharded_param
        new_grad = torch.as_strided(
            output, fsdp_param.sharded_size, fsdp_param.contiguous_sharded_stride, offset
        )
        if fsdp_param.offload_to_cpu:
            new_grad = new_grad.to(torch.device("cpu"))
        if sharded_param.grad is not None:
            sharded_param.grad._local_tensor += new_grad
        else:
            sharded_param.grad = fsdp_param.to_sharded_dtensor(new_grad)
        for hook in (getattr(sharded_param, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(sharded_param)
        offset += math.prod(padded_size) // world_size


def _get_gradient_divide_factors(
    reduce_scatter_group: dist.ProcessGroup, all_reduce_group: dist.ProcessGroup | None,
    reduce_dtype: torch.dtype, factor: float | None, force_sum: bool = False,
) -> tuple[float | None, float | None, ReduceOp, ReduceOp]:  # fmt: skip
    """``(predivide, postdivide, reduce_scatter_op, all_reduce_op)`` per the Note above.
    ``force_sum`` (``set_force_sum_reduction_for_comms``): fp32/bf16 use SUM collectives and
    divide by ``factor`` (the data-parallel size by default) after them."""
    data_parallel_size = reduce_scatter_group.size()
    if all_reduce_group is not None:
        data_parallel_size *= all_reduce_group.size()
    if reduce_dtype in (torch.float32, torch.bfloat16) and force_sum:
        return (
            None,
            float(data_parallel_size) if factor is None else factor,
            ReduceOp.SUM,
            ReduceOp.SUM,
        )
    if reduce_dtype in (torch.float32, torch.bfloat16):
        if factor is None:
            op = ReduceOp.SUM if data_parallel_size == 1 else ReduceOp.AVG
            return None, None, op, op
        if factor == reduce_scatter_group.size():
            return None, None, ReduceOp.AVG, ReduceOp.SUM
        return factor, None, ReduceOp.SUM, ReduceOp.SUM  # PREMUL_SUM(1 / factor)
    factor = float(data_parallel_size) if factor is None else factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre, ReduceOp.SUM, ReduceOp.SUM


def _div_if_needed(tensor: torch.Tensor, div_factor: float | None) -> None:
    if div_factor is not None and div_factor != 1:
        tensor.div_(div_factor)


def _all_gather_single(output, input, group, async_op):  # Note: collective names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def _reduce_scatter_single(output, input, op, group):  # Note: collective names
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(output, input, op=op, group=group)
