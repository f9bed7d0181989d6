"""Rule estimands: every estimand with paired bootstrap intervals."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import os  # noqa: E402

import polars as pl  # noqa: E402

from kvdiverge.analysis.document_stats import read_document_stats  # noqa: E402
from kvdiverge.analysis.estimands import (  # noqa: E402
    control_max_tv,
    estimands_table,
    study_seed,
    write_estimands,
)
from kvdiverge.analysis.plan_precision import (  # noqa: E402
    predicted_vs_achieved,
    render_plan_check,
)
from kvdiverge.analysis.prespecification import (  # noqa: E402
    check_lock,
    endpoint_fingerprint,
    registration_line,
)
from kvdiverge.io import atomic_path, atomic_write_text  # noqa: E402
from kvdiverge.io.trajectories import provenance_mix, read_trajectory_metadata  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs  # noqa: E402

p = snakemake.params
study = p.study
# Before any work: the config still implies the lock and every later rollout group's amendment,
# each evaluation file ran under its group's, and the code computing the endpoints is the
# registered code.
amendment_files = keyed_inputs(snakemake.input, "amendment")
amendments = {group: (amendment_files[group], spec) for group, spec in p.amendments.items()}
metadata = {path: read_trajectory_metadata(path) for path in snakemake.input.trajectories}
lock = check_lock(
    snakemake.input.lock,
    p.prespecified,
    metadata,
    amendments,
    endpoint_code=endpoint_fingerprint(os.path.join(snakemake.scriptdir, "estimands.py")),
)
for line in provenance_mix(metadata):  # one study, several numerics: say so
    log.warning("%s", line)
log.info("%s", registration_line(lock))
log.info("lock %s holds for %d evaluation files", lock["hash"], len(snakemake.input.trajectories))
contrasts = [tuple(c) for c in p.contrasts] if p.contrasts else None
tables = []
for model, path in keyed_inputs(snakemake.input, "stats").items():
    stats, clock = read_document_stats(path, {"study": snakemake.wildcards.study, "model": model})
    worst = control_max_tv(stats, study["control"])
    if worst:
        log.warning("control %s of %s: nonzero rollout TV %.3g", study["control"], model, worst)
    tables.append(
        estimands_table(
            stats,
            clock,
            model=model,
            actions=list(study["actions"]),
            contrasts=contrasts,
            cohort=p.cohort,
            draws=study["bootstrap_draws"],
            seed=study_seed(p.seed, snakemake.wildcards.study),
            level=p.level,
            family_estimands=list(p.family_estimands),
            family_size=study["family_endpoints"],
            family_alpha=p.alpha,
            control=study["control"],
            strata=list(p.strata),
            where=str(path),
        )
    )
    log.info("%s: %d rows", model, tables[-1].height)
table = pl.concat(tables)
write_estimands(table, snakemake.output.csv, snakemake.output.md, header=registration_line(lock))
# the plan beside what it bought: each locked entry's predicted and achieved half-width
check = predicted_vs_achieved(lock["plan"], table)
with atomic_path(snakemake.output.plan_check, suffix=".csv") as tmp:
    check.write_csv(tmp)
atomic_write_text(snakemake.output.plan_check_md, render_plan_check(check))
for r in check.iter_rows(named=True):
    log.info(
        "plan %s/%s %s at %.6g: predicted half-width %.4g [%.4g, %.4g], achieved %.4g (%.2fx)",
        r["model"],
        r["action"],
        r["estimand"],
        r["level"],
        r["predicted"],
        r["predicted_low"],
        r["predicted_high"],
        r["achieved"],
        r["ratio"],
    )
