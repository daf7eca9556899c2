"""The flat parameter: one wrapped module's parameters as a single sharded 1-D tensor.

[Note: flat-parameter vocabulary]
  original parameters  the ``nn.Parameter`` s of the wrapped module (minus those owned by nested
                       FSDP modules and ignored modules), visited in ``named_modules()`` order. A
                       parameter reachable under two names is a *shared* parameter: it is
                       flattened once, at its first name (the *primary*), and every later name is
                       recorded in ``_shared_param_infos``.
  flat (unsharded)     all original parameters flattened and concatenated, length ``N`` (which,
                       with ``use_orig_params=True``, includes alignment padding, see below).
  padded unsharded     the flat tensor padded at the end to ``world_size * C`` elements with
                       ``C = ceil(N / world_size)``: the all-gather output.
  shard                rank ``r`` owns ``padded[r*C : (r+1)*C]``, i.e. the elements
                       ``[min(r*C, N), min((r+1)*C, N))`` of the flat tensor followed by
                       ``_shard_numel_padded`` zeros. A rank whose range is empty holds only
                       padding ("pure-padding rank").
  views                each original parameter is ``unsharded[offset : offset+numel].view(shape)``.
                       With ``use_orig_params=True`` the *sharded* views (the part of each
                       parameter inside this rank's shard, 1-D) are exposed between unshards.
  placeholders         with ``use_orig_params=False`` the original names hold ``meta`` tensors of
                       the original shapes between unshards (upstream leaves views into freed
                       storage there): inspecting works, reading values needs an unshard.

[Note: alignment padding]  With ``use_orig_params=True`` every original parameter starts at a
multiple of ``16 bytes / itemsize`` elements; zero padding entries are inserted before a parameter
that would not, and one more padding entry rounds ``N`` up to a multiple of the world size. These
entries are listed in ``_numels_with_padding`` with ``_is_padding_mask`` True. Without
``use_orig_params`` there are no padding entries and the world-size padding is the per-shard
``_shard_numel_padded`` instead.

The layout arithmetic is pure (no process group) and lives in ``_fsdp1_flat_layout``;
:class:`FlatParamHandle` applies it to real parameters.

Gradient handling (reduction, no_sync accumulation, gradient views and dtypes) lives in
:mod:`reference._fsdp1._flat_grad`: :class:`FlatParamHandle` inherits it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from reference._fsdp1._collectives import all_gather_single
from reference._fsdp1._flat_grad import FlatGradHandling
from reference._fsdp1._flat_layout import (
    ParamInfo,
    SharedParamInfo,
    aligned_numel,
    flat_layout,
    shard_param_infos,
    shard_range,
)

logger = logging.getLogger(__name__)

FLAT_PARAM = "_flat_param"

# A debug knob read when a handle is built: "1" turns off the writeback of original parameters
# whose storage the user replaced (see writeback_replaced_data). Using it warns once per process.
SKIP_WRITEBACK_CHECK = "FSDP_SKIP_WRITEBACK_CHECK"
_warned_skip_writeback = False


def _skip_writeback_from_env() -> bool:
    global _warned_skip_writeback
    if os.environ.get(SKIP_WRITEBACK_CHECK, "") != "1":
        return False
    if not _warned_skip_writeback:
        _warned_skip_writeback = True
        logger.warning(
            "%s=1: FSDP does not write back original parameters or gradients whose storage "
            "was replaced; such changes are silently lost.",
            SKIP_WRITEBACK_CHECK,
        )
    return True


# --------------------------------------------------------------------------------------------------
# The flat parameter and its handle
# --------------------------------------------------------------------------------------------------


class FlatParameter(nn.Parameter):
    """The sharded flat parameter (always this rank's shard, shape ``(C,)``; ``(N,)`` for NO_SHARD).

    Unlike upstream, whose ``.data`` switches to the unsharded tensor while unsharded, the reference
    never swaps it: the gathered tensor is a separate value and only the views point into it.

    Metadata attributes (names as upstream's ``FlatParameter``)::

        _num_params: int                          # original (primary) parameters
        _param_infos: tuple[ParamInfo, ...]
        _shared_param_infos: tuple[SharedParamInfo, ...]
        _numels: tuple[int, ...]                  # per original parameter
        _shapes: tuple[torch.Size, ...]
        _fqns: tuple[str, ...]                    # relative to the wrapped module
        _numels_with_padding: tuple[int, ...]     # segments incl. alignment padding entries
        _is_padding_mask: list[bool]
        _unpadded_unsharded_size: torch.Size      # (N,)
        _padded_unsharded_size: torch.Size        # (world_size * C,)
        _sharded_size: torch.Size                 # (C,)
        _shard_numel_padded: int                  # zeros at the end of this rank's shard
        _shard_param_infos: tuple[_ShardParamInfo, ...]
    """


class _UnshardForCompute(torch.autograd.Function):
    """All-gather in forward, reduce-scatter (averaged) in backward: the FSDP collective pair as one
    differentiable step, so autograd places the gradient on the sharded flat parameter."""

    @staticmethod
    def forward(ctx, flat_param: torch.Tensor, handle: FlatParamHandle) -> torch.Tensor:
        ctx.handle = handle
        return handle._gather(flat_param.detach(), handle._compute_dtype, copy=True)

    @staticmethod
    def backward(ctx, grad_padded: torch.Tensor):
        handle = ctx.handle
        if grad_padded.requires_grad:  # backward(create_graph=True) through the parameters
            raise RuntimeError("FSDP does not support gradients of gradients")
        if handle._sync_gradients:
            return handle._reduce_grad(handle._add_unsynced_grad(grad_padded)), None
        # Inside no_sync(): keep the unsharded gradient for the next synced backward; nothing
        # reaches the flat parameter, so its post-accumulate hook will not reshard: do it here.
        handle._add_unsynced_grad(grad_padded, keep=True)
        handle._post_backward()
        return None, None


class FlatParamHandle(FlatGradHandling):
    """Owns one :class:`FlatParameter` and switches its module between sharded and unsharded views.

    Attributes::

        flat_param: FlatParameter            # (C,) this rank's shard; (N,) for NO_SHARD
        _fully_sharded_module: nn.Module     # the module whose parameters were flattened
        _orig_params: list[nn.Parameter]     # use_orig_params=True: the user's parameter objects,
                                             # holding 1-D sharded views between unshards
        _start, _end: int                    # this rank's range of the flat tensor
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        fully_sharded_module: nn.Module,
        process_group: dist.ProcessGroup,
        sharded: bool,
        use_orig_params: bool,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        keep_low_precision_grads: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        self.process_group = process_group
        self.rank = process_group.rank()  # group-local rank
        self.world_size = process_group.size()
        self.uses_sharded_strategy = sharded
        self._reshard_after_forward = sharded and reshard_after_forward
        self._use_orig_params = use_orig_params
        self._fully_sharded_module = fully_sharded_module
        # Read once, at construction (as upstream): INFO logs each post-backward (R120).
        self._debug_level = dist.get_debug_level()
        self._skip_writeback = _skip_writeback_from_env()
        # The original parameters' names from the root, set by the root's lazy init.
        self._root_fqns: list[str] | None = None
        self._orig_param_dtype = params[0].dtype
        self._compute_dtype = param_dtype or self._orig_param_dtype
        # A param dtype without a reduce dtype reduces in the param dtype (upstream's rule).
        self._reduce_dtype = reduce_dtype or self._compute_dtype
        self._keep_low_precision_grads = keep_low_precision_grads
        # (hook, state) from the root's register_comm_hook: replaces the reduction below
        self.comm_hook: tuple[Any, Any] | None = None
        # no_sync(): False skips the reduction; backwards accumulate in _unsynced_grad (padded,
        # unsharded, compute dtype) until the next synced backward reduces the sum.
        self._sync_gradients = True
        self._unsynced_grad: torch.Tensor | None = None
        # use_orig_params: original parameters whose .grad the user set to None since the last
        # backward (see "cleared grads" in _flat_grad).
        self._cleared_grads: set[int] = set()
        self._init_flat_param(params, fully_sharded_module)

    # -- construction -----------------------------------------------------------------------------

    def _init_flat_param(self, params: Sequence[nn.Parameter], module: nn.Module) -> None:
        managed = {id(p) for p in params}
        infos, shared, ordered, memo = [], [], [], {}
        for module_name, sub in module.named_modules(remove_duplicate=False):
            # a module's own parameters, read where nn.Module keeps them: its named_parameters
            # may be overridden and refuse remove_duplicate=False (R84)
            for name, p in sub._parameters.items():
                if id(p) not in managed:
                    continue
                if id(p) in memo:
                    shared.append(SharedParamInfo(name, sub, module_name, *memo[id(p)]))
                    continue
                memo[id(p)] = (name, sub, module_name)
                infos.append(ParamInfo(name, sub, module_name))
                ordered.append(p)
        for info, p in zip(infos, ordered):
            if not p.is_floating_point():
                raise ValueError("Cannot flatten integer dtype tensors")
            if not self._use_orig_params and p.requires_grad != ordered[0].requires_grad:
                raise ValueError(
                    "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
                )
            if p.dim() == 0:
                raise ValueError(
                    f"FSDP cannot flatten the scalar (0-dim) parameter {_fqn(info)}; "
                    "give it shape (1,) or put its module in ignored_modules"
                )
            if p.dtype != ordered[0].dtype or p.device != ordered[0].device:
                raise ValueError(
                    f"FSDP flattens parameters of one dtype and device, but {_fqn(infos[0])} is "
                    f"{ordered[0].dtype} on {ordered[0].device} and {_fqn(info)} is {p.dtype} on "
                    f"{p.device}; cast the module first or wrap these modules separately"
                )
        align = aligned_numel(self._compute_dtype) if self._use_orig_params else 0
        numels = [p.numel() for p in ordered]
        segments, mask = flat_layout(numels, self.world_size, align)
        device, dtype = ordered[0].device, ordered[0].dtype
        it = iter(ordered)
        pieces = [
            torch.zeros(seg, dtype=dtype, device=device) if pad else next(it).detach().reshape(-1)
            for seg, pad in zip(segments, mask)
        ]
        flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
        total = flat.numel()
        if self.uses_sharded_strategy:
            start, end, pad = shard_range(total, self.rank, self.world_size)
            shard = torch.cat([flat[start:end], flat.new_zeros(pad)])
        else:
            start, end, pad, shard = 0, total, 0, flat.clone()
        self._start, self._end = start, end
        fp = FlatParameter(shard, requires_grad=any(p.requires_grad for p in ordered))
        fp._num_params = len(ordered)
        fp._param_infos = tuple(infos)
        fp._shared_param_infos = tuple(shared)
        fp._numels = tuple(numels)
        fp._shapes = tuple(p.shape for p in ordered)
        fp._fqns = tuple(_fqn(i) for i in infos)
        fp._numels_with_padding = tuple(segments)
        fp._is_padding_mask = mask
        fp._unpadded_unsharded_size = torch.Size([total])
        gathered_numel = shard.numel() * (self.world_size if self.uses_sharded_strategy else 1)
        fp._padded_unsharded_size = torch.Size([gathered_numel])
        fp._sharded_size = shard.size()
        fp._shard_numel_padded = pad
        fp._shard_param_infos = shard_param_infos(segments, mask, start, end)
        self.flat_param = fp
        self._orig_params = list(ordered) if self._use_orig_params else []
        if self._use_orig_params:
            self._use_sharded_views()
        else:
            self._use_placeholders()
        if fp.requires_grad:
            fp.register_post_accumulate_grad_hook(lambda _: self._post_backward())
        # Gathered tensors of forwards whose backward has not run yet (their storage is freed
        # under FULL_SHARD; the tensor objects stay: they are autograd outputs that recomputed
        # modules must connect to).
        self._gathered_for_backward: list[torch.Tensor] = []

    # -- collectives ------------------------------------------------------------------------------

    def _gather(self, shard: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
        """Padded unsharded flat tensor in ``dtype`` (a fresh tensor; for NO_SHARD without a cast
        and ``copy=False`` it is the flat parameter's own storage)."""
        local = shard.to(dtype)
        if not self.uses_sharded_strategy:
            return local.clone() if copy and local is shard else local
        out = local.new_empty(local.numel() * self.world_size)
        all_gather_single(out, local.contiguous(), self.process_group)
        return out

    def unshard_for_compute(self) -> torch.Tensor:
        """Padded unsharded flat tensor in the compute dtype, differentiable w.r.t. the shard."""
        return _UnshardForCompute.apply(self.flat_param, self)

    @torch.no_grad()
    def unshard_full_precision(self) -> torch.Tensor:
        """Padded unsharded flat tensor in the parameter dtype (for summon/state dict). For
        NO_SHARD it *is* the flat parameter's storage, so writes land directly."""
        return self._gather(self.flat_param.detach(), self.flat_param.dtype)

    @torch.no_grad()
    def writeback(self, padded: torch.Tensor) -> None:
        """Copy this rank's range of an unsharded flat tensor back into the shard (and of the
        gathered gradient, inside ``summon_full_params(with_grads=True)``)."""
        self.writeback_grad()
        if not self.uses_sharded_strategy:
            if padded.data_ptr() != self.flat_param.data_ptr():
                self.flat_param.data.copy_(padded[: self.flat_param.numel()])
            return
        n = self._end - self._start
        self.flat_param.data[:n].copy_(padded[self._start : self._end])

    @torch.no_grad()
    def writeback_replaced_data(self) -> None:
        """use_orig_params=True, before a forward: an original parameter whose ``.data`` the user
        replaced (its storage is no longer the flat parameter's) has its values copied into the
        flat parameter at its place, and the views are put back (upstream's writeback rule). A
        shared name no longer holding its primary's parameter is refused (R93). Nothing of this
        happens under ``FSDP_SKIP_WRITEBACK_CHECK=1`` (R121)."""
        if not self._use_orig_params or self._skip_writeback:
            return
        fp = self.flat_param
        for s in fp._shared_param_infos:
            if getattr(s.module, s.param_name) is not getattr(s.prim_module, s.prim_param_name):
                raise NotImplementedError("Changing shared parameters is not supported yet")
        infos = fp._shard_param_infos
        mine = [info.in_shard or not self.uses_sharded_strategy for info in infos]
        for i, info in enumerate(fp._param_infos):
            # The user replaced the variable itself (``lin.weight = nn.Parameter(...)``): adopt
            # the new Parameter where this rank holds a piece of it (R119); a deregistered one
            # (R80) is left alone.
            cur = getattr(info.module, info.param_name, None)
            if mine[i] and isinstance(cur, nn.Parameter) and cur is not self._orig_params[i]:
                self._orig_params[i] = cur
        storage = fp.untyped_storage().data_ptr()
        replaced = [
            mine[i] and p.untyped_storage().data_ptr() != storage
            for i, p in enumerate(self._orig_params)
        ]
        if not any(replaced):
            return
        for i, p in enumerate(self._orig_params):
            want = (infos[i].numel_in_shard,) if self.uses_sharded_strategy else fp._shapes[i]
            if replaced[i] and p.data.numel() != math.prod(want):
                raise RuntimeError(
                    f"Cannot writeback when the parameter shape changes: {fp._fqns[i]} expects "
                    f"{tuple(want)} but got {tuple(p.shape)}"
                )
        if not self.uses_sharded_strategy:
            for p, view, new in zip(self._orig_params, self.unflatten(fp.data), replaced):
                if new:
                    view.copy_(p.data)
        else:
            for i, p in enumerate(self._orig_params):
                if replaced[i]:
                    lo, n = infos[i].offset_in_shard, infos[i].numel_in_shard
                    fp.data[lo : lo + n].copy_(p.data.reshape(-1))
        self.reshard()

    # -- views ------------------------------------------------------------------------------------

    def unflatten(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Views of the original parameters (original shapes) into an unsharded flat tensor."""
        fp = self.flat_param
        n = fp._unpadded_unsharded_size.numel()
        if padded.numel() < n:  # e.g. the flat parameter's .data replaced by a shorter tensor
            raise AssertionError(
                f"Expects the unsharded flat tensor to hold {n} elements but got {padded.numel()}"
            )
        pieces = torch.split(padded[:n], list(fp._numels_with_padding))
        views = [t for t, pad in zip(pieces, fp._is_padding_mask) if not pad]
        return [v.view(shape) for v, shape in zip(views, fp._shapes)]

    def _all_names(self):
        """``(module, module_name, name, index)`` for every name of every original parameter,
        primaries first, then shared aliases (``index`` is the primary's)."""
        fp = self.flat_param
        for i, info in enumerate(fp._param_infos):
            yield info.module, info.module_name, info.param_name, i
        primary = {(id(i.module), i.param_name): k for k, i in enumerate(fp._param_infos)}
        for s in fp._shared_param_infos:
            index = primary[(id(s.prim_module), s.prim_param_name)]
            yield s.module, s.module_name, s.param_name, index

    def use_unsharded_views(self, padded: torch.Tensor, as_params: bool) -> None:
        """Point every original name at its full-shape view into ``padded``.

        ``as_params=True`` (summon/state dict): names are ``nn.Parameter`` s, visible to
        ``named_parameters()``/``state_dict()``; with ``use_orig_params`` they are the user's own
        parameter objects with swapped ``.data``. ``as_params=False`` (forward): plain tensors that
        stay connected to the autograd graph of :meth:`unshard_for_compute`.
        """
        views = self.unflatten(padded)
        made: dict[int, nn.Parameter] = {}
        for module, _, name, i in self._all_names():
            if as_params and self._use_orig_params:
                self._orig_params[i].data = views[i]
                _set_param(module, name, self._orig_params[i])
            elif as_params:
                if i not in made:
                    made[i] = nn.Parameter(views[i], requires_grad=self.flat_param.requires_grad)
                _set_param(module, name, made[i])
            else:
                _set_tensor(module, name, views[i])

    def _use_sharded_views(self) -> None:
        """use_orig_params=True: each user parameter holds its 1-D part of the shard (0 elements
        when none of it is on this rank)."""
        fp = self.flat_param
        if not self.uses_sharded_strategy:  # NO_SHARD: the "shard" is whole; keep full shapes
            self.use_unsharded_views(fp.data, as_params=True)
            return
        for module, _, name, i in self._all_names():
            info = fp._shard_param_infos[i]
            p = self._orig_params[i]
            if info.in_shard:
                p.data = fp.data[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
            else:
                p.data = fp.data.new_empty(0)
            _set_param(module, name, p)

    def _use_placeholders(self) -> None:
        """use_orig_params=False between unshards: each original name holds a ``meta`` tensor of
        the original shape and dtype (no storage). Code that only inspects it (``repr``,
        ``bias is not None``, ``.shape``) works; reading values needs an unshard, as upstream."""
        fp = self.flat_param
        for module, _, name, i in self._all_names():
            placeholder = torch.empty(fp._shapes[i], dtype=fp.dtype, device="meta")
            _set_tensor(module, name, placeholder)

    def reshard(self) -> None:
        """Back to the sharded state: views removed (or, with use_orig_params, sharded views)."""
        if self._use_orig_params:
            self._use_sharded_views()
        else:
            self._use_placeholders()

    def post_forward(self, padded: torch.Tensor) -> None:
        """Forward with autograd is done: remember ``padded`` for backward and, when resharding
        after forward (FULL_SHARD), free its storage. Autograd's saved views keep pointing at that
        storage; :meth:`pre_backward` refills it in place."""
        self._gathered_for_backward.append(padded)
        if self._reshard_after_forward:
            padded.untyped_storage().resize_(0)

    @torch.no_grad()
    def pre_backward(self) -> None:
        """Backward of this module starts: all-gather again into every freed gathered tensor and
        put the views back (modules recomputed by activation checkpointing read them)."""
        self._grad_to_full_precision()
        self._refuse_replaced_since_forward()
        live = self._gathered_for_backward
        for padded in live:
            nbytes = padded.numel() * padded.element_size()
            if padded.untyped_storage().size() < nbytes:
                padded.untyped_storage().resize_(nbytes)
                # `.data` has its own version counter: refilling is not an in-place op for autograd.
                local = self.flat_param.detach().to(self._compute_dtype).contiguous()
                all_gather_single(padded.data, local, self.process_group)
        if live:
            self.use_unsharded_views(live[-1], as_params=False)

    def _refuse_replaced_since_forward(self) -> None:
        """use_orig_params=True with parameters kept gathered from forward to backward
        (SHARD_GRAD_OP): an original parameter whose ``.data`` was replaced since the forward
        cannot be honoured by the backward, which uses the forward's values: refused."""
        if not (self._use_orig_params and self.uses_sharded_strategy):
            return
        if self._reshard_after_forward or not self._gathered_for_backward:
            return
        storage = self.flat_param.untyped_storage().data_ptr()
        for i, p in enumerate(self._orig_params):
            in_shard = self.flat_param._shard_param_infos[i].in_shard
            if in_shard and p.untyped_storage().data_ptr() != storage:
                raise AssertionError(
                    "FSDP does not support changing the parameters between forward and "
                    f"backward for SHARD_GRAD_OP ({self.flat_param._fqns[i]})"
                )

    def _post_backward(self) -> None:
        """The gradient reached the flat parameter: drop the gathered tensors, reshard, and (with
        use_orig_params) point each original ``.grad`` at its part of the flat gradient and step
        the optimizers applied in backward."""
        if self._use_orig_params and self._debug_level == dist.DebugLevel.INFO:
            logger.warning("FSDP firing post-backward hooks for parameters %s", self._root_fqns)
        if self._gathered_for_backward:
            self._gathered_for_backward.clear()
            self.reshard()
        self._grad_to_optimizer_precision()
        if self._use_orig_params:
            self._cleared_grads = set()  # every parameter has a gradient again
            self._use_sharded_grad_views()
            self._step_optimizers_in_backward()


def _fqn(info: ParamInfo) -> str:
    return f"{info.module_name}.{info.param_name}" if info.module_name else info.param_name


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    module.__dict__.pop(name, None)
    module._parameters[name] = param


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module._parameters.pop(name, None)
    module.__dict__[name] = tensor
