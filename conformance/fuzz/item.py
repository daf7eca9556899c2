"""The pytest item of a fuzz case: hypothesis runs here, in the driver; each example is one task
for the persistent rank group (see the Note in :mod:`conformance.fuzz`)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
from hypothesis.errors import Flaky, Unsatisfiable

from conformance.adapters.base import NotSupported, not_supported_reason
from conformance.fuzz import dropped, repro
from conformance.fuzz.strategies import examples
from conformance.plugin import CheckFailure, CheckItem, _format_failure, _session, judged
from conformance.runner import protocol
from conformance.runner.protocol import Task

CI_EXAMPLES = 8  # examples per fuzz case without --fuzz-examples (derandomized: the same each run)
# [Note: the default budget per world size] At world sizes 3 and up a default run draws
# half as many examples: what a larger group adds (uneven rows and padding at 3, a second pair of
# ranks at 4) shows on any example, while the variety of the examples themselves is paid for at
# world sizes 1 and 2, where an example costs a quarter as much. It takes about 25 s off the
# default matrix on 2 cores. ``--fuzz-examples N`` is the same N at every world size.
LARGE_WORLD_EXAMPLES = 4


def default_budget(world_size: int) -> int:
    """Examples per fuzz case without ``--fuzz-examples`` (see [Note: the default budget per world
    size])."""
    return CI_EXAMPLES if world_size <= 2 else LARGE_WORLD_EXAMPLES


# after this long (CI budget / --fuzz-examples), shrinking settles on the smallest failing example
SHRINK_SECONDS = {"ci": 90.0, "deep": 300.0}
SHRINK_ENV = "FSDP_CONFORMANCE_FUZZ_SHRINK_SECONDS"  # overrides both (0: report the first failure)


CACHE_ENV = "FSDP_CONFORMANCE_CACHE_DIR"  # hypothesis' files; default <reports-dir>/.cache


def cache_dir(reports_dir) -> Path | None:
    """Where a run's caches go (hypothesis' storage): ``$FSDP_CONFORMANCE_CACHE_DIR``, else
    ``<reports-dir>/.cache``; never the current directory (None: no reports, nothing set)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return None if reports_dir is None else Path(reports_dir) / ".cache"


def use_cache_dir(reports_dir) -> None:
    """Point hypothesis' storage (its ``constants`` cache; examples are never saved: no database)
    at :func:`cache_dir` before a fuzz case draws anything."""
    from hypothesis.configuration import set_hypothesis_home_dir

    directory = cache_dir(reports_dir)
    if directory is not None:
        set_hypothesis_home_dir(directory / "hypothesis")


def shrink_seconds(deep: bool) -> float:
    """How long shrinking may run after a case's first failing example (see :data:`SHRINK_ENV`)."""
    value = os.environ.get(SHRINK_ENV)
    return float(value) if value else SHRINK_SECONDS["deep" if deep else "ci"]


