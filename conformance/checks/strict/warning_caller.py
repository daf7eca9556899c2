"""Area "strict": a warning about how a public API was called points at that call (X5).

[Note: caller attribution]
``warnings.warn(..., stacklevel=n)`` reports the file and line ``n`` frames up; a warning about
the caller's arguments is useful only when that frame is the caller's call of the public API (the
file a user reads), not a line inside the implementation. The checks here call the API from this
file and require the recorded warning's ``filename`` to be this file:
* FSDP1 at world size 1 with the default strategy: "FSDP is switching to use `NO_SHARD` ...";
* FSDP1 at world size 2 with ``sharding_strategy=NO_SHARD``: the FutureWarning that NO_SHARD is
  deprecated;
* ``full_optim_state_dict(..., optim_input=)``: the FutureWarning that ``optim_input`` is
  deprecated (S51), and the same through ``rekey_optim_state_dict(..., optim_input=)``;
* FSDP1 (world size 1): ``state_dict()`` / ``load_state_dict()`` under NO_SHARD ("full_state_dict
  will be returned", from the four state-dict hooks), ``set_state_dict_type``'s FutureWarning,
  ``ignored_modules`` holding the root, a container root (``nn.ModuleList``), a failing
  ``reset_parameters()`` of a meta-device module; with an ``auto_wrap_policy``: mixed precision
  overridden for batch norms (W11), a unit of frozen and trainable parameters (W24);
* FSDP1 (world size 2, FULL_SHARD): ``clip_grad_norm_()`` with no gradients,
  ``summon_full_params(offload_to_cpu=True, rank0_only=False)``;
* the FutureWarnings of the legacy optimizer-state-dict methods (``full_``, ``sharded_``,
  ``shard_full_``, ``scatter_full_``, ``flatten_sharded_optim_state_dict``) and
  ``optim_state_dict``'s warning about a state entry of no parameter;
* ``torch.distributed.checkpoint.state_dict``: ``get_model_state_dict(submodules=)`` and a
  module-keyed dict to ``set_model_state_dict`` (FutureWarnings; on an FSDP1 model);
* FSDP2: a unit's forward returning a view tensor, attributed to the module call.
A warning the rule's other ids do not require (the container root, the meta-device failure) is
judged only when it is raised. Upstream does not promise this; where it points elsewhere (torch
2.13: most of the above) the case is pinned in its expectations file with the exact
``file.py:LINE`` it points at, so a changed stacklevel fails either way: pointing at the caller
turns the expected failure into an XPASS (which fails the run), pointing anywhere else breaks the
signature.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from conformance.adapters import base
from conformance.checks.state_dict.optim_groups import REQUIRES as OPTIM
from conformance.checks.state_dict.optim_groups import _groups, _trained
from conformance.checks.wrap._helpers import device_id
from conformance.registry import check

AREA = "strict"


_SITE = "# X5: the call site"


def _call(api, *args, **kwargs):
    """Every public API call of these checks is made here (or in :func:`_enter`), so the line a
    warning must point at is known: a warning one frame too high lands elsewhere in this file."""
    return api(*args, **kwargs)  # X5: the call site


def _enter(cm):
    """Enter and leave a context manager of the API (its warning is raised on entry)."""
    with cm:  # X5: the call site
        pass


with open(__file__, encoding="utf-8") as _f:
    CALL_SITES = {i for i, line in enumerate(_f, 1) if line.rstrip().endswith(_SITE)}


def _assert_attributed(ctx, record, needle, what, required=True):
    """Every recorded warning whose message contains ``needle`` (a string, or a tuple of strings
    that must all occur) points at the call site (:func:`_call`); ``required``: at least one was
    recorded."""
    needles = (needle,) if isinstance(needle, str) else needle
    hits = [w for w in record if all(n in str(w.message) for n in needles)]
    if not required and not hits:
        return
    assert hits, f"{ctx.where()} {what}: no warning containing {needle!r}"
    places = sorted({f"{w.filename}:{w.lineno}" for w in hits})
    here = os.path.abspath(__file__)
    assert all(os.path.abspath(w.filename) == here and w.lineno in CALL_SITES for w in hits), (
        f"{ctx.where()} {what}: the warning ({needle!r}) is attributed to {places}, expected "
        f"the caller's call in {os.path.basename(here)} (line {sorted(CALL_SITES)})"
    )


@check(area=AREA, requires={base.FSDP1_API}, world_sizes=(1, 2))
def fsdp1_strategy_warning_caller(ctx):
    """X5: FSDP1's sharding-strategy warnings (ws 1: switching to NO_SHARD; ws 2 with NO_SHARD:
    NO_SHARD is deprecated) are attributed to the constructor's caller."""
    ns = ctx.impl.ns
    kwargs = {"device_id": device_id(ctx)}
    if ctx.world_size == 1:
        needle, what = "switching to use `NO_SHARD`", "FSDP(model) at world size 1"
    else:
        needle, what = "`NO_SHARD` sharding strategy is deprecated", "FSDP(NO_SHARD)"
        kwargs["sharding_strategy"] = ns.ShardingStrategy.NO_SHARD
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _call(ns.FullyShardedDataParallel, nn.Linear(4, 4), **kwargs)
    _assert_attributed(ctx, record, needle, what)


