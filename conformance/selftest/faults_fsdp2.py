"""Seeded faults in FSDP2 (``fully_shard``): the reference's and upstream torch's.

Each fault is a small, plausible bug in one rule (the behaviour ids are those of the spec: P1
sharding rows and padding, P2 states, P4 freeing, P5 mixed precision, P6 gradient reduction, P7
all-gather copy-out, P8/P9 state dict and re-padding, P11 offload, P12 init errors, P13
placements, P14 extensions, P16 HSDP, P17 managed states, P18 the unshard API).
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from conformance.selftest.faults import fault, replace_with, wrap

REF = "reference._fully_shard"
TORCH = "torch.distributed.fsdp._fully_shard"


# ---------------------------------------------------------------- sharding rows and padding (P1)
def _floor_chunk_dim_sizes(dim_size: int, world_size: int) -> list[int]:
    step = max(dim_size // world_size, 1)
    sizes = [max(0, min(step, dim_size - rank * step)) for rank in range(world_size)]
    sizes[-1] += dim_size - sum(sizes)  # the remainder lands on the last rank
    return sizes


fault(
    "ref-rows-floor",
    "reference",
    "P1",
    "layout",
    f"{REF}:chunk_dim_sizes",
    "rows per rank are floor(dim0/ws) with the remainder on the last rank, not ceil(dim0/ws)",
    fast=True,
)(replace_with(_floor_chunk_dim_sizes))


def _floor_shard_offset(size, world_size, rank, dim=0):
    return rank * (size[dim] // world_size)


fault(
    "ref-offset-floor",
    "reference",
    "P1",
    "layout",
    f"{REF}:shard_offset",
    "a rank's rows start at rank*floor(dim0/ws) instead of rank*ceil(dim0/ws)",
    world_sizes=(3,),
)(replace_with(_floor_shard_offset))


def _garbage_padded_copy(original):
    def padded_copy(src, padded_size, dim):
        out = original(src, padded_size, dim)
        out.narrow(dim, src.size(dim), padded_size[dim] - src.size(dim)).fill_(7.0)
        return out

    return padded_copy


fault(
    "ref-padding-garbage",
    "reference",
    "P1",
    "layout",
    f"{REF}:_padded_copy",
    "the padding rows of the padded shard buffer hold 7.0 instead of zeros",
    world_sizes=(3,),
)(_garbage_padded_copy)


def _torch_garbage_padding(result, self, *args, **kwargs):
    with torch.no_grad():
        if self.fsdp_placement.dim == 0:
            self._sharded_param_data[self.sharded_size.numel() :].fill_(7.0)
    return result


fault(
    "t2-padding-garbage",
    "torch-fsdp2",
    "P1",
    "layout",
    f"{TORCH}:FSDPParam._init_sharded_param",
    "upstream: the padding of the padded shard buffer holds 7.0 instead of zeros",
    world_sizes=(3,),
)(wrap(after=_torch_garbage_padding))


# ------------------------------------------------------------------ states and resharding (P2, P4)
def _to_sharded_without_register(self):
    self.free_unsharded_param()
    self.sharded_state = type(self.sharded_state).SHARDED


fault(
    "ref-reshard-keeps-unsharded",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPParam.to_sharded",
    "resharding frees the unsharded parameter but leaves it registered on the module",
    fast=True,
)(replace_with(_to_sharded_without_register))
fault(
    "t2-reshard-keeps-unsharded",
    "torch-fsdp2",
    "P2",
    "states",
    f"{TORCH}:FSDPParam.to_sharded",
    "upstream: resharding leaves the unsharded parameter registered on the module",
)(replace_with(_to_sharded_without_register))


def _root_reshards(self, *args, **kwargs):
    self._auto_reshard_after_forward = False  # the root is then treated like an explicit True


fault(
    "ref-root-reshards-by-default",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPState._lazy_init",
    "reshard_after_forward=None reshards the root after forward too (root should keep params)",
)(wrap(before=_root_reshards))


def _no_grad_forward_keeps_unsharded(original):
    def post_forward(self, module, input, output):
        if torch.is_grad_enabled():
            return original(self, module, input, output)
        self._training_state = type(
            self._training_state
        ).IDLE  # no backward follows: reshard skipped
        return output

    return post_forward


fault(
    "ref-no-grad-fwd-keeps-unsharded",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPParamGroup.post_forward",
    "a forward under no_grad skips the post-forward reshard (every unit stays UNSHARDED), so an "
    "optimizer built after it holds plain tensors instead of the sharded parameters",
)(_no_grad_forward_keeps_unsharded)


def _post_forward_full_reshard(self):
    self.to_sharded()


fault(
    "ref-int-raf-full-reshard",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPParam.to_sharded_post_forward",
    "an int reshard_after_forward reshards onto the whole mesh (SHARDED, not the smaller group)",
    world_sizes=(4,),
)(replace_with(_post_forward_full_reshard))

fault(
    "ref-unsharded-not-freed",
    "reference",
    "P4",
    "states",
    f"{REF}:FSDPParam.free_unsharded_param",
    "resharding keeps the all-gather output's storage allocated",
)(replace_with(lambda self: None))
fault(
    "t2-unsharded-not-freed",
    "torch-fsdp2",
    "P4",
    "states",
    f"{TORCH}:FSDPParam.free_unsharded_param",
    "upstream: resharding keeps the all-gather output's storage allocated",
)(replace_with(lambda self: None))


def _forget_unsharded_param(self, *args, **kwargs):
    if hasattr(self, "_unsharded_param") and not hasattr(
        self.sharded_param._local_tensor, "fsdp_post_all_gather"
    ):
        del self._unsharded_param


fault(
    "ref-unsharded-param-recreated",
    "reference",
    "P4",
    "states",
    f"{REF}:FSDPParam.init_unsharded_param",
    "every unshard after the first builds a new unsharded Parameter instead of refilling it",
)(wrap(before=_forget_unsharded_param))


def _unshard_returns_none(result, *args, **kwargs):
    return None


fault(
    "ref-unshard-no-handle",
    "reference",
    "P18",
    "states",
    f"{REF}:FSDPModule.unshard",
    "unshard(async_op=True) returns None instead of a handle to wait on",
)(wrap(after=_unshard_returns_none))


# ------------------------------------------------------------------- all-gather copy-out (P7)
def _stacked_copy_out(original):
    def copy_out(result, fsdp_params, group, *args, **kwargs):
        original(result, fsdp_params, group, *args, **kwargs)
        ws = group.size()
        for fsdp_param in fsdp_params:
            d = fsdp_param.fsdp_placement.dim
            if d == 0:
                continue
            for out in fsdp_param.all_gather_outputs:
                full = out.view(fsdp_param._orig_size)
                stacked = torch.cat(torch.chunk(full, ws, d), dim=0).reshape(-1)
                with torch.autograd._unsafe_preserve_version_counter(out):
                    out.copy_(stacked)

    return copy_out


fault(
    "ref-copy-out-no-interleave",
    "reference",
    "P7",
    "placement",
    f"{REF}:foreach_all_gather_copy_out",
    "copy-out of a Shard(d!=0) parameter leaves the rank chunks stacked on dim 0",
)(_stacked_copy_out)


def _drop_second_extension_input(result, *args, **kwargs):
    return result[:1]


fault(
    "ref-extension-first-input-only",
    "reference",
    "P14",
    "extensions",
    f"{REF}:pre_all_gather",
    "an extension's fsdp_pre_all_gather returning several inputs gathers only the first",
    fast=True,
)(wrap(after=_drop_second_extension_input))


# -------------------------------------------------------- reduce-scatter and divide factors (P6)
def _sum_not_avg(result, *args, **kwargs):
    pre, post, rs_op, ar_op = result
    if rs_op == ReduceOp.AVG:
        return pre, post, ReduceOp.SUM, ReduceOp.SUM
    return result


fault(
    "ref-rs-sum-not-avg",
    "reference",
    "P6",
    "training",
    f"{REF}:_get_gradient_divide_factors",
    "fp32 gradients are reduce-scattered with SUM instead of AVG (not divided by ws)",
    fast=True,
)(wrap(after=_sum_not_avg))
fault(
    "t2-rs-sum-not-avg",
    "torch-fsdp2",
    "P6",
    "training",
    f"{TORCH}:_get_gradient_divide_factors",
    "upstream: fp32 gradients are reduce-scattered with SUM instead of AVG",
)(wrap(after=_sum_not_avg))


def _no_predivide(result, *args, **kwargs):
    pre, post, rs_op, ar_op = result
    reduce_dtype = args[2] if len(args) > 2 else kwargs.get("reduce_dtype")
    if reduce_dtype == torch.float16 and pre not in (None, 1):
        return None, post, rs_op, ar_op
    return result


fault(
    "ref-fp16-no-predivide",
    "reference",
    "P6",
    "training",
    f"{REF}:_get_gradient_divide_factors",
    "fp16 gradients skip the pre-divide (only the post-divide N/pre is applied)",
)(wrap(after=_no_predivide))

fault(
    "ref-divide-factor-ignored",
    "reference",
    "P6",
    "training",
    f"{REF}:FSDPModule.set_gradient_divide_factor",
    "set_gradient_divide_factor is accepted but the default divide factor stays in use",
)(replace_with(lambda self, factor: None))


def _arg_dropped(index: int, name: str):
    """``before`` hook of foreach_reduce that drops one positional/keyword argument to None."""

    def make(original):
        def foreach_reduce(*args, **kwargs):
            args = list(args)
            if len(args) > index:
                args[index] = None
            else:
                kwargs[name] = None
            return original(*args, **kwargs)

        return foreach_reduce

    return make


fault(
    "ref-hsdp-no-all-reduce",
    "reference",
    "P16",
    "placement",
    f"{REF}:foreach_reduce",
    "HSDP gradients are reduce-scattered over the shard group but never all-reduced over replicas",
    world_sizes=(4,),
)(_arg_dropped(7, "all_reduce_group"))


# ----------------------------------------------------------------------- mixed precision (P5)
def _cast_non_float(result, self, mp_policy, *args, **kwargs):
    if mp_policy.param_dtype is not None and not self.orig_dtype.is_floating_point:
        self.param_dtype = mp_policy.param_dtype


fault(
    "ref-mp-casts-int-params",
    "reference",
    "P5",
    "mixed_precision",
    f"{REF}:FSDPParam.init_dtype_attrs",
    "param_dtype is applied to a non-floating-point parameter too (it should stay as it is)",
    fast=True,
)(wrap(after=_cast_non_float))
fault(
    "t2-mp-casts-int-params",
    "torch-fsdp2",
    "P5",
    "mixed_precision",
    f"{TORCH}:FSDPParam.init_dtype_attrs",
    "upstream: param_dtype is applied to a non-floating-point parameter too",
)(wrap(after=_cast_non_float))

fault(
    "ref-mp-inputs-not-cast",
    "reference",
    "P5",
    "mixed_precision",
    f"{REF}:FSDPState._cast_forward_inputs",
    "forward inputs are not cast to param_dtype",
)(replace_with(lambda self, args, kwargs: (args, kwargs)))

fault(
    "ref-mp-reduce-dtype-ignored",
    "reference",
    "P5",
    "mixed_precision",
    f"{REF}:foreach_reduce",
    "the reduce-scatter runs in the gradient dtype, ignoring reduce_dtype",
)(_arg_dropped(4, "reduce_dtype"))


# ----------------------------------------------------------------------------- offload (P11)
def _stale_offloaded_input(prop):
    def all_gather_inputs(self):
        inputs = prop.fget(self)
        if not self.offload_to_cpu:
            return inputs
        if not hasattr(self, "_selftest_first_inputs"):
            self._selftest_first_inputs = [t.clone() for t in inputs]
        return self._selftest_first_inputs

    return property(all_gather_inputs)


fault(
    "ref-offload-stale-copy",
    "reference",
    "P11",
    "training",
    f"{REF}:FSDPParam.all_gather_inputs",
    "with CPU offload, every all-gather sends the copy made at the first one (stale after a step)",
    fast=True,
)(_stale_offloaded_input)


# --------------------------------------------------------------------- state dict (P8, P9)
fault(
    "ref-assign-load-not-repadded",
    "reference",
    "P9",
    "fsdp2_state_dict",
    f"{REF}:FSDPParam.reset_sharded_param",
    "load_state_dict(assign=True) does not re-pad or re-track the newly assigned parameters",
    fast=True,
)(replace_with(lambda self: None))
fault(
    "t2-assign-load-not-repadded",
    "torch-fsdp2",
    "P9",
    "fsdp2_state_dict",
    f"{TORCH}:FSDPParam.reset_sharded_param",
    "upstream: load_state_dict(assign=True) does not re-pad or re-track the new parameters",
)(replace_with(lambda self: None))


def _no_state_dict_hooks(original):
    def lazy_init(self):
        module_cls = torch.nn.Module
        saved = (
            module_cls.register_state_dict_pre_hook,
            module_cls._register_load_state_dict_pre_hook,
        )
        module_cls.register_state_dict_pre_hook = lambda *a, **k: None
        module_cls._register_load_state_dict_pre_hook = lambda *a, **k: None
        try:
            return original(self)
        finally:
            (
                module_cls.register_state_dict_pre_hook,
                module_cls._register_load_state_dict_pre_hook,
            ) = saved

    return lazy_init


fault(
    "ref-state-dict-not-resharded",
    "reference",
    "P8",
    "fsdp2_state_dict",
    f"{REF}:FSDPParamGroup.lazy_init",
    "state_dict()/load_state_dict() do not reshard first (after a raf=False forward they see "
    "the unsharded tensors)",
)(_no_state_dict_hooks)


# ----------------------------------------------------------- init errors and placements (P12, P13)
def _accept_uneven(original):
    def resolve(param, placement_fn, mesh_info):
        try:
            return original(param, placement_fn, mesh_info)
        except NotImplementedError as exc:
            if "uneven" not in str(exc):
                raise
            placement = placement_fn(param)
            return type(placement)(placement.dim % param.ndim)

    return resolve


fault(
    "ref-uneven-dim-accepted",
    "reference",
    "P13",
    "placement",
    f"{REF}:_resolve_shard_placement",
    "Shard(d!=0) on a dim the world size does not divide is accepted instead of rejected",
    fast=True,
)(_accept_uneven)


def _managed_states_without_checks(modules, ignored_params):
    ignored = ignored_params or set()
    params, buffers = [], []
    for module in modules:
        params += [p for p in module.parameters(recurse=False) if p not in ignored]
        buffers += list(module.buffers(recurse=False))
    seen, unique = set(), []  # the bug: no check for 0-d parameters
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique, buffers


fault(
    "ref-scalar-param-accepted",
    "reference",
    "P12",
    "bad_input",
    f"{REF}:_get_managed_states",
    "a scalar (0-d) parameter is sharded instead of rejected with a ValueError",
)(replace_with(_managed_states_without_checks))


def _shared_twice(original):
    def get_managed_states(modules, ignored_params):
        params, buffers = original(modules, ignored_params)
        managed, out = {id(p) for p in params}, []
        for module in modules:  # one entry per (module, name): a shared parameter twice
            out += [p for p in module.parameters(recurse=False) if id(p) in managed]
        return out, buffers

    return get_managed_states


fault(
    "ref-shared-param-twice",
    "reference",
    "P17",
    "state_dict",
    f"{REF}:_get_managed_states",
    "a parameter shared by two modules is managed twice (once per owner) instead of once",
)(_shared_twice)


# ------------------------------------------------------------------ tensor parallel (P15, P3)
def _plain_dp_shard(original):
    def init_sharding_spec(self, param):
        from dataclasses import replace

        from torch.distributed.tensor import Shard

        spec = original(self, param)
        if self._tp_spec is None:
            return spec
        return replace(spec, placements=(Shard(0), *spec.placements[1:]))

    return init_sharding_spec


fault(
    "ref-tp-plain-dp-shard",
    "reference",
    "P15",
    "tensor_parallel",
    f"{REF}:FSDPParam._init_sharding_spec",
    "a TP parameter whose TP shard is on dim 0 gets a plain Shard(0) dp placement instead of "
    "_StridedShard, so its global rows are mislabelled",
    world_sizes=(4,),
)(_plain_dp_shard)


def _tp_reshard_to_smaller_mesh(original):
    def to_sharded_post_forward(self):
        tp_spec, self._tp_spec = self._tp_spec, None
        try:
            return original(self)
        finally:
            self._tp_spec = tp_spec

    return to_sharded_post_forward


fault(
    "ref-tp-smaller-mesh-reshard",
    "reference",
    "P3",
    "tensor_parallel",
    f"{REF}:FSDPParam.to_sharded_post_forward",
    "an int reshard_after_forward reshards a TP parameter onto a smaller mesh instead of raising "
    "NotImplementedError",
    world_sizes=(4,),
)(_tp_reshard_to_smaller_mesh)


# ------------------------------------------------------------ parameter subclasses (P14)
def _pad_with_new_empty(original):
    def padded_copy(src, padded_size, dim):
        with torch.no_grad():
            out, length = src.new_empty(padded_size), src.size(dim)
            out.narrow(dim, 0, length).copy_(src)
            out.narrow(dim, length, padded_size[dim] - length).zero_()
            return out

    return padded_copy


fault(
    "ref-subclass-new-empty",
    "reference",
    "P14",
    "param_subclass",
    f"{REF}:_padded_copy",
    "padding asks a parameter subclass for aten.new_empty + zero_, ops upstream FSDP2 never "
    "uses on it",
    world_sizes=(2,),
)(_pad_with_new_empty)


# ---------------------------------------------------------------- unused parameters (P19)
def _zero_grads_for_unused(self, *args, **kwargs):
    for fsdp_param in self.fsdp_params:
        if not hasattr(fsdp_param, "_unsharded_param"):
            continue
        unsharded = fsdp_param.unsharded_param
        if fsdp_param.unsharded_accumulated_grad is None and unsharded.grad is None:
            unsharded.grad = torch.zeros_like(unsharded)  # the bug: reduce a zero gradient


fault(
    "ref-unused-param-zero-grad",
    "reference",
    "P19",
    "training",
    f"{REF}:FSDPParamGroup.post_backward",
    "a parameter the forward did not use gets a zero gradient instead of None (weight decay and "
    "momentum then move it)",
)(wrap(before=_zero_grads_for_unused))


def _reduce_unused(self, *args, **kwargs):
    self.reduce_scatter_unused_params = True  # the bug: as if the user had asked for it


fault(
    "torch-unused-param-zero-grad",
    "torch-fsdp2",
    "P19",
    "training",
    f"{TORCH}:FSDPParamGroup.post_backward",
    "upstream: unused parameters are reduce-scattered as zero gradients without "
    "set_reduce_scatter_unused_params(True)",
)(wrap(before=_reduce_unused))
fault(
    "ref-reduce-unused-ignored",
    "reference",
    "P19",
    "training",
    f"{REF}:FSDPModule.set_reduce_scatter_unused_params",
    "set_reduce_scatter_unused_params(True) is ignored: unused parameters keep .grad None",
)(replace_with(lambda self, reduce_scatter_unused_params, *, recurse=True: None))
fault(
    "ref-raf-setter-no-recurse",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPModule.set_reshard_after_forward",
    "set_reshard_after_forward(flag) changes the unit it is called on only, never the units below",
)(
    lambda original: (
        lambda self, reshard_after_forward, recurse=True: original(
            self, reshard_after_forward, recurse=False
        )
    )
)
fault(
    "ref-rab-setter-ignored",
    "reference",
    "P2",
    "states",
    f"{REF}:FSDPModule.set_reshard_after_backward",
    "set_reshard_after_backward(False) is ignored: parameters are resharded after backward",
)(replace_with(lambda self, reshard_after_backward, *, recurse=True: None))


# ------------------------------------------------------ HSDP accumulation knobs (P26, issue 24)
def _drop_partial_reduce_output(original):
    import inspect

    signature = inspect.signature(original)

    def foreach_reduce(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("all_reduce_grads"):
            bound.arguments["partial_reduce_output"] = None  # the bug: what was held back is lost
        return original(*bound.args, **bound.kwargs)

    return foreach_reduce


fault(
    "t2-hsdp-held-back-dropped",
    "torch-fsdp2",
    "P26",
    "training",
    f"{TORCH}:foreach_reduce",
    "upstream HSDP: the backward with the all-reduce back on drops the reductions held back by "
    "set_requires_all_reduce(False) (the gradient owes only its own micro-batch)",
    world_sizes=(4,),
)(_drop_partial_reduce_output)


def _always_all_reduce(self, requires_all_reduce, *, recurse=True):
    return None  # the bug: the knob is ignored, every backward all-reduces and writes .grad


fault(
    "t2-hsdp-all-reduce-knob-ignored",
    "torch-fsdp2",
    "P26",
    "training",
    "torch.distributed.fsdp:FSDPModule.set_requires_all_reduce",
    "upstream HSDP: set_requires_all_reduce(False) is ignored (each backward all-reduces)",
    world_sizes=(2,),
)(replace_with(_always_all_reduce))


# ------------------------------------ torch.distributed.checkpoint.state_dict options (P27-P29)
DSD = "torch.distributed.checkpoint"


def _others_keep_their_values(original):
    import sys

    def load(model, state_dict, info):
        module = sys.modules["torch.distributed.checkpoint.state_dict"]
        broadcast = module._broadcast_state_dict

        def received_but_dropped(full, local, *args, **kwargs):
            import torch.distributed as dist

            # the bug: ranks other than 0 take part in the broadcast but keep their own values
            target = local if dist.get_rank() == 0 else {k: v.clone() for k, v in local.items()}
            return broadcast(full, target, *args, **kwargs)

        module._broadcast_state_dict = received_but_dropped
        try:
            return original(model, state_dict, info)
        finally:
            module._broadcast_state_dict = broadcast

    return load


fault(
    "t2-dsd-broadcast-dropped",
    "torch-fsdp2",
    "P28",
    "fsdp2_state_dict",
    f"{DSD}:_load_model_state_dict",
    "upstream DSD: with broadcast_from_rank0 the ranks other than 0 receive rank 0's tensors but "
    "keep their own values",
)(_others_keep_their_values)


def _strict_always(info, *args, **kwargs):
    info.strict = True  # the bug: StateDictOptions(strict=False) is ignored
    return info


fault(
    "t2-dsd-strict-ignored",
    "torch-fsdp2",
    "P28",
    "fsdp2_state_dict",
    f"{DSD}:_verify_options",
    "upstream DSD: StateDictOptions(strict=False) is ignored (a dict with a missing or extra key "
    "is refused)",
)(wrap(after=_strict_always))


def _optim_full_left_local(result, model, optimizers, info):
    import torch.distributed as dist

    if info.full_state_dict:  # the bug: each rank's "full" optimizer state is its own chunk
        for state in result.get("state", {}).values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    rows = torch.chunk(value, dist.get_world_size())
                    state[key] = (
                        rows[dist.get_rank()].clone() if dist.get_rank() < len(rows) else value[:0]
                    )
    return result


fault(
    "t2-dsd-optim-full-not-gathered",
    "torch-fsdp2",
    "P29",
    "fsdp2_state_dict",
    f"{DSD}:_get_optim_state_dict",
    "upstream DSD: get_optimizer_state_dict(full_state_dict=True) leaves each rank's chunk of "
    "exp_avg / exp_avg_sq instead of the full tensors",
)(wrap(after=_optim_full_left_local))


def _frozen_kept(info, *args, **kwargs):
    info.ignore_frozen_params = (
        False  # the bug: StateDictOptions(ignore_frozen_params=True) ignored
    )
    return info


fault(
    "t2-dsd-ignore-frozen-ignored",
    "torch-fsdp2",
    "P27",
    "fsdp2_state_dict",
    f"{DSD}:_verify_options",
    "upstream DSD: StateDictOptions(ignore_frozen_params=True) still saves frozen parameters",
)(wrap(after=_frozen_kept))


fault(
    "t2-all-reduce-hook-ignored",
    "torch-fsdp2",
    "P26",
    "training",
    "torch.distributed.fsdp:FSDPModule.set_all_reduce_hook",
    "upstream: set_all_reduce_hook(hook) is accepted but the hook never runs",
    world_sizes=(2,),
)(replace_with(lambda self, hook, *, stream=None: None))


fault(
    "t2-forward-method-not-registered",
    "torch-fsdp2",
    "P30",
    "states",
    "torch.distributed.fsdp:register_fsdp_forward_method",
    "upstream: register_fsdp_forward_method does nothing (the method runs on sharded parameters)",
)(replace_with(lambda module, method_name: None))
