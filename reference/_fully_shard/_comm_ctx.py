"""``share_comm_ctx``: several FSDP roots (pipeline stages) use one communication context.

Rules (upstream ``torch.distributed.fsdp.share_comm_ctx``):

* ``share_comm_ctx(modules)`` takes a list of ``FSDPModule`` s; an empty list does nothing; an entry
  that is not an ``FSDPModule`` raises ValueError "Expects list of FSDPModules but got <module>"
  before anything is shared.
* Afterwards every listed module (and each of its parameter groups) collects through the first
  module's context. Upstream's context is its set of accelerator streams and events, so sharing
  it changes where collectives are queued, never a value: training each module afterwards gives
  the same results as before the call.

The reference runs every collective synchronously on the caller's stream, so it has no context to
share: the function checks its argument and returns ``None``.
"""

from __future__ import annotations

from ._fully_shard import FSDPModule


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Let ``modules`` share one communication context (a no-op here; see the module docstring)."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
