"""Rule prediction: aggregate prediction and Table 4 contrasts."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import polars as pl  # noqa: E402

from kvdiverge.analysis.document_stats import AnalysisInputError, read_document_stats  # noqa: E402
from kvdiverge.analysis.estimands import study_seed  # noqa: E402
from kvdiverge.analysis.prediction import prediction_table  # noqa: E402
from kvdiverge.io import atomic_path  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs  # noqa: E402

p = snakemake.params
study = snakemake.wildcards.study
if not p.pair:
    raise AnalysisInputError(
        f"config.analysis.prediction.pairs: no action pair for study {study!r}"
    )
settings = p.settings
tables = []
for model, path in keyed_inputs(snakemake.input, "stats").items():
    stats, clock = read_document_stats(path)
    tables.append(
        prediction_table(
            stats,
            clock,
            model=model,
            pair=tuple(p.pair),
            eval_cohort=p.eval_cohort,
            draws=settings["draws"],
            seed=study_seed(p.seed, study),
            alpha=p.alpha,
            comparisons=settings["comparisons"],
            margin=settings["margin"],
            level=p.level,
            folds=settings["folds"],
            where=str(path),
        )
    )
with atomic_path(snakemake.output[0], suffix=".csv") as tmp:
    pl.concat(tables).write_csv(tmp)
log.info("wrote %s", snakemake.output[0])
