"""Rule introductory_figure: figure 1, occurrence versus occupation."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.plots.theory import write_introductory_figure  # noqa: E402

p = snakemake.params
curves = write_introductory_figure(p.eps, p.horizon, snakemake.output.png, snakemake.output.pdf)
for name, c in curves.items():
    log.info(
        "%s: R_SMC=%.6g O_H=%.6g Pi_H=%.6g sequence TV=%.6g",
        name,
        c["R_SMC"],
        c["O_H"],
        c["Pi_H"],
        c["sequence_tv"],
    )
