#!/usr/bin/env bash
# Copy the files of one run of configs/cpu-study.yaml (and of its greedy companion,
# configs/cpu-study-greedy.yaml) into docs/cpu-study/, where README.md's numbers come from.
#
#   bash docs/cpu-study/collect.sh RUN_FOLDER [TIME_LOG [GREEDY_TIME_LOG]]
#
# RUN_FOLDER: the working folder the run was made in (it holds results/cpu-study/ and
# results/cpu-study-greedy/); TIME_LOG: the output of `/usr/bin/time -v snakemake ...`, whose
# wall time is copied into run.txt (GREEDY_TIME_LOG: the same for configs/cpu-study-greedy.yaml).
# Then `python docs/cpu-study/make_readme.py` writes README.md.
set -euo pipefail
run=$1
here=$(cd "$(dirname "$0")" && pwd)
main=$run/results/cpu-study
greedy=$run/results/cpu-study-greedy
for study in study1 study2; do
    out=$here/$study
    rm -rf "$out" && mkdir -p "$out"
    for f in estimands.csv estimands.md plan_check.csv plan_check.md accuracy.csv \
        table_accuracy.md table1.md table2.md table3.md contrasts.md summary.md \
        estimands_summary.md; do
        [ -f "$main/$study/tables/$f" ] && cp "$main/$study/tables/$f" "$out/"
    done
    for f in fig5_divergence_cdf.png fig5_divergence_cdf_strata.png fig6_tv_profiles.png \
        fig7_branch_contrasts.png decomposition.png accuracy.png; do
        [ -f "$main/$study/figures/$f" ] && cp "$main/$study/figures/$f" "$out/"
    done
    cp "$main/$study/plan.json" "$main/$study/lock.json" "$main/$study/lock_history.jsonl" "$out/"
    mkdir -p "$here/greedy/$study"
    for f in accuracy.csv table_accuracy.md; do
        [ -f "$greedy/$study/tables/$f" ] && cp "$greedy/$study/tables/$f" "$here/greedy/$study/"
    done
    [ -f "$greedy/$study/lock.json" ] && cp "$greedy/$study/lock.json" "$here/greedy/$study/"
done
{
    echo "commit: $(cat "$run/COMMIT" 2>/dev/null || echo unknown)"
    echo "config sha256: $(sha256sum "$run/configs/cpu-study.yaml" | cut -c1-64)"
    for c in cpu-study cpu-study-greedy; do
        echo "$c.yaml values sha256: $(python "$here/make_readme.py" --values-digest "$run/configs/$c.yaml")"
    done
    for log in "${2:-}" "${3:-}"; do
        [ -n "$log" ] && { grep -E "Command being timed|Elapsed \(wall clock\)" "$log" || true; }
    done
} > "$here/run.txt"
echo "collected into $here"