@check(area=AREA, requires=OPTIM, world_sizes=(1,))
def fsdp1_optim_input_warning_caller(ctx):
    """X5, S51: the FutureWarning of ``full_optim_state_dict(..., optim_input=)`` is attributed
    to its caller."""
    _, _, model, opt = _trained(ctx, count=False)
    params = [p for g in _groups(model.named_parameters()) for p in g["params"]]
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _call(fsdp.full_optim_state_dict, model, opt, optim_input=params, rank0_only=False)
    _assert_attributed(ctx, record, "optim_input", "full_optim_state_dict(optim_input=)")


def _recorded(fn):
    """Run ``fn`` and return every warning it raised (all of them, repeats included)."""
    # [Note: caller attribution] the public API is called inside ``fn``, defined in this file
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fn()
    return record


class _ResetFails(nn.Linear):
    """A meta-device Linear whose ``reset_parameters`` raises once the module is built."""

    armed = False

    def reset_parameters(self):
        if self.armed:
            raise RuntimeError("reset_parameters refused (conformance)")
        super().reset_parameters()


def _fsdp1(ctx, module, **kwargs):
    return _call(ctx.impl.ns.FullyShardedDataParallel, module, device_id=device_id(ctx), **kwargs)


def _state_dict_round_trip(ctx):
    model = _fsdp1(ctx, nn.Linear(4, 4))
    sd = _call(model.state_dict)
    _call(model.load_state_dict, sd)


def _meta_reset_fails(ctx):
    module = _ResetFails(4, 4, device="meta")
    module.armed = True
    try:
        _fsdp1(ctx, module)
    except RuntimeError:
        pass  # the failure is expected; only its warning is judged


def _ignore_root(ctx):
    module = nn.Sequential(nn.Linear(4, 4))
    _fsdp1(ctx, module, ignored_modules=[module])


# scenario -> (what the caller does, needle, required: a SPEC rule or the reference emits it too)
FSDP1_SCENARIOS = {
    # "When using ``NO_SHARD`` ... full_state_dict will be returned" from the state-dict and
    # load hooks (world size 1 is NO_SHARD): state_dict() and load_state_dict() are the calls
    "state_dict_no_shard": (_state_dict_round_trip, "full_state_dict will", True),
    "set_state_dict_type": (
        lambda ctx: _call(
            ctx.impl.ns.FullyShardedDataParallel.set_state_dict_type,
            _fsdp1(ctx, nn.Linear(4, 4)),
            ctx.impl.ns.StateDictType.FULL_STATE_DICT,
        ),
        "set_state_dict_type",
        True,
    ),
    "ignore_root": (_ignore_root, "ignore the top-level module", True),
    "module_list": (
        lambda ctx: _fsdp1(ctx, nn.ModuleList([nn.Linear(4, 4)])),
        "containers that do not implement forward",
        False,
    ),
    "meta_reset_fails": (_meta_reset_fails, "reset_parameters", False),
}


@check(
    area=AREA,
    requires={base.FSDP1_API},
    cases={k: {"scenario": k} for k in FSDP1_SCENARIOS},
    world_sizes=(1,),
)
def fsdp1_call_warning_caller(ctx, scenario):
    """X5: FSDP1's warnings about a call (state_dict()/load_state_dict() under NO_SHARD,
    set_state_dict_type's deprecation, ignoring the root module, a container root, a failing
    reset_parameters() of a meta module) are attributed to that call."""
    fn, needle, required = FSDP1_SCENARIOS[scenario]
    _assert_attributed(ctx, _recorded(lambda: fn(ctx)), needle, scenario, required)


