"""Rule build_demo_model: a tiny demo model trained on CPU from its config entry and seed
(kvdiverge.models.training_job; docs/models.md, "Demo models"). Its provenance is the training
fingerprint (the rule's `code` param, checked at parse time), not this file's modification time
(workflow/rules/helpers/models.smk, `keep_build_script_older`)."""

from kvdiverge.models.training_job import train_demo_model_job

train_demo_model_job(snakemake.output[0], snakemake.params, snakemake.log[0], snakemake.threads)
