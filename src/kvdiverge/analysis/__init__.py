"""The language-model study's analysis (`docs/method.md`, "Estimands" to "Sample-size planning").

``document_stats``: trajectories → one row per (document, action) of replicate-averaged sufficient
statistics. ``bootstrap``: paired document resampling within strata. ``estimands``: every study
estimand as a (ratio of) document average(s), pooled and per stratum, with contrasts.
``prediction``: aggregate prediction of the population-average contrast. ``planning``: sample
sizes from development data. ``synthetic``: finite-state studies with exact answers.
"""
