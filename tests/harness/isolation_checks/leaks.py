"""Checks for tests/harness/test_isolation.py (collected with --check-dir
tests/harness/isolation_checks): one leaves process-global state behind, one needs it clean, one
lets its implementation register a global hook."""

import os

import torch
import torch.distributed as dist

from conformance.registry import Skip, check

AREA = "isolation"
MARKER = "FSDP_ISOLATION_TEST_LEAK"  # the variable the leaking check sets
# the working directory the run started in (the test passes it; the leaking check leaves /)
START_DIR = "FSDP_ISOLATION_TEST_CWD"


def _not_all_reduce(*args, **kwargs):
    raise RuntimeError("a monkeypatched all_reduce that a check left behind")


TWICE = {"first": {}, "second": {}}  # so that one run can hold both orders


@check(area=AREA, cases=TWICE)
def leaks_global_state(ctx):
    """Changes process-global state and returns: the runner must report it and put it back."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ[MARKER] = "1"
    os.chdir("/")
    torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    dist.all_reduce = _not_all_reduce
    torch.use_deterministic_algorithms(True, warn_only=True)


_ENTERED = []  # the inference-mode guard stays entered while this holds it


@check(area=AREA)
def leaves_inference_mode(ctx):
    """Enters inference mode and never leaves it: the state cannot be put back from outside, so
    the runner must report it and restart the group."""
    mode = torch.inference_mode()
    mode.__enter__()
    _ENTERED.append(mode)


@check(area=AREA, cases=TWICE)
def needs_clean_state(ctx):
    """Passes only in a process whose global state is as a fresh worker's (whatever ran before)."""
    found = {
        "default dtype": torch.get_default_dtype(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "environment": os.environ.get(MARKER),
        "working directory": os.getcwd(),
        "global forward pre-hooks": len(torch.nn.modules.module._global_forward_pre_hooks),
        "all_reduce": dist.all_reduce is dist.distributed_c10d.all_reduce,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    clean = {
        "default dtype": torch.float32,
        "grad mode": True,
        "inference mode": False,
        "environment": None,
        "working directory": os.environ[START_DIR],
        "global forward pre-hooks": 0,
        "all_reduce": True,
        "deterministic": False,
    }
    wrong = {k: v for k, v in found.items() if clean[k] != v}
    assert not wrong, f"{ctx.where()} inherited state {wrong}, expected {clean}"
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == ctx.world_size, f"{ctx.where()} all_reduce gave {t.item()}"


@check(area=AREA)
def implementation_hooks_once(ctx):
    """The implementation registers a global module hook on first use (its ``setup_once``)."""
    setup = getattr(ctx.impl, "setup_once", None)
    if setup is None:
        raise Skip("this implementation has no setup_once")
    setup()
