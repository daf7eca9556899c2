"""A plug-in implementation for the harness self-tests: declares no capabilities."""

from conformance.adapters.base import Implementation


class FakeImpl(Implementation):
    name = "fake"
    capabilities = frozenset()

    @property
    def version(self) -> str:
        return "0.0-selftest"


def broken():
    raise RuntimeError("this factory is broken on purpose")


class VersionRaises(FakeImpl):
    """An adapter whose ``version`` property raises."""

    @property
    def version(self) -> str:
        raise RuntimeError("no version today")


def HangingSave():
    """The reference FSDP2, except that its state dict hangs inside the checkpoint save job (a
    subprocess the reshard checks start), so the job's stack must reach the report."""
    import time

    from conformance.adapters.registry import BUILTINS
    from conformance.checks.state_dict import reshard as state_dict_reshard

    impl = BUILTINS["reference"]()
    state_dict = impl.state_dict

    def hanging_state_dict(module, kind="full", **config):
        if state_dict_reshard.IN_SAVE_JOB:
            time.sleep(1000)
        return state_dict(module, kind, **config)

    impl.state_dict = hanging_state_dict
    return impl
