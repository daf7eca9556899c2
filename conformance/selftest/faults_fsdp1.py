"""Seeded faults in FSDP1 (``FullyShardedDataParallel``) and the auto-wrap utilities: the
reference's and upstream torch's.

Behaviour ids: S1 keys, S3 rank0_only, S5/S7 sharded and local values, S8 world size 1, S9 the
state_dict_type context, S11 incompatible keys, S12 buffers; W1-W16 wrap policies and decisions;
FSDP1's flat-parameter layout and gradient averaging.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from conformance.selftest.faults import fault, replace_with, wrap

REF1 = "reference._fsdp1"
WRAP = "reference.wrap"
TORCH = "torch.distributed.fsdp"
FSDP_PREFIX = "_fsdp_wrapped_module."


# ----------------------------------------------------------------------- flat-parameter layout
def _garbage_flat_padding(result, self, *args, **kwargs):
    flat = self.flat_param
    pad = getattr(flat, "_shard_numel_padded", 0)
    if pad:
        with torch.no_grad():
            flat.data[flat.numel() - pad :].fill_(7.0)
    return result


fault(
    "r1-flat-padding-garbage",
    "reference-fsdp1",
    "S7",
    "layout",
    f"{REF1}:FlatParamHandle._init_flat_param",
    "the padding at the end of a rank's flat shard holds 7.0 instead of zeros",
    fast=True,
)(wrap(after=_garbage_flat_padding))


def _torch_garbage_get_shard(original):
    function = original.__func__ if isinstance(original, staticmethod) else original

    def get_shard(tensor, rank, world_size):
        shard, numel_to_pad = function(tensor, rank, world_size)
        if numel_to_pad:
            shard[shard.numel() - numel_to_pad :].fill_(7.0)
        return shard, numel_to_pad

    return staticmethod(get_shard)


fault(
    "t1-flat-padding-garbage",
    "torch-fsdp1",
    "S7",
    "layout",
    f"{TORCH}:FlatParamHandle._get_shard",
    "upstream: the padding at the end of a rank's flat shard holds 7.0 instead of zeros",
    world_sizes=(3,),
)(_torch_garbage_get_shard)


def _summed_grads(result, self, *args, **kwargs):
    return result * self.world_size


fault(
    "r1-grads-summed",
    "reference-fsdp1",
    "P6",
    "state_dict",
    f"{REF1}:FlatParamHandle._reduce_grad",
    "FSDP1 flat gradients are summed over ranks, not averaged (training drifts from the oracle)",
)(wrap(after=_summed_grads))


# ----------------------------------------------------------------------------- state dicts
def _keep_fsdp_prefix(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


fault(
    "r1-keys-keep-prefix",
    "reference-fsdp1",
    "S1",
    "state_dict",
    f"{REF1}:clean_tensor_name",
    "state-dict keys keep FSDP's '_fsdp_wrapped_module.' prefix",
    fast=True,
)(replace_with(_keep_fsdp_prefix))
fault(
    "t1-keys-keep-prefix",
    "torch-fsdp1",
    "S1",
    "state_dict",
    f"{TORCH}:clean_tensor_name",
    "upstream: state-dict keys keep FSDP's '_fsdp_wrapped_module.' prefix",
)(replace_with(_keep_fsdp_prefix))


def _rank0_only_dropped(result, self, *args, **kwargs):
    self.rank0_only = False


fault(
    "r1-rank0-only-ignored",
    "reference-fsdp1",
    "S3",
    "state_dict",
    "reference:FullStateDictConfig.__init__",
    "FullStateDictConfig(rank0_only=True) is ignored: every rank gets the full dict",
)(wrap(after=_rank0_only_dropped))
fault(
    "t1-rank0-only-ignored",
    "torch-fsdp1",
    "S3",
    "state_dict",
    f"{TORCH}:FullStateDictConfig.__init__",
    "upstream: FullStateDictConfig(rank0_only=True) is ignored: every rank gets the full dict",
)(wrap(after=_rank0_only_dropped))


def _low_precision_buffers_ref(result, state, state_dict, prefix, *args, **kwargs):
    mp = state.mixed_precision
    if mp is not None and mp.buffer_dtype is not None:
        for fqn, *_ in state._owned_buffers:
            value = state_dict.get(prefix + fqn)
            if value is not None and value.is_floating_point():
                state_dict[prefix + fqn] = value.to(mp.buffer_dtype)
    return result


fault(
    "r1-buffers-low-precision",
    "reference-fsdp1",
    "S12",
    "state_dict",
    f"{REF1}:_unshard_post_state_dict",
    "with buffer mixed precision, buffers are saved in buffer_dtype instead of their own dtype",
)(wrap(after=_low_precision_buffers_ref))


def _low_precision_buffers_torch(result, module, fsdp_state, state_dict, prefix, *args, **kwargs):
    dtype = getattr(fsdp_state.mixed_precision, "buffer_dtype", None)
    if dtype is not None:
        names = {prefix + n.replace(FSDP_PREFIX, "") for n, _ in module.named_buffers()}
        for key in names & set(result):
            if result[key].is_floating_point():
                result[key] = result[key].to(dtype)
    return result


fault(
    "t1-buffers-low-precision",
    "torch-fsdp1",
    "S12",
    "state_dict",
    f"{TORCH}:_full_post_state_dict_hook",
    "upstream: with buffer mixed precision, FULL dicts hold buffers in buffer_dtype",
)(wrap(after=_low_precision_buffers_torch))


def _local_with_padding(original):
    def local_post_state_dict(state, state_dict, prefix):
        handle = state._handle
        if handle is None:
            return None
        flat = handle.flat_param
        saved = flat._shard_numel_padded
        flat._shard_numel_padded = 0  # the bug: the padding is saved as if it were data
        try:
            return original(state, state_dict, prefix)
        finally:
            flat._shard_numel_padded = saved

    return local_post_state_dict


fault(
    "r1-local-keeps-padding",
    "reference-fsdp1",
    "S7",
    "state_dict",
    f"{REF1}:_local_post_state_dict",
    "LOCAL_STATE_DICT keeps the flat shard's padding in the saved local shard",
    world_sizes=(3,),
)(_local_with_padding)


def _drop_empty_flat_param(result, state, state_dict, prefix):
    handle = state._handle
    if handle is not None and handle.flat_param._unpadded_unsharded_size.numel() == 0:
        state_dict.pop(prefix + "_flat_param", None)  # the bug: an empty unit saves no entry
    return result


fault(
    "r1-local-drops-empty-unit",
    "reference-fsdp1",
    "S6",
    "state_dict",
    f"{REF1}:_local_post_state_dict",
    "LOCAL_STATE_DICT leaves out the flat parameter of a unit with no elements",
    world_sizes=(2,),
)(wrap(after=_drop_empty_flat_param))


def _type_not_restored(original):
    @contextlib.contextmanager
    def state_dict_type(module, state_dict_type, state_dict_config=None, *args, **kwargs):
        fsdp_cls = next(
            type(m) for m in module.modules() if hasattr(type(m), "set_state_dict_type")
        )
        fsdp_cls.set_state_dict_type(module, state_dict_type, state_dict_config, *args, **kwargs)
        yield  # the bug: the previous type is never restored

    return staticmethod(state_dict_type)


fault(
    "r1-state-dict-type-leaks",
    "reference-fsdp1",
    "S9",
    "state_dict",
    f"{REF1}:FullyShardedDataParallel.state_dict_type",
    "FSDP.state_dict_type(...) does not restore the previous type on exit",
)(_type_not_restored)
fault(
    "t1-state-dict-type-leaks",
    "torch-fsdp1",
    "S9",
    "state_dict",
    f"{TORCH}:FullyShardedDataParallel.state_dict_type",
    "upstream: FSDP.state_dict_type(...) does not restore the previous type on exit",
)(_type_not_restored)


def _uncleaned_incompatible_keys(original):
    def post_load_hook(module, incompatible_keys):
        missing, unexpected = incompatible_keys
        before = list(missing), list(unexpected)
        original(module, incompatible_keys)
        missing[:], unexpected[:] = before

    return post_load_hook


fault(
    "r1-incompatible-keys-uncleaned",
    "reference-fsdp1",
    "S11",
    "state_dict",
    f"{REF1}:_post_load_state_dict_hook",
    "load_state_dict(strict=False) reports missing/unexpected keys with FSDP's wrapper prefix",
)(_uncleaned_incompatible_keys)

fault(
    "r1-load-not-validated",
    "reference-fsdp1",
    "S5",
    "state_dict",
    f"{REF1}:_validate_load_input",
    "a FULL/SHARDED/LOCAL load does not validate keys, shapes and types before copying",
)(replace_with(lambda *args, **kwargs: None))


def _no_clamp(strategy, world_size):
    from reference import ShardingStrategy

    return strategy or ShardingStrategy.FULL_SHARD


fault(
    "r1-ws1-not-clamped",
    "reference-fsdp1",
    "S8",
    "state_dict",
    f"{REF1}:_clamp_strategy",
    "at world size 1 the sharding strategy is not clamped to NO_SHARD",
    world_sizes=(1,),
)(replace_with(_no_clamp))


# -------------------------------------------------------------------- wrap policies (W1-W13)
def _size_policy(min_delta=0, no_exclude=False, no_force_leaf=False):
    def make(original):
        @functools.wraps(original)
        def size_based_auto_wrap_policy(
            module,
            recurse,
            nonwrapped_numel,
            min_num_params=int(1e8),
            force_leaf_modules=None,
            exclude_wrap_modules=None,
        ):
            if no_exclude and exclude_wrap_modules is None:
                exclude_wrap_modules = set()
            if no_force_leaf and force_leaf_modules is None:
                force_leaf_modules = set()
            return original(
                module,
                recurse,
                nonwrapped_numel,
                min_num_params + min_delta,
                force_leaf_modules,
                exclude_wrap_modules,
            )

        return size_based_auto_wrap_policy

    return make


fault(
    "w-size-threshold-strict",
    "reference-fsdp1",
    "W1",
    "wrap",
    f"{WRAP}:size_based_auto_wrap_policy",
    "size_based_auto_wrap_policy wraps only above min_num_params (> instead of >=)",
    fast=True,
)(_size_policy(min_delta=1))
fault(
    "t1-size-threshold-strict",
    "torch-fsdp1",
    "W1",
    "wrap",
    f"{TORCH}:size_based_auto_wrap_policy",
    "upstream: size_based_auto_wrap_policy wraps only above min_num_params",
    world_sizes=(1,),
)(_size_policy(min_delta=1))
fault(
    "w-containers-wrapped",
    "reference",
    "W3",
    "wrap",
    f"{WRAP}:size_based_auto_wrap_policy",
    "size_based_auto_wrap_policy's default no longer excludes ModuleList/ModuleDict",
    world_sizes=(1,),
)(_size_policy(no_exclude=True))
fault(
    "w-attention-recursed",
    "reference-fsdp1",
    "W4",
    "wrap",
    f"{WRAP}:size_based_auto_wrap_policy",
    "size_based_auto_wrap_policy's default no longer treats MultiheadAttention as a leaf",
    world_sizes=(1,),
)(_size_policy(no_force_leaf=True))


def _custom_policy_dict_replaces(self, root_module, ignored_modules, root_kwargs):
    targets = {}
    for module in root_module.modules():
        answer = module not in ignored_modules and self._lambda_fn(module)
        if answer:  # the bug: a dict answer replaces the root kwargs instead of updating them
            targets[module] = dict(answer) if isinstance(answer, dict) else dict(root_kwargs)
    return targets


fault(
    "w-custom-dict-replaces",
    "reference",
    "W10",
    "wrap",
    f"{WRAP}:CustomPolicy._run_policy",
    "a CustomPolicy dict answer replaces the root kwargs instead of updating a copy of them",
    world_sizes=(1,),
)(replace_with(_custom_policy_dict_replaces))

fault(
    "w-mp-override-silent",
    "reference-fsdp1",
    "W11",
    "wrap",
    f"{WRAP}:_warn_on_overridden_mixed_precision",
    "the batch-norm mixed-precision override happens without its UserWarning",
    world_sizes=(1,),
)(replace_with(lambda classes: None))
fault(
    "w-mp-override-skipped",
    "reference",
    "W11",
    "wrap",
    f"{WRAP}:_run_mixed_precision_override_policy",
    "mixed precision + a policy no longer splits batch norms into fp32 units",
    world_sizes=(1,),
)(replace_with(lambda root, classes, ignored, kwargs, targets: targets))
fault(
    "w-frozen-not-validated",
    "reference-fsdp1",
    "W12",
    "wrap",
    f"{WRAP}:_validate_frozen_params",
    "a unit mixing frozen and trainable parameters is neither rejected nor warned about",
    world_sizes=(1,),
)(replace_with(lambda *args, **kwargs: None))
fault(
    "w-already-wrapped-allowed",
    "reference-fsdp1",
    "W6",
    "wrap",
    f"{WRAP}:_check_nested_wrapping",
    "auto-wrapping a tree that already holds an FSDP module is not rejected",
    world_sizes=(1,),
)(replace_with(lambda root: None))


def _overrides_dropped(original):
    def wrap_fn(module, **wrap_overrides):
        return original(module)  # the bug: per-call overrides are dropped

    return wrap_fn


fault(
    "w-wrap-overrides-dropped",
    "reference-fsdp1",
    "W7",
    "wrap",
    f"{WRAP}:wrap",
    "wrap(module, **overrides) inside enable_wrap ignores the per-call overrides",
    world_sizes=(1,),
)(_overrides_dropped)


def _parents_first(original):
    def post_order_apply(root_module, fn):
        parents = {
            child: (parent, name)
            for parent in root_module.modules()
            for name, child in parent.named_children()
        }
        for module in list(root_module.modules())[1:]:  # the bug: pre-order, parents first
            replacement = fn(module)
            if replacement is not None:
                setattr(*parents[module], replacement)
        fn(root_module)

    return post_order_apply


fault(
    "w-pre-order-apply",
    "reference",
    "W13",
    "wrap",
    f"{WRAP}:_post_order_apply",
    "the policy walk visits parents before their children (pre-order), changing the units",
    world_sizes=(1,),
)(_parents_first)


def _ignored_params_counted(original):
    def module_to_states(root_module, auto_wrap_policy, ignored_modules, ignored_params, **kw):
        return original(root_module, auto_wrap_policy, ignored_modules, set(), **kw)

    return module_to_states


fault(
    "w-states-ignored-params-owned",
    "reference-fsdp1",
    "W16",
    "wrap",
    f"{WRAP}:_get_fully_sharded_module_to_states",
    "the module->states grouping hands ignored parameters to the units",
    world_sizes=(1,),
)(_ignored_params_counted)


# ------------------------------------------------------------------ unused parameters (R1)
def _drop_zero_grad_views(result, self, *args, **kwargs):
    for param in self._orig_params if hasattr(self, "_orig_params") else self.flat_param._params:
        if param.grad is not None and param.grad.numel() and not param.grad.abs().max().item():
            param.grad = None  # the bug: an unused parameter's zero view is dropped
    return result


fault(
    "r1-unused-grad-view-dropped",
    "reference-fsdp1",
    "R1",
    "training",
    f"{REF1}:FlatParamHandle._use_sharded_grad_views",
    "use_orig_params=True: an unused parameter gets .grad None instead of its zero view of the "
    "flat gradient",
)(wrap(after=_drop_zero_grad_views))
fault(
    "t1-unused-grad-view-dropped",
    "torch-fsdp1",
    "R1",
    "training",
    f"{TORCH}:FlatParamHandle._use_sharded_grad_views",
    "upstream, use_orig_params=True: an unused parameter gets .grad None instead of its zero view "
    "of the flat gradient",
)(wrap(after=_drop_zero_grad_views))


# ------------------------------------------------------------------ clip_grad_norm_ (R2)
class _CollectiveShim:
    """Stands in for ``torch.distributed`` in one module: ``all_reduce`` is broken as told, the
    rest is the real module."""

    def __init__(self, real, mode: str):
        self._real, self._mode = real, mode

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        if self._mode == "skip":
            return None  # the bug: the local value is taken for the global one
        return self._real.all_reduce(tensor, group=group)  # the bug: always SUM

    def __getattr__(self, name):
        return getattr(self._real, name)


def _broken_all_reduce(module_name: str, mode: str):
    def make(original):
        def replacement(*args, **kwargs):
            import importlib

            module = importlib.import_module(module_name)
            real = module.dist
            module.dist = _CollectiveShim(real, mode)
            try:
                return original(*args, **kwargs)
            finally:
                module.dist = real

        return replacement

    return make


fault(
    "r1-clip-local-norm",
    "reference-fsdp1",
    "R2",
    "fsdp1_runtime",
    f"{REF1}:_clip_grad_norm",
    "clip_grad_norm_ clips each rank by the norm of its own shard (the all-reduce is missing)",
)(_broken_all_reduce("reference._fsdp1._clip_grad_utils", "skip"))
fault(
    "r1-clip-inf-summed",
    "reference-fsdp1",
    "R2",
    "fsdp1_runtime",
    f"{REF1}:_clip_grad_norm",
    "clip_grad_norm_ with norm_type=inf sums the ranks' maxima instead of taking the largest",
)(_broken_all_reduce("reference._fsdp1._clip_grad_utils", "sum"))
fault(
    "t1-clip-local-norm",
    "torch-fsdp1",
    "R2",
    "fsdp1_runtime",
    f"{TORCH}:FullyShardedDataParallel.clip_grad_norm_",
    "upstream: clip_grad_norm_ clips each rank by the norm of its own shard (no all-reduce)",
)(_broken_all_reduce("torch.distributed.fsdp.fully_sharded_data_parallel", "skip"))


def _unclamped_clip(original):
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        # the bug: the factor max_norm / total is not clamped to 1, so small gradients grow
        total = original(self, float("inf"), norm_type)
        factor = max_norm / (total.float() + 1e-6)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))
        return total

    return clip_grad_norm_


fault(
    "r1-clip-factor-unclamped",
    "reference-fsdp1",
    "R2",
    "fsdp1_runtime",
    f"{REF1}:FullyShardedDataParallel.clip_grad_norm_",
    "clip_grad_norm_ scales by max_norm / total even when that is above 1 (gradients grow)",
)(_unclamped_clip)


# ------------------------------------------------------------- class policies, subclasses (W17)
def _exact_type_targets(original):
    def _run_policy(self, root_module, ignored_modules, root_kwargs):
        targets = original(self, root_module, ignored_modules, root_kwargs)
        # the bug: type(m) in classes, so a subclass of a listed block is not wrapped
        return {m: kw for m, kw in targets.items() if type(m) in set(self._module_classes)}

    return _run_policy


def _exact_type_callable(original):
    def policy(module, module_classes, recurse, *args, **kwargs):
        return recurse or type(module) in set(module_classes)  # the bug: exact type match

    return policy


def _torch_exact_type_callable(original):
    def _module_wrap_policy(module, recurse, nonwrapped_numel, module_classes):
        return recurse or type(module) in set(module_classes)  # the bug: exact type match

    return _module_wrap_policy


fault(
    "w-module-policy-exact-type",
    "reference-fsdp1",
    "W17",
    "wrap",
    f"{WRAP}:ModuleWrapPolicy._run_policy",
    "ModuleWrapPolicy wraps only modules whose type is exactly a listed class (not subclasses)",
)(_exact_type_targets)
fault(
    "w-class-callable-exact-type",
    "reference-fsdp1",
    "W17",
    "wrap",
    f"{WRAP}:_wrap_module_cls_individually",
    "transformer_auto_wrap_policy / ModuleWrapPolicy as a callable match the exact type only",
)(_exact_type_callable)
fault(
    "tw-module-policy-exact-type",
    "torch-fsdp1",
    "W17",
    "wrap",
    f"{TORCH}:ModuleWrapPolicy._run_policy",
    "upstream: ModuleWrapPolicy wraps only modules whose type is exactly a listed class",
)(_exact_type_targets)
fault(
    "tw-class-callable-exact-type",
    "torch-fsdp1",
    "W17",
    "wrap",
    f"{TORCH}:_module_wrap_policy",
    "upstream: transformer_auto_wrap_policy / ModuleWrapPolicy as a callable match the exact type",
)(_torch_exact_type_callable)


# ------------------------------------------------------------ summon_full_params (R3-R5)
def _forced_argument(name: str, value, position: int):
    """``make`` that calls the original with argument ``name`` (positional index ``position``
    when passed positionally) forced to ``value``."""

    def make(original):
        def replacement(*args, **kwargs):
            if name in kwargs or len(args) <= position:
                kwargs[name] = value
            else:
                args = (*args[:position], value, *args[position + 1 :])
            return original(*args, **kwargs)

        return replacement

    return make


fault(
    "r1-summon-writeback-always",
    "reference-fsdp1",
    "R3",
    "fsdp1_runtime",
    f"{REF1}:_unshard_fsdp_state_params",
    "summon_full_params(writeback=False) keeps the changes made inside (writes back anyway)",
)(_forced_argument("writeback", True, 1))
fault(
    "r1-summon-writeback-never",
    "reference-fsdp1",
    "R3",
    "fsdp1_runtime",
    f"{REF1}:_unshard_fsdp_state_params",
    "summon_full_params(writeback=True) discards the changes made inside",
)(_forced_argument("writeback", False, 1))
fault(
    "r1-summon-rank0-only-ignored",
    "reference-fsdp1",
    "R4",
    "fsdp1_runtime",
    f"{REF1}:_unshard_fsdp_state_params",
    "summon_full_params(rank0_only=True) unshards on every rank, not only on rank 0",
)(_forced_argument("rank0_only", False, 2))
fault(
    "r1-summon-with-grads-ignored",
    "reference-fsdp1",
    "R4",
    "fsdp1_runtime",
    f"{REF1}:FlatParamHandle.use_unsharded_grad_views",
    "summon_full_params(with_grads=True) leaves the sharded gradients in place of the full ones",
)(replace_with(lambda self: None))
fault(
    "r1-summon-recurse-ignored",
    "reference-fsdp1",
    "R5",
    "fsdp1_runtime",
    f"{REF1}:_unshard_params",
    "summon_full_params(recurse=False) unshards the nested units too",
)(_forced_argument("recurse", True, 1))
fault(
    "t1-summon-writeback-never",
    "torch-fsdp1",
    "R3",
    "fsdp1_runtime",
    f"{TORCH}:_writeback_to_local_shard",
    "upstream: summon_full_params(writeback=True) discards the changes made inside",
)(replace_with(lambda handle, writeback_grad: None))
fault(
    "t1-summon-rank0-only-ignored",
    "torch-fsdp1",
    "R4",
    "fsdp1_runtime",
    f"{TORCH}:_unshard_fsdp_state_params",
    "upstream: summon_full_params(rank0_only=True) unshards on every rank",
)(_forced_argument("rank0_only", False, 3))
fault(
    "r1-summon-recurse-dropped",
    "reference-fsdp1",
    "R3",
    "fsdp1_runtime",
    f"{REF1}:_unshard_params",
    "summon_full_params(recurse=True) unshards only the given module's own unit (none for a "
    "module that is not FSDP itself)",
)(_forced_argument("recurse", False, 1))


def _packed_used_grads(original):
    def _reduce_grad(self, grad_padded):
        # the bug: the unsharded flat gradient is packed from the parameters that got a gradient
        # (all-zero segments dropped, zeros appended), so later parameters shift into the gaps
        fp = self.flat_param
        n = fp._unpadded_unsharded_size.numel()
        segments = torch.split(grad_padded[:n], list(fp._numels_with_padding))
        kept = [s for s in segments if s.abs().max().item() if s.numel()]
        packed = torch.cat(kept) if kept else grad_padded[:0]
        fill = grad_padded.new_zeros(grad_padded.numel() - packed.numel())
        return original(self, torch.cat([packed, fill]))

    return _reduce_grad


fault(
    "r1-unused-flat-grad-packed",
    "reference-fsdp1",
    "R1",
    "training",
    f"{REF1}:FlatParamHandle._reduce_grad",
    "the flat gradient drops unused parameters' (zero) ranges and packs the rest, shifting later "
    "parameters' gradients",
)(_packed_used_grads)


# ------------------------------------------- sharding strategies other than FULL_SHARD (R19, R20)
def _sgo_frees_after_forward(original):
    def post_forward_reshard(state, handle):
        strategy = getattr(handle, "_sharding_strategy", None)
        if strategy is None or strategy.name not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2"):
            return original(state, handle)
        handle._sharding_strategy = type(strategy).FULL_SHARD  # the bug: freed like FULL_SHARD
        try:
            return original(state, handle)
        finally:
            handle._sharding_strategy = strategy

    return post_forward_reshard


fault(
    "t1-shard-grad-op-frees-after-forward",
    "torch-fsdp1",
    "R19",
    "training",
    f"{TORCH}:_post_forward_reshard",
    "upstream: SHARD_GRAD_OP (and _HYBRID_SHARD_ZERO2) free the gathered parameters after "
    "forward, so backward all-gathers them again",
)(_sgo_frees_after_forward)


def _no_inter_node_all_reduce(original):
    def reduce_grad(state, handle):
        import torch.distributed as dist

        inter = getattr(state, "_inter_node_pg", None)
        all_reduce = dist.all_reduce

        def skip_inter_node(tensor, *args, group=None, **kwargs):
            if inter is not None and group is inter:
                return None  # the bug: the replicas never average their gradients
            return all_reduce(tensor, *args, group=group, **kwargs)

        dist.all_reduce = skip_inter_node
        try:
            return original(state, handle)
        finally:
            dist.all_reduce = all_reduce

    return reduce_grad


fault(
    "t1-hybrid-skips-replicate-all-reduce",
    "torch-fsdp1",
    "R20",
    "training",
    f"{TORCH}:_reduce_grad",
    "upstream HYBRID_SHARD: the gradient shard is not all-reduced across the replicate group",
    world_sizes=(4,),
)(_no_inter_node_all_reduce)


# ------------------------------------------------------------- optimizer state dicts (S24)
def _drop_step(result, *args, **kwargs):
    for state in result.get("state", {}).values():
        if "step" in state:  # the bug: the step count is not carried into the loaded state
            state["step"] = torch.zeros_like(torch.as_tensor(state["step"]))
    return result


fault(
    "t1-optim-load-drops-step",
    "torch-fsdp1",
    "S24",
    "state_dict",
    f"{TORCH}:FullyShardedDataParallel.optim_state_dict_to_load",
    "upstream: optim_state_dict_to_load resets Adam's step count to 0 (the loaded optimizer "
    "redoes the bias correction of a first step)",
)(wrap(after=_drop_step))


def _rank0_only_ignored(original):
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        # the bug: the full optimizer state is materialized on every rank
        return original(model, optim, optim_input, rank0_only=False, group=group)

    return full_optim_state_dict


fault(
    "t1-full-optim-rank0-only-ignored",
    "torch-fsdp1",
    "S26",
    "state_dict",
    f"{TORCH}:FullyShardedDataParallel.full_optim_state_dict",
    "upstream: full_optim_state_dict(rank0_only=True) gives the full state on every rank",
)(_rank0_only_ignored)


# ----------------------------------------------------------------- forward input casts (R21)
fault(
    "t1-root-input-cast-ignored",
    "torch-fsdp1",
    "R21",
    "mixed_precision",
    f"{TORCH}:_root_cast_forward_input",
    "upstream: MixedPrecision(cast_root_forward_inputs=True) is ignored: the root's inputs reach "
    "it uncast",
)(replace_with(lambda state, module, args, kwargs: (args, kwargs)))


# --------------------------------------------------- size policy's exclude_wrap_modules (W22)
def _exclusion_ignored(original):
    def size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, **kwargs):
        kwargs.pop("exclude_wrap_modules", None)  # the bug: the default exclusions always apply
        return original(module, recurse, nonwrapped_numel, **kwargs)

    # the original reads its defaults off the module-level name (now this function)
    size_based_auto_wrap_policy.__dict__.update(original.__dict__)
    return size_based_auto_wrap_policy


fault(
    "tw-size-exclude-ignored",
    "torch-fsdp1",
    "W22",
    "wrap",
    f"{TORCH}:size_based_auto_wrap_policy",
    "upstream: size_based_auto_wrap_policy ignores exclude_wrap_modules (default exclusions apply)",
)(_exclusion_ignored)


def _process_group_ignored(original):
    def __init__(self, module, process_group=None, *args, **kwargs):
        return original(self, module, None, *args, **kwargs)  # the bug: always the world group

    return __init__


fault(
    "t1-process-group-ignored",
    "torch-fsdp1",
    "R22",
    "training",
    f"{TORCH}:FullyShardedDataParallel.__init__",
    "upstream: FullyShardedDataParallel(process_group=pg) shards over the default group instead",
    world_sizes=(4,),
)(_process_group_ignored)
