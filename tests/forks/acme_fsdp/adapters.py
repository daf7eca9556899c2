"""Acme's conformance adapters, one per entry point (``acme_fsdp-0.1.dist-info/entry_points.txt``).

* ``acme-fsdp2`` / ``acme-fsdp1``: upstream FSDP2 / FSDP1 under Acme's names, declaring the base
  whose known deviations they keep (``inherits``): the whole default matrix runs with 0 failures
  and the same expected failures as torch-fsdp2 / torch-fsdp1.
* ``acme-fsdp2-bare`` / ``acme-fsdp1-bare``: the same forks without ``inherits``: they fail
  where upstream's known deviations show, and each such failure names the deviation and how to
  inherit it.
* ``acme-shell``: FSDP1 behind Acme's own wrapper module, which inserts ``_acme_wrapped`` into
  every module, parameter and buffer name; its adapter maps those names back (``clean_fqn``), so the
  checks run unchanged. ``acme-shell-unclean`` is the same fork without that mapping (a control:
  the name-sensitive checks fail on it).
* ``acme-cuda``: a fork that runs on CUDA only (``devices``): a CPU run refuses it at start.
"""

from __future__ import annotations

from torch import nn

from conformance.adapters import FlatParamAdapter, FullyShardAdapter

NAMESPACE = "acme_fsdp.fsdp"
VERSION = "acme 0.1 (upstream torch FSDP, renamed)"


class AcmeFSDP2(FullyShardAdapter):
    name = "acme-fsdp2"
    inherits = "torch-fsdp2"

    def __init__(self):
        super().__init__(NAMESPACE, version=VERSION)


class AcmeFSDP1(FlatParamAdapter):
    name = "acme-fsdp1"
    inherits = "torch-fsdp1"

    def __init__(self):
        super().__init__(NAMESPACE, version=VERSION)


def acme_fsdp2_bare():
    """The FSDP2 fork with no base declared (the instance style: ``FullyShardAdapter(...)``)."""
    return FullyShardAdapter(NAMESPACE, name="acme-fsdp2-bare", version=VERSION)


def acme_fsdp1_bare():
    return FlatParamAdapter(NAMESPACE, name="acme-fsdp1-bare", version=VERSION)


class AcmeShell(nn.Module):
    """Acme's wrapper: the sharded model lives under the attribute ``_acme_wrapped``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._acme_wrapped = module

    def forward(self, *args, **kwargs):
        return self._acme_wrapped(*args, **kwargs)


PREFIX = "_acme_wrapped"


class AcmeShellFSDP1Unclean(FlatParamAdapter):
    """FSDP1 inside :class:`AcmeShell`; state dicts keyed by clean names, but ``clean_fqn`` knows
    only torch's wrapper prefixes."""

    name = "acme-shell-unclean"
    inherits = "torch-fsdp1"

    def __init__(self):
        super().__init__(NAMESPACE, version=VERSION)

    def shard(self, module: nn.Module, ctx, *, plan=None, **options) -> nn.Module:
        return AcmeShell(super().shard(module, ctx, plan=plan, **options))

    def state_dict(self, module: nn.Module, kind: str = "full", **config) -> dict:
        sd = super().state_dict(module, kind, **config)
        return {_strip(k): v for k, v in sd.items()}

    def load_state_dict(self, module, state_dict, kind="full", *, strict=True, **config):
        keyed = {f"{PREFIX}.{k}": v for k, v in state_dict.items()}
        return super().load_state_dict(module, keyed, kind, strict=strict, **config)


class AcmeShellFSDP1(AcmeShellFSDP1Unclean):
    """:class:`AcmeShellFSDP1Unclean` whose ``clean_fqn`` also drops Acme's own prefix."""

    name = "acme-shell"

    def clean_fqn(self, name: str) -> str:
        return super().clean_fqn(_strip(name))


def _strip(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != PREFIX)


class AcmeCudaOnly(FullyShardAdapter):
    name = "acme-cuda"
    inherits = "torch-fsdp2"
    devices = frozenset({"cuda"})

    def __init__(self):
        super().__init__(NAMESPACE, version=VERSION)
