"""The language-model study's analysis (`docs/method.md`, "Estimands" to "Sample-size planning").

``document_stats``: trajectories → one row per (document, action) of replicate-averaged sufficient
statistics. ``bootstrap``: paired document resampling within strata. ``estimands``: every study
estimand as a (ratio of) document average(s), pooled and per stratum, with contrasts.
``prediction``: aggregate prediction of the population-average contrast. ``planning``: sample
sizes from development data. ``synthetic``: finite-state studies with exact answers.

``statistic_registry`` and ``estimand_registry``: one definition per document statistic and per
estimand, read by the statistics, the estimands, the plan, the tables and the README's
glossary. ``plan_precision``: the development stage's uncertainty about a planned half-width.
``prespecification``: the study's lock. ``groups``: a study's rollout groups. ``control``: the
full-retention control check. ``accuracy``: task accuracy per action and by divergence timing.
``cache_bytes``: each action's cache bytes beside its budget. ``swrb``: SWRB estimands.
"""
