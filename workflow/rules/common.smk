# Configuration validation, path building and provenance fingerprints.
import os

from kvdiverge.config import module_fingerprint, validate_config

validate_config(config, os.path.join(workflow.basedir, "workflow", "schemas", "config.schema.yaml"))


def fingerprint(*modules):
    """Params entry that changes when any of the named package modules changes (DESIGN §5)."""
    return module_fingerprint(*modules)


def final_outputs():
    """Every file `rule all` builds."""
    return [
        "results/finite_state/systems.csv",
        "results/finite_state/figures/estimators.png",
        "results/finite_state/figures/identified_interval.png",
    ]


# ---- Datasets (README "Datasets"): the documents plan is checked at parse time ----------------
from kvdiverge.datasets import DatasetsConfig, stratum_source_paths

DATASETS = DatasetsConfig.from_config(config["datasets"])


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
    """Local folder of a demo model (built by build_demo_model), else the model's path or id."""
    name, spec = length_tokenizer_model()
    return f"data/models/{name}" if spec.get("demo") else str(spec["path"])


def documents_inputs(wildcards):
    """The stratum's data files that exist (missing ones get the script's one-line error)."""
    name, spec = length_tokenizer_model()
    paths = [str(p) for p in stratum_source_paths(DATASETS, wildcards.stratum) if p.exists()]
    return {"tokenizer": [length_tokenizer_path()] if spec.get("demo") else [], "data": paths}
