"""Area "fsdp1_runtime": the ``FSDP_*`` environment variables read when FSDP1 units are built:
``FSDP_USE_FULL_PREC_IN_EVAL`` (R54, R63), ``FSDP_USE_FAKE_ALL_GATHER`` /
``FSDP_USE_FAKE_REDUCE`` (R60), ``FSDP_SKIP_WRITEBACK_CHECK`` (R121) and
``FSDP_USE_UNSAFE_SETATTR`` (R94); and the
``TORCH_DISTRIBUTED_DEBUG=INFO`` log of each unit's post-backward (R120).

[Note: what the environment knobs promise]
* ``FSDP_USE_FULL_PREC_IN_EVAL=1`` makes a mixed-precision model compute in full precision in
  ``eval()`` mode, buffers included, and back in the low precision after ``train()`` (R54).
* ``FSDP_USE_FULL_PREC_IN_EVAL=1`` also covers a ``MixedPrecision`` without ``param_dtype``
  (only ``reduce_dtype`` and ``buffer_dtype``): in ``eval()`` mode the buffers are in full
  precision and the gradients are reduced in full precision, so an eval-mode backward gives the
  unsharded fp32 model's gradients (R63).
* ``FSDP_USE_FAKE_ALL_GATHER=1`` or ``FSDP_USE_FAKE_REDUCE=1`` alone skips that collective
  (values undefined) but a forward and backward still complete with the usual shapes; the first
  unit built under it in a process warns, naming the variable (R60). See [Note: a warning given
  once per process].
* ``FSDP_SKIP_WRITEBACK_CHECK=1`` with ``use_orig_params=True`` turns the writeback of R64 off:
  an original parameter whose ``.data`` the user replaced is not copied into the flat parameter,
  so the next forward computes with the values from before the replacement; the first unit
  built under it in a process warns, naming the variable (R121, once per process as R60).
* ``FSDP_USE_UNSAFE_SETATTR=1`` swaps parameters without calling a module's own
  ``__setattr__`` (without it the override is called) and changes nothing else: the names inside
  the forward and after a step, the output and the parameters after the step are as without it
  (R94).
* At debug level INFO (``TORCH_DISTRIBUTED_DEBUG=INFO``, or ``set_debug_level(INFO)`` before
  the units are built) with ``use_orig_params=True``, each unit's post-backward logs a WARNING
  naming its original parameters by their clean names from the root (R120).

[Note: a warning given once per process]
A warning that an implementation gives only once per process (upstream remembers that it has
logged it) cannot be asked of every construction: the suite runs many checks in one process, in
any order, so an earlier case may already have used it up. R60's check therefore listens from
before the first construction under the variable in its process to the end of its own: on the
first use of ``_warnings_naming`` a handler that keeps every record naming a fake-collective
variable or ``FSDP_SKIP_WRITEBACK_CHECK`` (R121 does the same) stays attached to the root logger and to the namespace's logger for the rest of the
process (``torch.distributed.fsdp`` keeps its records to itself), and each case asserts that
this process has by then seen a warning naming its variable, as a ``logging`` record at WARNING or
above or as a ``warnings.warn`` caught around its construction. This holds in every order because
no other module builds FSDP1 units with these variables set.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import warnings

import torch
import torch.distributed as dist
from torch import nn

from conformance.adapters import base
from conformance.checks._shared.fsdp1_setup import REQUIRES, _global_batch, _x
from conformance.checks._shared.oracle import FP32, B, assert_close
from conformance.checks._shared.sd_models import InnerHeadNet
from conformance.checks.fsdp1.summon_full_params import TwoUnits, visible
from conformance.checks.fsdp1.training import assert_orig_param_grads, assert_params_equal_oracle
from conformance.registry import check


# ------------------------------------------------------------------------------ R63
@contextlib.contextmanager
def _environment(values: dict[str, str | None]):
    """``os.environ`` with each name of ``values`` set to its value (None: unset) inside the block;
    every one of them as it was before afterwards."""
    saved = {name: os.environ.pop(name, None) for name in values}
    os.environ.update({name: v for name, v in values.items() if v is not None})
    try:
        yield
    finally:
        for name, old in saved.items():
            os.environ.pop(name, None)
            if old is not None:
                os.environ[name] = old


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.MIXED_PRECISION, base.FSDP1_FULL_PREC_IN_EVAL},
    world_sizes=(1, 2),
)
def full_precision_in_eval_without_param_dtype(ctx):
    """R63: ``FSDP_USE_FULL_PREC_IN_EVAL=1`` at construction with
    ``MixedPrecision(reduce_dtype=bf16, buffer_dtype=bf16)`` (no ``param_dtype``) on ``body`` and
    on the tensor-less root (``use_orig_params=True``): the buffer is bf16 in a ``train()`` forward,
    fp32 in an ``eval()`` one, bf16 again after ``train()``; an eval-mode forward and backward
    (the same batch on every rank) gives every parameter the unsharded fp32 model's gradient
    within fp32 tolerance (reduced in fp32, not rounded to bf16)."""
    ctx.seed(0)
    oracle = _EmptyRoot().to(ctx.device)
    mp = dict(reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    with _environment({"FSDP_USE_FULL_PREC_IN_EVAL": "1"}):
        model = ctx.impl.shard(
            copy.deepcopy(oracle),
            ctx,
            plan=[("body", {}), ("", {})],
            mixed_precision=mp,
            use_orig_params=True,
        )
    body = next(m for m in model.modules() if isinstance(m, _BufBody))
    seen: list[torch.dtype] = []
    body.register_forward_pre_hook(lambda m, args: seen.append(m.shift.dtype))
    x = _x(ctx, 4, 7)
    for mode, dtype in (
        ("train", torch.bfloat16),
        ("eval", torch.float32),
        ("train", torch.bfloat16),
    ):
        getattr(model, mode)()
        seen.clear()
        with torch.no_grad():
            model(x)
        assert seen == [dtype], (
            f"{ctx.where()} forward in {mode}() mode: buffer dtype {seen}, expected {dtype}"
        )
    model.eval()
    oracle.eval()
    model(x).square().sum().backward()
    oracle(x).square().sum().backward()
    assert_orig_param_grads(ctx, model, oracle, "eval-mode backward, no param_dtype")


# ------------------------------------------------------------------------------ R94
SETATTR_CALLS: list[str] = []  # names assigned through _CountingLinear.__setattr__


INSIDE: list[dict] = []  # per _CountingLinear forward: name -> (registered, an nn.Parameter)


class _CountingLinear(nn.Linear):
    """A Linear whose ``__setattr__`` records assignments to ``weight`` and ``bias`` and whose
    forward records what each of the two names is."""

    def __setattr__(self, name, value):
        if name in ("weight", "bias"):
            SETATTR_CALLS.append(name)
        super().__setattr__(name, value)

    def forward(self, x):
        registered = dict(self.named_parameters(recurse=False))
        INSIDE.append(
            {
                n: (n in registered, isinstance(getattr(self, n), nn.Parameter))
                for n in ("weight", "bias")
            }
        )
        return super().forward(x)


def _names_after(model) -> dict:
    """Per counting Linear and name: registered, an ``nn.Parameter``, the registered object."""
    out = {}
    linears = [m for m in model.modules() if isinstance(m, _CountingLinear)]
    for i, m in enumerate(linears):
        registered = dict(m.named_parameters(recurse=False))
        for n in ("weight", "bias"):
            value = getattr(m, n)
            out[f"{i}.{n}"] = (
                n in registered,
                isinstance(value, nn.Parameter),
                value is registered.get(n),
            )
    return out


def _shard_with_env(ctx, module, value, **kwargs):
    """``ctx.impl.shard`` with ``FSDP_USE_UNSAFE_SETATTR`` set to ``value`` (None: unset) during
    construction only; the environment is restored after it."""
    with _environment({UNSAFE_SETATTR: value}):
        return ctx.impl.shard(module, ctx, **kwargs)


UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"


@check(
    area="fsdp1_runtime",
    requires=REQUIRES | {base.TRAINING, base.FSDP1_UNSAFE_SETATTR},
    cases={"flat": {"orig": False}, "orig-params": {"orig": True}},
    world_sizes=(1, 2),
)
def unsafe_setattr_knob(ctx, orig):
    """R94: one unit over ``Sequential(L(4, 4), Tanh(), L(4, 2))``, ``L`` a Linear whose
    ``__setattr__`` records assignments to ``weight`` and ``bias``, built without and with
    ``FSDP_USE_UNSAFE_SETATTR=1`` in the environment (during construction only), with
    ``use_orig_params`` False and True: over a forward (rank r's samples), backward and SGD step
    the override is called without the knob and never with it. Everything else is as without it:
    what each name is inside the forward (a registered parameter or not, an ``nn.Parameter`` or
    not) and after the step (also whether it is the registered parameter); the forward output
    and the parameters after the step equal the unsharded model's."""
    ctx.seed(0)
    initial = nn.Sequential(_CountingLinear(4, 4), nn.Tanh(), _CountingLinear(4, 2))
    initial = initial.to(ctx.device)
    oracle = copy.deepcopy(initial)
    x = _global_batch(ctx, 94)
    mine = slice(ctx.rank * B, (ctx.rank + 1) * B)
    want_out = oracle(x)[mine].detach()
    oracle(x).square().sum().div(ctx.world_size * B).backward()
    torch.optim.SGD(oracle.parameters(), lr=0.1).step()
    seen = {}
    for knob in (None, "1"):
        model = _shard_with_env(ctx, copy.deepcopy(initial), knob, use_orig_params=orig)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        SETATTR_CALLS.clear()
        INSIDE.clear()
        out = model(x[mine])
        assert_close(ctx, f"forward (knob {knob})", out, want_out, FP32["loss"])
        out.square().sum().div(B).backward()
        opt.step()
        seen[knob] = (list(SETATTR_CALLS), list(INSIDE), _names_after(model))
        assert_params_equal_oracle(ctx, model, oracle, f"after a step (knob {knob})")
    assert seen[None][0], (
        f"{ctx.where()} without {UNSAFE_SETATTR}: the modules' __setattr__ was never called"
    )
    assert not seen["1"][0], (
        f"{ctx.where()} with {UNSAFE_SETATTR}=1: the modules' __setattr__ was called for "
        f"{seen['1'][0]}"
    )
    for i, what in ((1, "inside the forward"), (2, "after the step")):
        assert seen["1"][i] == seen[None][i], (
            f"{ctx.where()} with {UNSAFE_SETATTR}=1, the names {what}: {seen['1'][i]}, "
            f"without it: {seen[None][i]}"
        )


class _BufBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("shift", torch.linspace(-1.0, 1.0, 3))

    def forward(self, x):
        return self.lin(x) + self.shift


class _EmptyRoot(nn.Module):
    """A root without tensors of its own over one unit ``body`` (Linear(4, 3) + a buffer)."""

    def __init__(self):
        super().__init__()
        self.body = _BufBody()

    def forward(self, x):
        return self.body(x)


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.FSDP1_FULL_PREC_IN_EVAL},
    world_sizes=(1, 2),
)
def full_precision_in_eval(ctx):
    """R54: with ``FSDP_USE_FULL_PREC_IN_EVAL=1`` set at construction and
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)`` on ``body`` and on
    the tensor-less root: in ``train()`` mode the forward is bf16 (output and buffer bf16); after
    ``eval()`` it runs in fp32 (buffer fp32, output fp32 equal to the unsharded fp32 model's within
    fp32 tolerance); after ``train()`` again it is bf16 with a bf16 buffer."""
    ctx.seed(0)
    oracle = _EmptyRoot().to(ctx.device)
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    with _environment({"FSDP_USE_FULL_PREC_IN_EVAL": "1"}):
        model = ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=[("body", {}), ("", {})], mixed_precision=mp
        )
    body = next(m for m in model.modules() if isinstance(m, _BufBody))
    seen: list[torch.dtype] = []
    body.register_forward_pre_hook(lambda m, args: seen.append(m.shift.dtype))
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(6)).to(ctx.device)
    for mode, dtype in (
        ("train", torch.bfloat16),
        ("eval", torch.float32),
        ("train", torch.bfloat16),
    ):
        getattr(model, mode)()
        seen.clear()
        with torch.no_grad():
            out = model(x)
        where = f"forward in {mode}() mode"
        assert seen == [dtype], f"{ctx.where()} {where}: buffer dtype {seen}, expected {dtype}"
        assert out.dtype == dtype, f"{ctx.where()} {where}: output {out.dtype}, expected {dtype}"
        if dtype == torch.float32:
            assert_close(ctx, where, out, oracle(x), FP32["loss"])


