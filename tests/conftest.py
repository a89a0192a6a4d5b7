"""Shared test settings: bounded hypothesis runs so CI time stays predictable; tests/support on the path."""

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

# Helpers shared by the tests, and the scripts multi-process tests launch, live in tests/support.
SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
