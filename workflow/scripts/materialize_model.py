"""Rule materialize_model: fetch, verify and convert a model `source` (kvdiverge.models.sources)."""

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm's import: no GGUF loader progress bar

from kvdiverge.pipeline.logs import job_log  # noqa: E402

job_log(snakemake)  # before the heavy imports: their errors and warnings go to the log too

from kvdiverge.models.sources import materialize_model  # noqa: E402

# log=None: this job's logging already writes to its log file (no second handler there)
materialize_model(snakemake.params.source, snakemake.output[0], where=snakemake.params.where)
