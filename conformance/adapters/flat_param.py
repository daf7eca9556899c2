"""Adapter for FSDP1-style implementations: ``FullyShardedDataParallel`` with flat parameters.

Serves upstream torch (``torch.distributed.fsdp``), the reference's FSDP1 path (``reference``) and
forks that keep upstream's names. It reads the flat parameter through upstream's attribute contract:
``fsdp_module._handle.flat_param`` with ``_fqns``, ``_shapes``, ``_numels`` and ``_shard_param_infos``
(per original parameter: in_shard, offset_in_shard, numel_in_shard, intra_param_start_idx,
intra_param_end_idx).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import (
    NamespaceImplementation,
    NotSupported,
    ShardView,
    plan_entries,
)

_KIND = {"full": "FULL_STATE_DICT", "sharded": "SHARDED_STATE_DICT", "local": "LOCAL_STATE_DICT"}
_CONFIG = {
    "full": "FullStateDictConfig",
    "sharded": "ShardedStateDictConfig",
    "local": "LocalStateDictConfig",
}


class FlatParamAdapter(NamespaceImplementation):
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {
            base.FLAT_PARAM,
            base.PADDED_STORAGE,
            base.MIXED_PRECISION,
            base.FULL_STATE_DICT,
            base.SHARDED_STATE_DICT,
            base.LOCAL_STATE_DICT,
            base.AUTO_WRAP,
            base.TRAINING,
            base.FSDP1_API,
            base.FSDP1_RUNTIME,
            base.FSDP1_OPTIM_STATE_DICT,
            base.FSDP1_HYBRID_SHARD,
            base.DCP_HELPERS,
            base.FSDP1_GRAD_SCALER,
            base.FSDP1_EXEC_ORDER_CHECK,
            base.FSDP1_PREFETCH,
            base.FSDP1_MODULE_TO,
            base.FSDP1_FULL_PREC_IN_EVAL,
            base.FSDP1_CPU_OFFLOAD,
            base.FSDP1_FAKE_COLLECTIVES,
            base.FSDP1_TENSOR_PARALLEL,
            base.FSDP1_NO_SYNC_ORIG_GRADS,
            base.FSDP1_LOCAL_ORIG_PARAMS,
            base.FSDP1_UNSAFE_SETATTR,
            base.FSDP1_DYNAMO,
        }
    )
    known_options: ClassVar[frozenset[str]] = frozenset(
        {"mixed_precision", "use_orig_params", "cpu_offload", "ignored_modules", "mesh"}
    )

    @property
    def FSDP(self):  # noqa: N802 - upstream's class name
        return self.ns.FullyShardedDataParallel

    # -------------------------------------------------------------------------------- sharding
    def shard(self, module: nn.Module, ctx, *, plan=None, **options) -> nn.Module:
        self.check_options(options)
        if options.get("cpu_offload"):
            raise NotSupported("cpu_offload (FSDP1 CPUOffload needs an accelerator)")
        kwargs = {"use_orig_params": bool(options.get("use_orig_params", False))}
        if ctx.device.type == "cpu":
            kwargs["device_id"] = torch.device("cpu")
        if options.get("mixed_precision"):
            kwargs["mixed_precision"] = self.ns.MixedPrecision(**options["mixed_precision"])
        if options.get("ignored_modules"):
            kwargs["ignored_modules"] = options["ignored_modules"]
        if options.get("mesh") is not None:
            if options["mesh"].ndim != 1:
                raise NotSupported("a 2-D mesh (FSDP1's HYBRID_SHARD) in this adapter")
            kwargs["device_mesh"] = options["mesh"]
        entries = plan_entries(plan)
        root_extra = dict(entries[-1][1]) if entries[-1][0] == "" else {}
        children = {module.get_submodule(fqn): extra for fqn, extra in entries if fqn != ""}
        if children:
            kwargs["auto_wrap_policy"] = self.ns.wrap.CustomPolicy(
                lambda m: children.get(m, {}) or (m in children)
            )
        return self.FSDP(module, **{**kwargs, **root_extra})

    # -------------------------------------------------------------------------------- layout
    def _flat_params(self, module: nn.Module):
        """(clean FQN prefix of the wrapped module, flat_param) for every FSDP instance."""
        out = []
        for name, sub in module.named_modules():
            if isinstance(sub, self.FSDP):
                handle = getattr(sub, "_handle", None)
                if handle is not None:
                    out.append((self.clean_fqn(name), handle.flat_param))
        return out

    def flat_shards(self, module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
        return [
            ([self._join(prefix, f) for f in flat._fqns], flat.detach())
            for prefix, flat in self._flat_params(module)
        ]

    def flat_grads(self, module: nn.Module) -> list[tuple[list[str], torch.Tensor | None]]:
        return [
            ([self._join(prefix, f) for f in flat._fqns], flat.grad)
            for prefix, flat in self._flat_params(module)
        ]

    def local_shards(self, module: nn.Module) -> dict[str, ShardView]:
        views = {}
        for prefix, flat in self._flat_params(module):
            for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
                full = self._join(prefix, fqn)
                if info.in_shard:
                    local = flat.detach()[
                        info.offset_in_shard : info.offset_in_shard + info.numel_in_shard
                    ]
                    offset = info.intra_param_start_idx
                else:
                    local, offset = flat.detach()[:0], 0
                views[full] = ShardView(full, tuple(shape), local, offset, flat.detach())
        return views

    # -------------------------------------------------------------------------------- state dict
    def state_dict(self, module: nn.Module, kind: str = "full", **config) -> dict:
        if kind not in _KIND:
            raise NotSupported(f"{kind} state dict")
        cfg = getattr(self.ns, _CONFIG[kind])(**config)
        with self.FSDP.state_dict_type(module, getattr(self.ns.StateDictType, _KIND[kind]), cfg):
            return module.state_dict()

    def load_state_dict(
        self,
        module: nn.Module,
        state_dict: dict,
        kind: str = "full",
        *,
        strict: bool = True,
        **config,
    ):
        if kind not in _KIND:
            raise NotSupported(f"load {kind} state dict")
        cfg = getattr(self.ns, _CONFIG[kind])(**config)
        with self.FSDP.state_dict_type(module, getattr(self.ns.StateDictType, _KIND[kind]), cfg):
            return module.load_state_dict(state_dict, strict=strict)

    def _join(self, prefix: str, name: str) -> str:
        """The clean FQN of a flattened parameter (no wrapper prefixes, e.g. from checkpoint_wrapper)."""
        return self.clean_fqn(f"{prefix}.{name}" if prefix else name)
