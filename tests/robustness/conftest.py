"""Hypothesis profiles for the robustness property tests.

"ci" (default): a few hundred random graphs in total, derandomized (the same graphs every
run: CI never flakes), well under a minute on 2 cores.
"slow": thousands of random graphs, different every run (HYPOTHESIS_PROFILE=slow, or
GRAPHOPT_PROPERTY_EXAMPLES=N to choose the count, as tools/reliability_report.py does).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.large_base_example]

settings.register_profile("ci", max_examples=250, deadline=None, derandomize=True,
                          suppress_health_check=_SUPPRESS, print_blob=True, database=None)
settings.register_profile("slow", max_examples=3000, deadline=None,
                          suppress_health_check=_SUPPRESS, print_blob=True)
_count = os.environ.get("GRAPHOPT_PROPERTY_EXAMPLES")
if _count:
    settings.register_profile("custom", max_examples=int(_count), deadline=None,
                              suppress_health_check=_SUPPRESS, print_blob=True)
settings.load_profile("custom" if _count else os.environ.get("HYPOTHESIS_PROFILE", "ci"))
