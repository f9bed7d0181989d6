"""Rule finite_state_figures: the estimator and identified-interval figures (SPEC §4)."""

import logging

from kvdiverge.plots.finite_state import write_figures

logging.basicConfig(
    filename=snakemake.log[0], level=logging.INFO, format="%(asctime)s %(message)s", force=True
)
logging.captureWarnings(True)

out = snakemake.output
write_figures(
    snakemake.input.systems,
    snakemake.input.windows,
    list(snakemake.params.interval_systems),
    (out.estimators, out.estimators_pdf),
    (out.interval, out.interval_pdf),
)
logging.getLogger("finite_state_figures").info("wrote %s and %s", out.estimators, out.interval)
