"""Rule document_stats: trajectories → one row per (document, action) (DESIGN §3.3)."""

import logging

from kvdiverge.analysis.document_stats import document_stats, write_document_stats

logging.basicConfig(
    filename=snakemake.log[0], level=logging.INFO, format="%(asctime)s %(message)s", force=True
)
files = {action: list(paths) for action, paths in snakemake.params.files.items()}
stats, clock = document_stats(
    files, list(snakemake.input.documents), dict(snakemake.params.clock), snakemake.params.control
)
write_document_stats(stats, snakemake.output[0], clock)
logging.getLogger("document_stats").info(
    "%d (document, action) rows, %s -> %s", stats.height, clock, snakemake.output[0]
)