FAKE_CASES = {
    "all-gather": {"var": "FSDP_USE_FAKE_ALL_GATHER"},
    "reduce": {"var": "FSDP_USE_FAKE_REDUCE"},
}


SKIP_WRITEBACK = "FSDP_SKIP_WRITEBACK_CHECK"
# The variables whose warning upstream gives once per process.
ONCE_PER_PROCESS = (*(case["var"] for case in FAKE_CASES.values()), SKIP_WRITEBACK)


class _OncePerProcessWarnings(logging.Handler):
    """Keeps the message of every record at WARNING or above that names a variable of
    ``ONCE_PER_PROCESS`` (see [Note: a warning given once per process])."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if any(var in text for var in ONCE_PER_PROCESS):
            self.messages.append(text)


_SEEN = _OncePerProcessWarnings()


def _warnings_naming(ctx, var: str) -> list[str]:
    """Attach ``_SEEN`` (once) to the root logger and the namespace's logger; the warnings this
    process has seen so far that name ``var``."""
    for logger in (logging.getLogger(), logging.getLogger(ctx.impl.ns.__name__)):
        if _SEEN not in logger.handlers:
            logger.addHandler(_SEEN)
    return [m for m in _SEEN.messages if var in m]


@check(
    area="fsdp1_runtime",
    requires={base.FLAT_PARAM, base.FSDP1_API, base.TRAINING, base.FSDP1_FAKE_COLLECTIVES},
    cases=FAKE_CASES,
    min_world_size=2,
)
def fake_collectives_knob(ctx, var):
    """R60: with one of ``FSDP_USE_FAKE_ALL_GATHER=1`` / ``FSDP_USE_FAKE_REDUCE=1`` (the other
    unset) in the environment while ``InnerHeadNet`` is wrapped (``inner`` its own unit, both
    sharded), a forward and a backward complete: the output has the unsharded model's shape and
    every flat parameter a gradient of its shard's shape (the values are undefined by design).
    The environment is restored right after construction, where the units read it. By the end of
    the construction this process has warned naming the variable (a ``logging`` record at WARNING
    or above, or a ``warnings.warn``), which it may do once per process only (see [Note: a
    warning given once per process])."""
    others = {case["var"]: None for case in FAKE_CASES.values()}
    _warnings_naming(ctx, var)  # listening before the construction
    with _environment({**others, var: "1"}):
        ctx.seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = ctx.impl.shard(
                InnerHeadNet().to(ctx.device), ctx, plan=[("inner", {}), ("", {})]
            )
    _SEEN.messages += [str(w.message) for w in caught if var in str(w.message)]
    seen = _warnings_naming(ctx, var)
    assert seen, (
        f"{ctx.where()} {var}=1: no warning naming {var} in this process by the end of the "
        "construction (neither a logging record at WARNING or above nor a warnings.warn)"
    )
    x = torch.randn(B, 4, generator=torch.Generator().manual_seed(8)).to(ctx.device)
    out = model(x)
    assert tuple(out.shape) == (B, 3), f"{ctx.where()} {var}=1: output shape {tuple(out.shape)}"
    out.sum().backward()
    for fqns, grad in ctx.impl.flat_grads(model):
        shard = dict((tuple(f), t) for f, t in ctx.impl.flat_shards(model))[tuple(fqns)]
        assert grad is not None and grad.shape == shard.shape, (
            f"{ctx.where()} {var}=1: flat gradient of {fqns} is "
            f"{None if grad is None else tuple(grad.shape)}, expected {tuple(shard.shape)}"
        )


# ------------------------------------------------------------------------------ R121
@check(area="fsdp1_runtime", requires=REQUIRES, world_sizes=(1, 2))
def skip_writeback_check_knob(ctx):
    """R121: ``TwoUnits`` wrapped (``inner`` its own unit, ``use_orig_params=True``) with
    ``FSDP_SKIP_WRITEBACK_CHECK=1`` in the environment (restored right after construction, where
    the units read it): by the end of the construction this process has warned naming the
    variable (once per process, as R60); ``head.weight.data`` then replaced outside forward by a
    tensor of its sharded shape holding 0.5 is not written back: the next forward (no_grad)
    equals the unsharded model with its original ``head.weight``, not the one holding 0.5."""
    _warnings_naming(ctx, SKIP_WRITEBACK)  # listening before the construction
    ctx.seed(0)
    oracle = TwoUnits().to(ctx.device)
    with _environment({SKIP_WRITEBACK: "1"}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ctx.impl.shard(
            copy.deepcopy(oracle), ctx, plan=[("inner", {}), ("", {})], use_orig_params=True
        )
    _SEEN.messages += [str(w.message) for w in caught if SKIP_WRITEBACK in str(w.message)]
    assert _warnings_naming(ctx, SKIP_WRITEBACK), (
        f"{ctx.where()} {SKIP_WRITEBACK}=1: no warning naming it in this process by the end of "
        "the construction (neither a logging record at WARNING or above nor a warnings.warn)"
    )
    p = visible(ctx, model)["head.weight"]
    with torch.no_grad():
        p.data = torch.full_like(p, 0.5)
    x = _x(ctx, 5, 8)
    with torch.no_grad():
        out = model(x)
        want = oracle(x)
        oracle.head.weight.fill_(0.5)
        written = oracle(x)
    assert not torch.allclose(out, written), (
        f"{ctx.where()} {SKIP_WRITEBACK}=1: the forward used the replaced head.weight (0.5s)"
    )
    assert_close(
        ctx, "forward after head.weight.data = 0.5s, not written back", out, want, FP32["loss"]
    )


# ------------------------------------------------------------------------------ R120
class _Records(logging.Handler):
    """Keeps the message of every record at WARNING or above while attached."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@check(area="fsdp1_runtime", requires=REQUIRES | {base.TRAINING}, world_sizes=(1, 2))