def digest(value) -> str:
    """A short, stable hash of a plain value (an example, a case's settings)."""
    text = json.dumps(value, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
            pytest.skip(not_supported_reason(impl.name, str(NotSupported.undeclared(*missing))))
        use_cache_dir(session.options.reports_dir)  # not ./.hypothesis
        deep = self.config.option.fuzz_examples
        budget = deep or default_budget(meta.world_size)
        timeout = meta.spec.timeout or self.config.option.check_timeout
        case_kwargs = meta.spec.cases[meta.case]
        shrink_for = shrink_seconds(bool(deep))
        drops = dropped(meta.spec.fn.fuzz_drops, meta.case, impl.name)
        features = meta.spec.fn.fuzz_features.difference(*(d.features for d in drops))
        settings_used = {
            "check": meta.spec.path,
            "case": meta.case,
            "case_kwargs": case_kwargs,
            "world_size": meta.world_size,
            "features": sorted(features),
            "budget": budget,
            "derandomize": not deep,
            "timeout": timeout,
        }
        # [Note: what a fuzz case ran] ``drawn``: digests of the examples hypothesis generated
        # and the ranks ran, in order, up to and including the first failing one (hypothesis
        # generates no more after it); ``shrink_runs``: examples run after it while shrinking;
        # ``not_supported``: drawn examples the implementation declined (not in the budget).
        stats = {
            "drawn": [],
            "not_supported": 0,
            "shrink_runs": 0,
            "unsupported": "",
            "first_failure": None,
            "smallest": None,
        }

        def run(example):
            if (
                stats["smallest"] is not None
                and time.monotonic() > stats["first_failure"] + shrink_for
            ):
                if example == stats["smallest"].example:  # shrink budget spent: keep that one
                    raise stats["smallest"]
                return
            if stats["first_failure"] is None:  # before the run: an example that crashes counts
                stats["drawn"].append(digest(example))
            else:
                stats["shrink_runs"] += 1
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
                if stats["first_failure"] is None:  # not run: not in the budget
                    stats["drawn"].pop()
                    stats["not_supported"] += 1
                else:
                    stats["shrink_runs"] -= 1
                reject()
            if any(r.status != protocol.OK for r in results):
                failure = ExampleFailed(example, results)
                if stats["first_failure"] is None:
                    stats["first_failure"] = time.monotonic()
                stats["smallest"] = failure  # hypothesis only moves to smaller failing examples
                self.rank_results = results
                raise failure
            self.rank_results = results

        prop = settings(
            max_examples=budget,
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
            pytest.skip(not_supported_reason(impl.name, stats["unsupported"]))
        except (ExampleFailed, Flaky) as exc:
            failure = exc if isinstance(exc, ExampleFailed) else stats["smallest"]
            raise self._failure(failure, stats, budget, shrink_for, drops) from None
        finally:
            self.user_properties.append(("fuzz", ran_record(settings_used, stats, budget)))
        self.user_properties.append(("fuzz_examples", len(stats["drawn"])))

    def _failure(self, failure: ExampleFailed, stats, budget, shrink_for, drops) -> CheckFailure:
        script = repro.snippet(self.meta, failure.example)
        self.user_properties.append(("repro_script", script))
        left_out = "".join(f"\n  {', '.join(sorted(d.features))}: {d.reason}" for d in drops)
        return judged(
            self.expectation,
            failure.results,
            f"fuzz example failed: {counts_line(stats, budget, shrink_for)}:\n{failure}\n\n"
            + (
                f"Features left out of this case's examples for {self.meta.impl_name}:{left_out}\n\n"
                if drops
                else ""
            )
            + f"Standalone reproducer (save as repro.py, run `python repro.py`):\n\n{script}",
        )


def counts_line(stats, budget: int, shrink_for: float) -> str:
    """How many examples the case drew, out of which budget, and what shrinking ran."""
    drawn = len(stats["drawn"])
    text = f"example {drawn} of this case's budget of {budget} failed"
    if stats["not_supported"]:
        text += f" ({stats['not_supported']} more drawn, not supported by the implementation)"
    if not shrink_for:
        return text + "; not shrunk (shrinking is off in this run), the failing example is"
    return text + (
        f"; shrinking ran {stats['shrink_runs']} more example(s) (for up to {shrink_for:.0f} s), "
        "the smallest failing one is"
    )


def ran_record(settings_used: dict, stats, budget: int) -> dict:
    """The case record's ``fuzz`` field: what the case ran, so that two implementations' runs of
    it can be compared (the self-test credits a fault's fuzz failure only when its control ran
    the same settings and examples and passed; see :mod:`conformance.selftest.score`)."""
    settings_digest = digest(settings_used)
    return {
        "settings": settings_digest,
        "drawn": list(stats["drawn"]),
        "fingerprint": digest([settings_digest, stats["drawn"]]),
        "budget": budget,
        "not_supported": stats["not_supported"],
        "shrink_runs": stats["shrink_runs"],
        "failed": stats["first_failure"] is not None,
    }
