import os

from hypothesis import HealthCheck, settings

# `dev` explores more; CI (and the default) keeps the whole suite under ten minutes on 2 cores (at 25
# examples it took 553-608 s in session 8; every property stays, each with fewer examples here).
settings.register_profile("ci", max_examples=18, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
