"""Rule study_generations: a page of a study's generations side by side, for a sample of its
evaluation documents (up to `per_stratum` per model, action and stratum, drawn with the study's
seed, mixing early, late and never diverged paths; kvdiverge.tables.generations, which
`kvdiverge compare`'s generations.html uses too), and the sampled paths as Parquet."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import polars as pl  # noqa: E402

from kvdiverge.analysis.accuracy import metric_documents, timing_depth  # noqa: E402
from kvdiverge.analysis.estimands import study_seed  # noqa: E402
from kvdiverge.io import atomic_path, atomic_write_text  # noqa: E402
from kvdiverge.io.documents import check_rolled_out_from  # noqa: E402
from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata  # noqa: E402
from kvdiverge.models.detokenize import load_decoder  # noqa: E402
from kvdiverge.tables.generations import (  # noqa: E402
    render_study_generations_html,
    sampled_generations,
)

p, out, study = snakemake.params, snakemake.output, snakemake.wildcards.study
documents = metric_documents(list(snakemake.input.documents), p.datasets)
seed = study_seed(p.seed, study)
sections, parts, depth = [], [], None
for model, files in p.files.items():
    spec = p.tokenizers[model]
    tokenizer = load_decoder(spec["path"], spec["revision"], spec["trust_remote_code"])
    frames = {}
    for action, paths in files.items():
        tables = []
        for path in paths:
            # each file read as its study's, model's, action's and cohort's (kvdiverge.io.roles)
            role = {"study": study, "model": model, "action": action, "cohort": p.cohort}
            table = read_trajectories(path, role=role)
            meta = read_trajectory_metadata(path)
            check_rolled_out_from(path, meta, table["doc_id"].unique(), documents, ValueError)
            tables.append(table)
        frames[action] = pl.concat(tables)
    H = int(read_trajectory_metadata(files[p.actions[0]][0])["H"])
    depth = timing_depth(H, p.clock)
    table = sampled_generations(frames, documents, tokenizer, depth, p.per_stratum, seed, model)
    log.info("%s: %d documents sampled", model, table["doc_id"].n_unique())
    sections.append((model, table, documents, tokenizer))
    parts.append(table.select(pl.lit(model).alias("model"), pl.all()))
intro = (
    f"Study {study}: up to {p.per_stratum} evaluation documents per model, action and stratum, "
    f"drawn with the study's seed, one of each divergence timing present first (early: "
    f"τ ≤ {depth}, late: {depth} < τ ≤ H, never: no divergence within H), each shown under "
    "every compared action."
)
title = f"Generations side by side: {study}"
labels = dict(p.labels)  # the rows show the actions' display labels
atomic_write_text(out.html, render_study_generations_html(sections, title, intro, labels))
with atomic_path(out.parquet, suffix=".parquet") as tmp:
    pl.concat(parts).write_parquet(tmp)
log.info("wrote %s, %s", out.html, out.parquet)
