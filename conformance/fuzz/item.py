"""The pytest item of a fuzz case: hypothesis runs here, in the driver; each example is one task
for the persistent rank group (see the Note in :mod:`conformance.fuzz`)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis.errors import Flaky, Unsatisfiable

from conformance.fuzz import dropped, repro
from conformance.fuzz.strategies import examples
from conformance.plugin import CheckFailure, CheckItem, _format_failure, _session
from conformance.runner import protocol
from conformance.runner.protocol import Task

CI_EXAMPLES = 8  # examples per fuzz case without --fuzz-examples (derandomized: the same each run)
# after this long (CI budget / --fuzz-examples), shrinking settles on the smallest failing example
SHRINK_SECONDS = {"ci": 90.0, "deep": 300.0}


class ExampleFailed(Exception):
    """One example failed on at least one rank."""

    def __init__(self, example: dict, results):
        super().__init__(_format_failure(results))
        self.example, self.results = example, results


class FuzzItem(CheckItem):
    """Runs one fuzz check for one (implementation, world size, case) over hypothesis' examples."""

    def runtest(self):
        meta, session = self.meta, _session(self.config)
        impl = self._supported_implementation()
        missing = sorted(meta.spec.fn.fuzz_case_requires.get(meta.case, set()) - impl.capabilities)
        if missing:  # before hypothesis: rejecting every drawn example would take seconds
            pytest.skip(f"NotSupported: {impl.name} does not declare {', '.join(missing)}")
        deep = self.config.option.fuzz_examples
        timeout = meta.spec.timeout or self.config.option.check_timeout
        case_kwargs = meta.spec.cases[meta.case]
        stats = {"ran": 0, "unsupported": "", "first_failure": None, "smallest": None}
        shrink_for = SHRINK_SECONDS["deep" if deep else "ci"]
        drops = dropped(meta.spec.fn.fuzz_drops, meta.case, impl.name)
        features = meta.spec.fn.fuzz_features.difference(*(d.features for d in drops))

        def run(example):
            if (
                stats["smallest"] is not None
                and time.monotonic() > stats["first_failure"] + shrink_for
            ):
                if example == stats["smallest"].example:  # shrink budget spent: keep that one
                    raise stats["smallest"]
                return
            group = session.group(meta.world_size)
            results = group.run(
                Task(meta.spec.path, meta.impl_spec, {**case_kwargs, "example": example}, timeout)
            )
            if any(r.status == protocol.NOT_SUPPORTED for r in results) and all(
                r.status in (protocol.OK, protocol.NOT_SUPPORTED) for r in results
            ):
                stats["unsupported"] = next(
                    r.detail for r in results if r.status == protocol.NOT_SUPPORTED
                )
                reject()
            stats["ran"] += 1
            if any(r.status != protocol.OK for r in results):
                failure = ExampleFailed(example, results)
                if stats["first_failure"] is None:
                    stats["first_failure"] = time.monotonic()
                stats["smallest"] = failure  # hypothesis only moves to smaller failing examples
                self.rank_results = results
                raise failure
            self.rank_results = results

        prop = settings(
            max_examples=deep or CI_EXAMPLES,
            derandomize=not deep,
            database=None,
            deadline=None,
            verbosity=Verbosity.quiet,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.generate, Phase.shrink),
            report_multiple_bugs=False,
        )(given(examples(meta.world_size, impl, features))(run))
        try:
            prop()
        except Unsatisfiable:
            pytest.skip(f"NotSupported: {impl.name} does not support {stats['unsupported']}")
        except (ExampleFailed, Flaky) as exc:
            failure = exc if isinstance(exc, ExampleFailed) else stats["smallest"]
            raise self._failure(failure, stats["ran"], drops) from None
        self.user_properties.append(("fuzz_examples", stats["ran"]))

    def _failure(self, failure: ExampleFailed, ran: int, drops) -> CheckFailure:
        script = repro.snippet(self.meta, failure.example)
        self.user_properties.append(("repro_script", script))
        left_out = "".join(f"\n  {', '.join(sorted(d.features))}: {d.reason}" for d in drops)
        return CheckFailure(
            f"fuzz example failed (after {ran} example(s), shrunk):\n{failure}\n\n"
            + (
                f"Features left out of this case's examples for {self.meta.impl_name}:{left_out}\n\n"
                if drops
                else ""
            )
            + f"Standalone reproducer (save as repro.py, run `python repro.py`):\n\n{script}"
        )
