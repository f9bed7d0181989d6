"""The report's rule graph with one node per rule (``python -m kvdiverge.pipeline.report_graph
--report ...`` runs ``snakemake`` with it; :func:`kvdiverge.pipeline.report.report_command`).

Snakemake's report keeps one job of each rule per topological level, so a rule whose jobs sit at
different depths (a study with a prediction pair and one without, or a rollout group added by an
incremental run) shows up as several nodes. :func:`rule_graph` draws each rule once, at the
first level any of its jobs reaches (ties by name), with an edge from rule a to rule b when some
job of b depends on a job of a; the shape Snakemake's template reads (nodes with ``rule``,
``fx``, ``fy``; ``links`` and ``links_direct``, the latter between neighbouring nodes) is kept.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["rule_graph", "main"]


def rule_graph(dag: Any) -> tuple[dict[str, list[dict[str, Any]]], int, int]:
    """``(spec, xmax, ymax)`` of the report's rule graph with one node per rule (module
    docstring); ``dag``: Snakemake's DAG (``toposorted()`` levels, ``dependencies``)."""
    first: dict[str, int] = {}
    jobs = []
    for level, group in enumerate(dag.toposorted()):
        for job in group:
            first.setdefault(job.rule.name, level)
            jobs.append(job)
    rules = sorted(first, key=lambda r: (first[r], r))
    idx = {r: i for i, r in enumerate(rules)}
    nodes = [{"rule": r, "fx": 10, "fy": i * 50} for i, r in enumerate(rules)]
    edges = sorted(
        {
            (idx[v.rule.name], idx[u.rule.name])
            for u in jobs
            for v in dag.dependencies[u]
            if v.rule.name != u.rule.name
        }
    )

    def link(source: int, target: int) -> dict[str, Any]:
        return {
            "target": target,
            "source": source,
            "sourcerule": rules[source],
            "targetrule": rules[target],
            "value": 1,
        }

    spec = {
        "nodes": nodes,
        "links": [link(s, t) for s, t in edges if t - s != 1],
        "links_direct": [link(s, t) for s, t in edges if t - s == 1],
    }
    return spec, 100, max((n["fy"] for n in nodes), default=0)


def main(argv: list[str] | None = None) -> None:
    """``snakemake`` with :func:`rule_graph` as its report's rule graph."""
    import snakemake.report.html_reporter as html_reporter
    from snakemake.cli import main as snakemake_main

    html_reporter.rulegraph_spec = rule_graph
    snakemake_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
