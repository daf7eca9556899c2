"""The wrap part: auto-wrap policies, applying them, and planning them without side effects.

``reference.wrap`` reads like ``torch.distributed.fsdp.wrap``. Three modules, each importing only
the ones before it:

* ``_policies``: the policies (callable and ``_Policy``), ``enable_wrap`` / ``wrap`` and
  ``_recursive_wrap`` (upstream's ``wrap.py``);
* ``_wrap_utils``: applying a policy to a model, FSDP1's ``auto_wrap_policy`` (upstream's
  ``_wrap_utils.py``);
* ``_wrap_plan``: :func:`build_wrap_plan`, what a policy would wrap, without touching the model.

This part imports neither FSDP implementation; it recognises their modules by class name only
(``_wrap_utils._has_fsdp_state``).
"""

# ruff: noqa: F401, F403 (this module re-exports the names of its three modules)

from reference.wrap._policies import *
from reference.wrap._policies import (
    __all__,
    _or_policy,
    _Policy,
    _recursive_wrap,
    _wrap_module_cls_individually,
)
from reference.wrap._wrap_plan import WrapPlan, WrapPlanEntry, build_wrap_plan
from reference.wrap._wrap_utils import (
    _construct_wrap_fn,
    _post_order_apply,
    _run_mixed_precision_override_policy,
)
