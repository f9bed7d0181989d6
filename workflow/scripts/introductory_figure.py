"""Rule introductory_figure: figure 1, occurrence versus occupation (SPEC §2, paper §1)."""

import logging

from kvdiverge.plots.theory import write_introductory_figure

logging.basicConfig(
    filename=snakemake.log[0], level=logging.INFO, format="%(asctime)s %(message)s", force=True
)
logging.captureWarnings(True)

p = snakemake.params
curves = write_introductory_figure(p.eps, p.horizon, snakemake.output.png, snakemake.output.pdf)
for name, c in curves.items():
    logging.getLogger("introductory_figure").info(
        "%s: R_SMC=%.6g O_H=%.6g Pi_H=%.6g sequence TV=%.6g",
        name,
        c["R_SMC"],
        c["O_H"],
        c["Pi_H"],
        c["sequence_tv"],
    )
