"""Workflow plumbing that the rules and scripts share: rerun fingerprints from the code
(:mod:`kvdiverge.pipeline.provenance`), rule inputs (:mod:`kvdiverge.pipeline.rule_inputs`),
job logs (:mod:`kvdiverge.pipeline.logs`), the device a job may use
(:mod:`kvdiverge.pipeline.hardware`), the report after a run
(:mod:`kvdiverge.pipeline.report`) and its rule graph (:mod:`kvdiverge.pipeline.report_graph`),
the output folder (:mod:`kvdiverge.pipeline.folders`), live progress
(:mod:`kvdiverge.pipeline.progress`) and bounds on extreme values
(:mod:`kvdiverge.pipeline.extremes`, which the engine, the parse-time checks and
``kvdiverge compare`` share). It imports only :mod:`kvdiverge.io`.

The configuration itself (reading, schema, names, actions, decoding, baselines) is
:mod:`kvdiverge.config`.
"""
