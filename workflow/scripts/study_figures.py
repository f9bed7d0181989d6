"""Rules study_figures and study_branch_figure: figures 5-7 and the decomposition bars of one
study, drawn from its estimands table (SPEC §5)."""

import logging

from kvdiverge.plots.study import FIGURES, write_study_figures

logging.basicConfig(
    filename=snakemake.log[0], level=logging.INFO, format="%(asctime)s %(message)s", force=True
)
logging.captureWarnings(True)

out = snakemake.output
outputs = {name: (out[name], out[f"{name}_pdf"]) for name in FIGURES if name in out.keys()}
write_study_figures(
    snakemake.input.estimands,
    outputs,
    actions=list(snakemake.params.actions),
    palette_actions=list(snakemake.params.palette_actions),
    control=snakemake.params.control,
)
logging.getLogger("study_figures").info("wrote %s", ", ".join(outputs))
