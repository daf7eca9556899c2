"""Implementations for tests/harness/test_isolation.py: each registers a global module forward
pre-hook once, on first use; one declares it (``allowed_global_state``), one does not."""

import torch

from tests.harness.fake_impl import FakeImpl

_HANDLES: dict[type, object] = {}  # class -> the handle of the hook it registered


class HookOnceDeclared(FakeImpl):
    name = "hook-once-declared"
    allowed_global_state = ("torch.nn.modules.module._global_forward_pre_hooks",)

    def setup_once(self):
        if type(self) not in _HANDLES:
            _HANDLES[type(self)] = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: None
            )


class HookOnceUndeclared(HookOnceDeclared):
    name = "hook-once-undeclared"
    allowed_global_state = ()
