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
