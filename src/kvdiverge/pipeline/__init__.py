"""Workflow plumbing that the rules and scripts share: rerun fingerprints from the code
(:mod:`kvdiverge.pipeline.provenance`), rule inputs (:mod:`kvdiverge.pipeline.rule_inputs`),
job logs (:mod:`kvdiverge.pipeline.logs`), the device a job may use
(:mod:`kvdiverge.pipeline.hardware`) and the report after a run
(:mod:`kvdiverge.pipeline.report`). It imports only :mod:`kvdiverge.io`.
"""
