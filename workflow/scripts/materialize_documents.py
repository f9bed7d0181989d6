"""Rule materialize_documents: one stratum's documents table, fitted for every model of the
study under each model's own tokenizer and chat template (docs/datasets.md, "Lengths under
every model")."""

import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from tqdm import tqdm  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from kvdiverge.datasets import (  # noqa: E402
    DatasetsConfig,
    ModelLength,
    materialize_for_models,
    write_documents,
)
from kvdiverge.engine.preflight import model_context_window  # noqa: E402
from kvdiverge.models import chat_prompt_ids, load_tokenizer  # noqa: E402

stratum = snakemake.wildcards.stratum
cfg = DatasetsConfig.from_config(snakemake.params.datasets)


def model_length(name, spec):
    """A model's chat-wrapped prompt length and context window (from its config)."""
    trust, revision = bool(spec.get("trust_remote_code")), spec.get("revision")
    tokenizer = load_tokenizer(spec["path"], trust_remote_code=trust, revision=revision)
    config = AutoConfig.from_pretrained(spec["path"], trust_remote_code=trust, revision=revision)
    window = model_context_window(config.to_dict())

    def length_fn(prompt: str) -> int:
        return len(chat_prompt_ids(tokenizer, prompt))

    log.info("%s: %s, context window %s", name, spec["path"], window)
    return ModelLength(name, length_fn, window)


models = [model_length(name, spec) for name, spec in snakemake.params.models.items()]
n_docs = sum(cfg.cohorts.values())
with tqdm(total=n_docs, desc=stratum, file=sys.stderr, mininterval=5) as bar:
    frame, lengths = materialize_for_models(cfg, stratum, models, progress=bar.update)
write_documents(
    frame,
    snakemake.output[0],
    metadata={
        "stratum": stratum,
        "length_tokenizer": cfg.length_tokenizer,
        "models": {
            m.name: {"path": snakemake.params.models[m.name]["path"], "window": m.window}
            for m in models
        },
        "n_tokens_by_model": lengths,
        "generation_reserve": cfg.generation_reserve,
        "datasets": snakemake.params.datasets,
    },
)
for name, per_doc in lengths.items():
    log.info(
        "%s: %d documents, n_tokens under %s %s",
        stratum,
        frame.height,
        name,
        list(per_doc.values()),
    )
