"""Figures (seaborn, PNG + PDF) for the studies.

:mod:`kvdiverge.plots.base` (house style, PNG + PDF), :mod:`kvdiverge.plots.theory` (figure 1),
:mod:`kvdiverge.plots.finite_state` (figures 2 and 4), :mod:`kvdiverge.plots.study` with
:mod:`kvdiverge.plots.study_style` and :mod:`kvdiverge.plots.contrasts` (figures 5-7 and the
decomposition bars), :mod:`kvdiverge.plots.accuracy` (figure A), :mod:`kvdiverge.plots.sweep`
(the budget sweep) and :mod:`kvdiverge.plots.merge` (``kvdiverge merge``).
"""
