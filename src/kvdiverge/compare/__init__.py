"""``kvdiverge compare``: a small study without Snakemake (:mod:`kvdiverge.compare.run`), its
actions and labels (:mod:`~kvdiverge.compare.actions`), its output folder
(:mod:`~kvdiverge.compare.folder`), the contrasts against a baseline
(:mod:`~kvdiverge.compare.contrasts`) and the generations side by side
(:mod:`kvdiverge.tables.generations`, which the pipeline's report page uses too). Every
input is checked by :mod:`~kvdiverge.compare.inputs`; :mod:`~kvdiverge.compare.tasks` builds
``--tasks`` suites, :mod:`~kvdiverge.compare.sweep` the paired budget grids,
:mod:`~kvdiverge.compare.record` the folder's ``metrics.json`` record and
:mod:`~kvdiverge.compare.merge` ``kvdiverge merge``."""

from kvdiverge.compare.actions import CompareError, LabelledAction, parse_action_list, parse_actions
from kvdiverge.compare.run import CompareResult, compare, planned_files

__all__ = [
    "CompareError",
    "CompareResult",
    "LabelledAction",
    "compare",
    "parse_action_list",
    "parse_actions",
    "planned_files",
]
