"""Area "state_dict": what an FSDP1 SHARDED load says about a key it lacks (S36).

[Note: a lacking key under strict=False]
``load_state_dict(sd, strict=False)`` under SHARDED_STATE_DICT of a dict without one parameter's
key loads the others and reports the key missing (S11); on the way the pre-load step that gathers
each parameter says, once per lacking key, that it did not find it: a diagnostic "Did not find
param with FQN <name>, skipping it" naming the parameter (its key, wrapper prefixes allowed; upstream torch logs it through
``logging``; an implementation may warn with ``warnings`` instead: either channel counts).
"""

from __future__ import annotations

import logging
import re
import warnings

from conformance.adapters import base
from conformance.checks._shared.sd_models import AREA, build, first_error_everywhere
from conformance.registry import check

MISSING = "inner.weight"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@check(
    area=AREA,
    requires={base.FLAT_PARAM, base.SHARDED_STATE_DICT, base.FSDP1_API},
    world_sizes=(2,),
)
def sharded_load_names_lacking_key(ctx):
    """S36: a SHARDED ``load_state_dict(strict=False)`` of a dict without ``inner.weight`` emits
    a diagnostic (warning or log record) "Did not find param with FQN ..." naming
    ``inner.weight``, and reports it missing."""
    sd = dict(ctx.impl.state_dict(build(ctx, salt=0), "sharded"))
    del sd[MISSING]
    dst = build(ctx, salt=1)
    records = _Records()
    # the root logger and the implementation's namespace logger (torch.distributed.fsdp keeps its
    # records to itself: propagate=False)
    loggers = [logging.getLogger(), logging.getLogger(ctx.impl.ns.__name__)]
    for logger in loggers:
        logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = first_error_everywhere(
                ctx, lambda: ctx.impl.load_state_dict(dst, sd, "sharded", strict=False)
            )
    finally:
        for logger in loggers:
            logger.removeHandler(records)
    said = [str(w.message) for w in caught] + records.messages
    named = [
        m
        for m in said
        for fqn in re.findall(r"Did not find param with FQN (\S+?),", m)
        if ctx.impl.clean_fqn(fqn) == MISSING
    ]
    assert named, (
        f"{ctx.where()} no diagnostic 'Did not find param with FQN ... {MISSING}' (warnings and "
        f"log records: {[m[:80] for m in said if 'deprecat' not in m][:6]})"
    )
    assert MISSING in result.missing_keys, (
        f"{ctx.where()} missing keys {result.missing_keys}, expected {MISSING} among them"
    )
