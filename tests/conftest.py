"""Shared pytest configuration for the project's own tests."""

import os

from hypothesis import HealthCheck, settings

# "ci" keeps property tests quick on a 2-core machine; "dev" explores more.
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