def _mp_override(ctx):
    ns = ctx.impl.ns
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    _fsdp1(
        ctx,
        model,
        auto_wrap_policy=ns.wrap.ModuleWrapPolicy({nn.Linear}),
        mixed_precision=ns.MixedPrecision(param_dtype=torch.float16),
    )


def _mixed_frozen_unit(ctx):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    _fsdp1(
        ctx,
        model,
        auto_wrap_policy=ctx.impl.ns.wrap.ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
    )


WRAP_SCENARIOS = {
    # W11: mixed precision with an auto_wrap_policy over a batch norm
    "mixed_precision_override": (_mp_override, "Both mixed precision", True),
    # W12/W24: a unit of frozen and trainable parameters with use_orig_params=True
    "mixed_frozen_unit": (_mixed_frozen_unit, "requires_grad=False", True),
}


@check(
    area=AREA,
    requires={base.FSDP1_API, base.AUTO_WRAP},
    cases={k: {"scenario": k} for k in WRAP_SCENARIOS},
    world_sizes=(1,),
)
def fsdp1_wrap_warning_caller(ctx, scenario):
    """X5, W11, W24: the constructor's auto-wrap warnings (mixed precision overridden for batch
    norms; a unit of frozen and trainable parameters) are attributed to the constructor's caller."""
    fn, needle, required = WRAP_SCENARIOS[scenario]
    _assert_attributed(ctx, _recorded(lambda: fn(ctx)), needle, scenario, required)


def _clip_without_grads(ctx):
    _call(_fsdp1(ctx, nn.Linear(4, 4)).clip_grad_norm_, 1.0)


def _summon_offload(ctx):
    model = _fsdp1(ctx, nn.Linear(4, 4))
    try:
        _enter(
            ctx.impl.ns.FullyShardedDataParallel.summon_full_params(
                model, offload_to_cpu=True, rank0_only=False
            )
        )
    except RuntimeError:
        pass  # torch 2.13 fails after the warning on a CPU compute device; only the warning is judged


RUNTIME_SCENARIOS = {
    "clip_grad_norm_no_grads": (_clip_without_grads, "with no gradients", True),
    "summon_offload_all_ranks": (_summon_offload, "offload_to_cpu=True and rank0_only=False", True),
}


@check(
    area=AREA,
    requires={base.FSDP1_API, base.FSDP1_RUNTIME},
    cases={k: {"scenario": k} for k in RUNTIME_SCENARIOS},
    world_sizes=(2,),  # at world size 1 (NO_SHARD) neither call reaches its warning
)
def fsdp1_runtime_warning_caller(ctx, scenario):
    """X5: ``clip_grad_norm_()`` with no gradients and ``summon_full_params(offload_to_cpu=True,
    rank0_only=False)`` warn at their caller."""
    fn, needle, required = RUNTIME_SCENARIOS[scenario]
    _assert_attributed(ctx, _recorded(lambda: fn(ctx)), needle, scenario, required)


def _stepped(ctx, orig_params=False):
    """A one-unit FSDP1 model and an Adam over it after one step (state to save)."""
    model = _fsdp1(ctx, nn.Linear(4, 4), use_orig_params=orig_params)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(2, 4, device=ctx.device)).sum().backward()
    opt.step()
    return model, opt


def _legacy(name):
    """One of FSDP1's legacy optimizer-state-dict methods, called from here."""

    def run(ctx):
        fsdp = ctx.impl.ns.FullyShardedDataParallel
        model, opt = _stepped(ctx)
        if name == "full_optim_state_dict":
            _call(fsdp.full_optim_state_dict, model, opt, rank0_only=False)
        elif name == "sharded_optim_state_dict":
            _call(fsdp.sharded_optim_state_dict, model, opt)
        elif name == "shard_full_optim_state_dict":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # only the call below is judged
                full = fsdp.full_optim_state_dict(model, opt, rank0_only=False)
            _call(fsdp.shard_full_optim_state_dict, full, model)
        elif name == "scatter_full_optim_state_dict":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                full = fsdp.full_optim_state_dict(model, opt, rank0_only=False)
            _call(fsdp.scatter_full_optim_state_dict, full, model)
        else:  # flatten_sharded_optim_state_dict
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sharded = fsdp.sharded_optim_state_dict(model, opt)
            _call(fsdp.flatten_sharded_optim_state_dict, sharded, model, opt)

    return run, (f"FullyShardedDataParallel.{name}`", "deprecated"), True


