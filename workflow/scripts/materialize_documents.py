"""Rule materialize_documents: one stratum's documents table."""

import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from tqdm import tqdm  # noqa: E402

from kvdiverge.datasets import DatasetsConfig, materialize_stratum, write_documents  # noqa: E402
from kvdiverge.models import chat_prompt_ids, load_tokenizer  # noqa: E402

stratum = snakemake.wildcards.stratum
cfg = DatasetsConfig.from_config(snakemake.params.datasets)
tokenizer = load_tokenizer(
    snakemake.params.tokenizer, trust_remote_code=snakemake.params.trust_remote_code
)


def length_fn(prompt: str) -> int:
    return len(chat_prompt_ids(tokenizer, prompt))


n_docs = sum(cfg.cohorts.values())
with tqdm(total=n_docs, desc=stratum, file=sys.stderr, mininterval=5) as bar:
    frame = materialize_stratum(cfg, stratum, length_fn, progress=bar.update)
write_documents(
    frame,
    snakemake.output[0],
    metadata={
        "stratum": stratum,
        "length_tokenizer": cfg.length_tokenizer,
        "tokenizer_path": snakemake.params.tokenizer,
        "generation_reserve": cfg.generation_reserve,
        "datasets": snakemake.params.datasets,
    },
)
log.info("%s: %d documents, n_tokens %s", stratum, frame.height, frame["n_tokens"].to_list())
