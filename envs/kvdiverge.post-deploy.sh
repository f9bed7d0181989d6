#!/usr/bin/env bash
# Run by Snakemake (`--sdm conda`) once, inside the environment it has just created from
# kvdiverge.yaml, in the run's working directory: the repository root. Installs the package
# (editable, so the rules run the checkout's code) with its dependencies and the kvpress extra.
set -euo pipefail
if ! grep -qs '^name = "kvdiverge"$' pyproject.toml; then
    echo "kvdiverge.post-deploy.sh: no kvdiverge pyproject.toml in $PWD; run snakemake from the repository root" >&2
    exit 1
fi
python -m pip install --no-input --editable ".[kvpress]"
