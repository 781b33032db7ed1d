"""Shared test configuration.

Hypothesis: under CI (``CI`` set) examples are derandomized, so a CI run is reproducible;
locally they are random, which keeps finding new cases. ``HYPOTHESIS_PROFILE`` overrides.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
