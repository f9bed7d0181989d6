"""Rule materialize_model: fetch, verify and convert a model `source` (kvdiverge.model_sources)."""

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm's import: no GGUF loader progress bar

from kvdiverge.model_sources import materialize_model

materialize_model(
    snakemake.params.source,
    snakemake.output[0],
    log=snakemake.log[0],
    where=snakemake.params.where,
)
