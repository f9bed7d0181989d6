"""Workflow plumbing that the rules and scripts share: rerun fingerprints from the code
(:mod:`kvdiverge.pipeline.provenance`), rule inputs (:mod:`kvdiverge.pipeline.rule_inputs`),
job logs (:mod:`kvdiverge.pipeline.logs`), the device a job may use
(:mod:`kvdiverge.pipeline.hardware`) and the report after a run
(:mod:`kvdiverge.pipeline.report`). It imports only :mod:`kvdiverge.io`.

Also: the config's action forms (:mod:`kvdiverge.pipeline.actions`), study baselines
(:mod:`kvdiverge.pipeline.baselines`), config files as data
(:mod:`kvdiverge.pipeline.configfiles`), the decoding temperature
(:mod:`kvdiverge.pipeline.decoding`), extreme values (:mod:`kvdiverge.pipeline.extremes`), the
output folder (:mod:`kvdiverge.pipeline.folders`), names (:mod:`kvdiverge.pipeline.names`), live
progress (:mod:`kvdiverge.pipeline.progress`) and the report's rule graph
(:mod:`kvdiverge.pipeline.report_graph`).
"""