def post_backward_log_at_info(ctx):
    """R120: debug level INFO (``torch.distributed.set_debug_level``) from before construction to
    the end of a backward, ``use_orig_params=True``, ``InnerHeadNet`` with ``inner`` its own unit
    and the root holding ``head``: the backward of one forward (the same batch on every rank) logs,
    at WARNING or above, for each unit a record naming the clean names of exactly that unit's
    parameters (``inner.weight``, ``inner.bias``; ``head.weight``, ``head.bias``) and no other
    parameter, with ``post-backward`` in it."""
    units = [("inner.weight", "inner.bias"), ("head.weight", "head.bias")]
    every = {n for unit in units for n in unit}
    seen = _Records()
    loggers = (logging.getLogger(), logging.getLogger(ctx.impl.ns.__name__))
    old_level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.INFO)
    try:
        for logger in loggers:
            logger.addHandler(seen)
        ctx.seed(0)
        model = ctx.impl.shard(
            InnerHeadNet().to(ctx.device), ctx, plan=[("inner", {}), ("", {})], use_orig_params=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(_x(ctx, 4, 12)).sum().backward()
    finally:
        dist.set_debug_level(old_level)
        for logger in loggers:
            logger.removeHandler(seen)
    logs = [m for m in seen.messages if "post-backward" in m]
    for unit in units:
        hits = [
            m
            for m in logs
            if set(unit) <= set(re.findall(r"[A-Za-z_][\w.]*", m))
            and not (every - set(unit)) & set(re.findall(r"[A-Za-z_][\w.]*", m))
        ]
        assert hits, (
            f"{ctx.where()} at debug level INFO no post-backward WARNING named exactly the unit's "
            f"parameters {list(unit)}; post-backward records: {[m[:160] for m in logs]}"
        )
