"""Rule swrb_estimands (``rollout.coupling: swrb``): a study's SWRB estimands from its record
files, in the layout of estimands.csv, with the stratified document bootstrap paired across
actions (docs/swrb.md, "Switching it on")."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import os  # noqa: E402

from kvdiverge.analysis.control import check_swrb_control  # noqa: E402
from kvdiverge.analysis.estimands import study_seed, write_estimands  # noqa: E402
from kvdiverge.analysis.prespecification import (  # noqa: E402
    check_lock,
    endpoint_fingerprint,
    registration_line,
)
from kvdiverge.analysis.swrb import swrb_study_table  # noqa: E402
from kvdiverge.io.swrb_records import read_swrb_metadata  # noqa: E402

p = snakemake.params
# Before any work: the config still implies the lock, and every record file ran under it.
lock = check_lock(
    snakemake.input.lock,
    p.prespecified,
    {path: read_swrb_metadata(path) for path in snakemake.input.records},
    endpoint_code=endpoint_fingerprint(os.path.join(snakemake.scriptdir, "swrb_estimands.py")),
)
log.info("%s", registration_line(lock))
# the full-retention control's e_s must vanish (docs/method.md, "The full-retention control")
control = lock["design"]["control"]
check_swrb_control(
    [path for by_action in p.files.values() for path in by_action.get(control, {}).values()]
)
log.info("control %s: e_s within its tolerance in every record", control)
log.info("lock %s holds for %d SWRB record files", lock["hash"], len(snakemake.input.records))
table = swrb_study_table(
    p.files,
    contrasts=[tuple(c) for c in p.contrasts],
    windows=[p.window],
    draws=p.draws,
    seed=study_seed(p.seed, snakemake.wildcards.study),
    level=p.level,
    role={"study": snakemake.wildcards.study, "cohort": p.cohort},  # each file's and documents'
)
write_estimands(table, snakemake.output.csv, snakemake.output.md, header=registration_line(lock))
log.info("%d rows", table.height)
