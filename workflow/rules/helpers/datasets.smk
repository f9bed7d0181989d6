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


def length_tokenizer_path(wildcards=None):
    """Local folder of a demo or sourced model (built by build_demo_model or
    materialize_model), else the model's path or id."""
    name, spec = length_tokenizer_model()
    return model_path(name)


def documents_inputs(wildcards):
    """The stratum's data files that exist (missing ones get the script's one-line error), and
    the length tokenizer's folder when a rule of this workflow builds it."""
    name, spec = length_tokenizer_model()
    paths = [str(p) for p in stratum_source_paths(DATASETS, wildcards.stratum) if p.exists()]
    built = name in demo_models() or name in sourced_models()
    return {"tokenizer": [length_tokenizer_path()] if built else [], "data": paths}
