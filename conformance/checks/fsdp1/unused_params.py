"""Area "training": FSDP1 gradients of parameters that took no part in a forward (R1).

[Note: FSDP1's unused parameters]
FSDP1 reduces one flat gradient per unit: once a unit took part in backward, its flat gradient
covers every parameter flattened into it, and a parameter the forward did not read contributes
zeros. Upstream torch 2.13 exposes exactly that:
* ``use_orig_params=False``: the unit's ``flat_param.grad`` is rank r's padded chunk of the
  concatenated gradients with zeros in the unused parameters' ranges;
* ``use_orig_params=True``: each original parameter's sharded 1-D view gets a gradient view into
  that flat gradient (zeros for an unused one) on every rank whose shard holds part of it, and
  ``None`` on a rank whose shard holds none of it.
So an optimizer over an FSDP1 model steps an unused parameter as if its gradient were zero (weight
decay and momentum move it), unlike the unsharded model (FSDP2's rule, P19). The oracle here is
therefore the single-process model whose ``None`` gradients are replaced by zeros after each
backward (every unit of the model below runs every step): losses, gradients and parameters after
each SGD-with-momentum-and-weight-decay or AdamW step must equal it. Model, schedule and
optimizers are those of ``fully_shard/unused_params.py``.
"""

from __future__ import annotations

from conformance.adapters import base
from conformance.checks._shared.oracle import FP32, assert_close
from conformance.checks.fsdp1.training import (
    assert_orig_param_grads,
    assert_params_equal_oracle,
    expected_flat_chunk,
    flat_grads,
)
from conformance.checks.fully_shard.unused_params import (
    OPTIONAL,
    SCHEDULE,
    build,
    make_optimizer,
    step_losses,
    zero_fill_unused,
)
from conformance.registry import check

CASES = {
    f"{plan}-{optim}-{'orig' if orig else 'flat'}": {
        "plan": plan,
        "optim": optim,
        "use_orig_params": orig,
    }
    for plan, optim, orig in (
        ("root", "sgd-wd", False),
        ("nested", "adamw", False),
        ("root", "adamw", True),
        ("nested", "sgd-wd", True),
    )
}


@check(area="training", requires={base.TRAINING, base.FLAT_PARAM}, cases=CASES)
def flat_unused_param_grads(ctx, plan, optim, use_orig_params):
    """R1: in FSDP1 a unit's flat gradient covers its unused parameters with zeros; with
    ``use_orig_params=True`` each unused parameter's sharded view gets a zero gradient on every
    rank whose shard holds part of it (None elsewhere); losses, gradients and parameters after each
    step equal the oracle whose unused gradients are zeros (weight decay and momentum move them)."""
    model, oracle = build(ctx, plan, use_orig_params=use_orig_params)
    opt = make_optimizer(optim, model.parameters())
    oopt = make_optimizer(optim, oracle.parameters())
    for step in range(len(SCHEDULE)):
        step_losses(ctx, model, oracle, step)
        zero_fill_unused(oracle)
        what = f"step {step} (optional parameters used={SCHEDULE[step]})"
        if use_orig_params:
            assert_orig_param_grads(ctx, model, oracle, what)
            _assert_unused_views_zero(ctx, model, what, SCHEDULE[step])
        else:
            for fqns, grad in flat_grads(ctx, model):
                assert grad is not None, (
                    f"{ctx.where()} {what}: flat parameter of {fqns} has no gradient"
                )
                assert_close(
                    ctx,
                    f"{what}: flat gradient of {fqns} (vs the oracle's chunk, zeros for unused)",
                    grad.reshape(-1),
                    expected_flat_chunk(ctx, fqns, oracle),
                    FP32["grad"],
                )
        for o in (opt, oopt):
            o.step()
            o.zero_grad()
        assert_params_equal_oracle(ctx, model, oracle, f"after {what}")


def _assert_unused_views_zero(ctx, model, what: str, used: bool) -> None:
    """The unused parameters' gradient views are zero where this rank holds part of them."""
    if used:
        return
    views = ctx.impl.local_shards(model)
    grads = {ctx.impl.clean_fqn(n): p.grad for n, p in model.named_parameters()}
    for name in OPTIONAL:
        if views[name].local.numel() == 0:
            continue
        grad = grads.get(name)
        assert grad is not None and not grad.detach().abs().max().item(), (
            f"{ctx.where()} {what}: {name} (unused) holds {views[name].local.numel()} elements "
            f"here; its gradient must be a zero view of the flat gradient, got "
            f"{None if grad is None else grad.tolist()}"
        )
