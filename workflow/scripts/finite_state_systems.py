"""Rule finite_state_systems: run the finite-state study and write its two tables."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.io import atomic_path  # noqa: E402
from kvdiverge.theory.finite_state_study import study_summary, study_tables  # noqa: E402

config = {"seed": snakemake.params.seed, "finite_state": dict(snakemake.params.finite_state)}
systems, windows = study_tables(config, log=log.info)
for key, value in study_summary(systems).items():
    log.info("summary %s = %.4g", key, value)
with atomic_path(snakemake.output.systems) as tmp:
    systems.write_csv(tmp)
with atomic_path(snakemake.output.windows) as tmp:
    windows.write_csv(tmp)
