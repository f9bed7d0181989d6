"""Rule swrb_estimands (``rollout.coupling: swrb``): a study's SWRB estimands from its record
files, in the layout of estimands.csv, with the stratified document bootstrap paired across
actions (docs/swrb.md, "Switching it on")."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.estimands import study_seed, write_estimands  # noqa: E402
from kvdiverge.analysis.prespecification import check_lock  # noqa: E402
from kvdiverge.analysis.swrb import swrb_study_table  # noqa: E402
from kvdiverge.io.swrb_records import read_swrb_metadata  # noqa: E402

p = snakemake.params
# Before any work: the config still implies the lock, and every record file ran under it.
lock = check_lock(
    snakemake.input.lock,
    p.prespecified,
    {path: read_swrb_metadata(path) for path in snakemake.input.records},
)
log.info("lock %s holds for %d SWRB record files", lock["hash"], len(snakemake.input.records))
table = swrb_study_table(
    p.files,
    contrasts=[tuple(c) for c in p.contrasts],
    windows=[p.window],
    draws=p.draws,
    seed=study_seed(p.seed, snakemake.wildcards.study),
    level=p.level,
)
write_estimands(table, snakemake.output.csv, snakemake.output.md)
log.info("%d rows", table.height)
