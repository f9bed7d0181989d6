"""Rule prespecify_group: a later rollout group's amendment lock from the config and the study's
lock, before the group's evaluation rollouts (docs/compare.md, "Rollout groups")."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.prespecification import (  # noqa: E402
    make_amendment,
    read_lock,
    write_lock,
)

study_lock = read_lock(snakemake.input.lock)
amendment = make_amendment(snakemake.params.prespecified, study_lock)
write_lock(amendment, snakemake.output[0])
endpoints = amendment["endpoints"]
log.info(
    "amendment %s of group %s under lock %s: K = %d, actions %s, %s -> %s",
    amendment["hash"],
    amendment["group"],
    study_lock["hash"],
    amendment["design"]["K"],
    ", ".join(amendment["design"]["actions"]),
    f"{len(endpoints['family'])} endpoints" if endpoints else "no endpoint family",
    snakemake.output[0],
)