def _rekey_optim_input(ctx):
    fsdp = ctx.impl.ns.FullyShardedDataParallel
    model, opt = _stepped(ctx, orig_params=True)  # optim_input: the original parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = fsdp.full_optim_state_dict(model, opt, rank0_only=False)
    _call(
        fsdp.rekey_optim_state_dict,
        full,
        ctx.impl.ns.OptimStateKeyType.PARAM_ID,
        model,
        optim_input=list(model.parameters()),
    )


def _unknown_state_key(ctx):
    model, opt = _stepped(ctx)
    osd = opt.state_dict()
    osd["state"]["conformance_counter"] = 1  # a user-defined state entry of no parameter
    _call(ctx.impl.ns.FullyShardedDataParallel.optim_state_dict, model, opt, osd)


OPTIM_SCENARIOS = {
    **{
        name: _legacy(name)
        for name in (
            "full_optim_state_dict",
            "sharded_optim_state_dict",
            "shard_full_optim_state_dict",
            "scatter_full_optim_state_dict",
            "flatten_sharded_optim_state_dict",
        )
    },
    # S51: optim_input is deprecated (here through rekey_optim_state_dict)
    "rekey_optim_input": (_rekey_optim_input, "optim_input", True),
    "unknown_state_key": (_unknown_state_key, "conformance_counter", True),
}


@check(
    area=AREA, requires=OPTIM, cases={k: {"scenario": k} for k in OPTIM_SCENARIOS}, world_sizes=(1,)
)
def fsdp1_optim_warning_caller(ctx, scenario):
    """X5: the FutureWarnings of FSDP1's legacy optimizer-state-dict methods (full_, sharded_,
    shard_full_, scatter_full_, flatten_sharded_optim_state_dict), of
    ``rekey_optim_state_dict(optim_input=)`` and the warning about an optimizer state entry of no
    parameter (``optim_state_dict``) are attributed to the caller."""
    fn, needle, required = OPTIM_SCENARIOS[scenario]
    _assert_attributed(ctx, _recorded(lambda: fn(ctx)), needle, scenario, required)


def _dsd():
    import torch.distributed.checkpoint.state_dict as dsd

    return dsd


def _dsd_model(ctx):
    return _fsdp1(ctx, nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def _dsd_submodules(ctx):
    model = _dsd_model(ctx)
    _call(_dsd().get_model_state_dict, model, submodules={model.module[0]})


def _dsd_module_keyed(ctx):
    dsd = _dsd()
    model = _dsd_model(ctx)
    first = model.module[0]
    sd = dsd.get_model_state_dict(model)
    part = {k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith("0.")}
    options = dsd.StateDictOptions(strict=False)
    _call(dsd.set_model_state_dict, model, {first: part}, options=options)


DSD_SCENARIOS = {
    "get_submodules": (_dsd_submodules, "submodules", True),
    "set_module_keyed": (_dsd_module_keyed, "Dict[nn.Module", True),
}


@check(
    area=AREA,
    requires={base.DCP_HELPERS, base.FSDP1_API},
    cases={k: {"scenario": k} for k in DSD_SCENARIOS},
    world_sizes=(1,),
)
def dsd_warning_caller(ctx, scenario):
    """X5: torch.distributed.checkpoint.state_dict's deprecation FutureWarnings
    (``get_model_state_dict(submodules=)``, a model state dict keyed by module for
    ``set_model_state_dict``) are attributed to the caller (an FSDP1 model)."""
    fn, needle, required = DSD_SCENARIOS[scenario]
    _assert_attributed(ctx, _recorded(lambda: fn(ctx)), needle, scenario, required)


class _ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).view(-1)


@check(area=AREA, requires={base.FSDP2_API}, world_sizes=(1,))
def fsdp2_view_output_warning_caller(ctx):
    """X5: FSDP2's warning that a unit's forward returned a view tensor is attributed to the
    module call (``model(x)``)."""
    model = _ViewOut().to(ctx.device)
    ctx.impl.ns.fully_shard(model, mesh=ctx.mesh)
    x = torch.ones(2, 4, device=ctx.device)
    _assert_attributed(
        ctx, _recorded(lambda: _call(model, x)), "returned a view tensor", "model(x)"
    )
