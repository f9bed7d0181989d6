# Helpers of the documents stage (workflow/rules/datasets.smk; docs/datasets.md, "Datasets").
from kvdiverge.datasets import stratum_source_paths


def length_tokenizer_model():
    """Name and config entry of `datasets.length_tokenizer` (one-line error otherwise)."""
    name = DATASETS.length_tokenizer
    models = config.get("models", {})
    if name not in models:
        raise ValueError(
            f"config.datasets.length_tokenizer: expected the name of a configured model "
            f"({', '.join(models) or 'none configured'}), got {name!r}"
        )
    return name, models[name]


def documents_models():
    """Every configured model's tokenizer source (path or hub id, revision, remote code): the
    documents are fitted under each of them (docs/datasets.md, "Lengths under every model")."""
    length_tokenizer_model()  # one-line error for a length_tokenizer that names no model
    return {
        name: {
            "path": model_path(name),
            "revision": spec.get("revision"),
            "trust_remote_code": bool(spec.get("trust_remote_code", False)),
        }
        for name, spec in config["models"].items()
    }


def documents_inputs(wildcards):
    """The stratum's data files that exist (missing ones get the script's one-line error), and
    the folders of the models whose tokenizers fit the documents when a rule of this workflow
    builds them."""
    paths = [str(p) for p in stratum_source_paths(DATASETS, wildcards.stratum) if p.exists()]
    built = [model_path(m) for m in config["models"] if m in demo_models() + sourced_models()]
    return {"tokenizer": built, "data": paths}
