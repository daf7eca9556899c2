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
