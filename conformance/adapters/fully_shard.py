"""Adapter for FSDP2-style implementations: anything exposing upstream's ``fully_shard`` API.

One class serves upstream torch (``torch.distributed.fsdp``), the reference (``reference``) and any
fork that keeps the same public names: point ``namespace`` at the module that exports
``fully_shard``, ``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from conformance.adapters import base
from conformance.adapters.base import NamespaceImplementation, NotSupported, ShardView, plan_entries


class FullyShardAdapter(NamespaceImplementation):
    capabilities: ClassVar[frozenset[str]] = frozenset(
        {
            base.PER_PARAM_DIM0,
            base.PADDED_STORAGE,
            base.DTENSOR_PARAMS,
            base.SHARD_PLACEMENT_FN,
            base.RESHARD_AFTER_FORWARD,
            base.MIXED_PRECISION,
            base.CPU_OFFLOAD,
            base.HSDP,
            base.EXTENSIONS,
            base.TENSOR_PARALLEL,
            base.DTENSOR_STATE_DICT,
            base.AUTO_WRAP,
            base.TRAINING,
            base.FSDP2_API,
            base.HSDP_ALL_REDUCE,
            base.DCP_HELPERS,
            base.FSDP2_FORWARD_METHOD,
            base.FSDP2_CUSTOM_COMMS,
            base.FSDP2_DP_MESH_DIMS,
            base.FSDP2_PER_PARAM_MESH,
            base.FSDP2_FUNCTORCH,
            base.FSDP2_PUBLIC_MODULE,
            base.FSDP2_SYMM_MEM,
            base.FSDP2_NEW_INIT_SWITCH,
        }
    )
    known_options: ClassVar[frozenset[str]] = frozenset(
        {"reshard_after_forward", "mixed_precision", "cpu_offload", "shard_placement_fn", "mesh"}
    )

    # -------------------------------------------------------------------------------- sharding
    def shard_kwargs(self, ctx, options: dict) -> dict:
        self.check_options(options)
        kwargs = {"mesh": options.get("mesh") or ctx.mesh}
        if "reshard_after_forward" in options:
            kwargs["reshard_after_forward"] = options["reshard_after_forward"]
        if options.get("mixed_precision"):
            mp = dict(options["mixed_precision"])
            mp.pop("buffer_dtype", None)  # FSDP2 leaves buffers alone
            kwargs["mp_policy"] = self.ns.MixedPrecisionPolicy(**mp)
        if options.get("cpu_offload"):
            kwargs["offload_policy"] = self.ns.CPUOffloadPolicy(
                pin_memory=torch.accelerator.is_available()
            )
        if options.get("shard_placement_fn") is not None:
            kwargs["shard_placement_fn"] = options["shard_placement_fn"]
        return kwargs

    def shard(self, module: nn.Module, ctx, *, plan=None, **options) -> nn.Module:
        kwargs = self.shard_kwargs(ctx, options)
        entries = plan_entries(plan)
        for fqn, extra in entries:  # children first, root last
            self.ns.fully_shard(module.get_submodule(fqn), **{**kwargs, **extra})
        return module

    # -------------------------------------------------------------------------------- layout
    def fsdp_params(self, module: nn.Module) -> dict[int, object]:
        """id(registered sharded parameter) -> the implementation's FSDPParam."""
        found = {}
        for sub in module.modules():
            get_state = getattr(sub, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    found[id(fsdp_param.sharded_param)] = fsdp_param
        return found

    def local_shards(self, module: nn.Module) -> dict[str, ShardView]:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        fsdp_params = self.fsdp_params(module)
        views = {}
        for fqn, param in module.named_parameters():
            if not isinstance(param, DTensor):
                raise AssertionError(
                    f"{fqn} is registered as {type(param).__name__}, not a DTensor"
                )
            _, offsets = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements
            )
            fsdp_param = fsdp_params.get(id(param))
            padded = getattr(fsdp_param, "_sharded_param_data", None) if fsdp_param else None
            name = self.clean_fqn(fqn)
            views[name] = ShardView(
                name, tuple(param.shape), param.to_local(), offsets[0] if offsets else 0, padded
            )
        return views

    # -------------------------------------------------------------------------------- state dict
    # kinds: "dtensor" (``module.state_dict()``: the sharded DTensor parameters themselves),
    # "dcp-full" / "dcp-sharded" (``torch.distributed.checkpoint.state_dict`` helpers with
    # ``StateDictOptions(full_state_dict=..., cpu_offload=config.get("cpu_offload", False))``).
    def state_dict(self, module: nn.Module, kind: str = "full", **config) -> dict:
        if kind == "dtensor":
            if config:
                raise NotSupported(f"dtensor state dict with {sorted(config)}")
            return module.state_dict()
        if kind in _DCP_KINDS:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(module, options=_dcp_options(kind, config))
        raise NotSupported(f"{kind} state dict")

    def load_state_dict(
        self,
        module: nn.Module,
        state_dict: dict,
        kind: str = "full",
        *,
        strict: bool = True,
        **config,
    ):
        if kind == "dtensor":
            if config:
                raise NotSupported(f"load dtensor state dict with {sorted(config)}")
            return module.load_state_dict(state_dict, strict=strict)
        if kind in _DCP_KINDS:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            return set_model_state_dict(
                module, state_dict, options=_dcp_options(kind, config, strict=strict)
            )
        raise NotSupported(f"load {kind} state dict")


_DCP_KINDS = ("dcp-full", "dcp-sharded")


def _dcp_options(kind: str, config: dict, **extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    unknown = set(config) - {"cpu_offload"}
    if unknown:
        raise NotSupported(f"{kind} state dict option(s) {sorted(unknown)}")
    return StateDictOptions(
        full_state_dict=kind == "dcp-full",
        cpu_offload=bool(config.get("cpu_offload", False)),
        **extra,
    )
