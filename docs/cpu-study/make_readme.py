"""Write docs/cpu-study/README.md from the files of one run of configs/cpu-study.yaml (and of
configs/cpu-study-greedy.yaml) that docs/cpu-study/collect.sh copied here: every number on the
page is read from a row of those files, and every verdict is worded by what its interval
excludes.

    python docs/cpu-study/make_readme.py          # writes README.md
    python docs/cpu-study/make_readme.py --check  # fails unless README.md is what it writes
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import polars as pl
import yaml

HERE = Path(__file__).resolve().parent
SIGNED = {"branch_contrast_B", "branch_pre_contrast_B"}
A1 = ["snapkv-512", "snapkv-half", "recent-half"]
A2 = ["snapkv-90", "recent-90"]
MODEL: list[str] = []  # the study's model (its lock's first), set by main
PAPER = {  # quoted from the paper's tables (H = 128), as docs/cpu-study quoted them before
    "div32": "92.35 / 61.05 / 90.81 (Llama)",
    "div128": "98.14 / 92.29 / 97.66 (Llama)",
    "entry": "11.69 / 30.37 / 10.59 and 12.18 / 29.37 / 12.14",
    "snapkv-512 - snapkv-half": "19.90 / 16.68; 17.17 [16.20, 18.13] / 14.99 [13.87, 16.22]; "
    "86.3 / 89.9",
    "recent-half - snapkv-half": "20.79 / 17.10; —; 84.7 / 87.3",
    "C_H": "89.74–93.68 / 93.59–96.20",
    "cohort1": "97.18 / 81.81 / 96.19 and 98.48 / 86.07 / 98.57",
    "B1": "+6.53 [5.74, 7.36] / +7.11 [6.48, 7.81] / +5.84 [5.11, 6.58] (Llama); "
    "+10.63 / +10.48 / +7.83 (Qwen)",
    "S99_1": "58.15 / 44.92 / 62.41 and 81.23 / 65.53 / 82.48",
    "rf snapkv-512 - snapkv-half": "10.39 of which 8.83 / 4.06 of which 4.08",
    "rf recent-half - snapkv-half": "12.14 of which 10.65 / 4.70 of which 4.70",
    "div128_2": "74.24 / 94.88 and 80.88 / 97.75",
    "entry2": "49.61 / 20.19 and 47.74 / 21.47",
    "cohort2": "51.25 / 88.10 and 57.24 / 90.07",
    "recent-90 - snapkv-90": "34.84 / 31.20; —; 88.6 / 92.1",
    "S99_2": "28.44 [26.68, 30.24] / 56.18 [53.77, 58.61] and 43.63 / 73.65",
    "branch2": "82.64 → 88.68 / 87.44 → 94.13 (Llama)",
    "B2": "all four positive, +6.03 to +8.27",
    "bpre2": "+4.18 to +11.46 over the 24 model–stratum contrasts, all lower bounds positive",
    "rf recent-90 - snapkv-90": "28.56 [26.66, 30.48] / 21.63 [19.58, 23.66]; "
    "[25.11, 28.31] / [19.52, 23.61]",
}


def values_digest(config: Path) -> str:
    """SHA-256 of a config's values (its YAML parsed, as sorted JSON): equal for two copies that
    differ only in comments or layout."""
    data = yaml.safe_load(config.read_text(encoding="utf-8"))
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _csv(path: Path) -> pl.DataFrame:
    return pl.read_csv(path, infer_schema_length=None)


def row(table: pl.DataFrame, estimand: str, action: str = "", contrast: str = "", stratum="pooled"):
    """The one row of ``table`` with these keys (an error when there is none or several)."""
    found = table.filter(
        (pl.col("model") == MODEL[0])
        & (pl.col("estimand") == estimand)
        & (pl.col("action").fill_null("") == action)
        & (pl.col("contrast").fill_null("") == contrast)
        & (pl.col("stratum") == stratum)
    )
    if found.height != 1:
        raise LookupError(f"{estimand} {action or contrast} {stratum}: {found.height} rows")
    return found.row(0, named=True)


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def fmt(r: dict, scale: float = 100.0, digits: int = 1) -> str:
    """A row's value with its interval, ``scale``d (100: percent or pp)."""
    if _missing(r["value"]):
        return "not defined"
    signed = r["estimand"] in SIGNED or (r["contrast"] and not r["estimand"].endswith("_share"))
    sign = "+" if signed else ""
    text = f"{r['value'] * scale:{sign}.{digits}f}"
    if _missing(r["ci_low"]) or _missing(r["ci_high"]):
        carriers = r.get("denominator_docs")
        if carriers is not None and carriers < 2:
            return f"{text} (no interval: {carriers} of {r['n_docs']} documents carry it)"
        return f"{text} (no interval)"
    return f"{text} [{r['ci_low'] * scale:.{digits}f}, {r['ci_high'] * scale:.{digits}f}]"


def sign_word(r: dict) -> str:
    """What the row's interval supports about its sign."""
    if _missing(r["ci_low"]) or _missing(r["ci_high"]):
        return "has no interval"
    if r["ci_low"] > 0:
        return "is positive (its interval excludes 0)"
    if r["ci_high"] < 0:
        return "is negative (its interval excludes 0)"
    return "has no established sign (its interval covers 0)"


def x_accuracy(table: pl.DataFrame, stratum: str) -> dict:
    """The full cache's accuracy row (``accuracy_x``) of one stratum: X is the full cache's own
    generation, so every action's row carries it, and they must agree exactly."""
    found = table.filter(
        (pl.col("model") == MODEL[0])
        & (pl.col("estimand") == "accuracy_x")
        & (pl.col("stratum") == stratum)
    )
    keys = ["value", "ci_low", "ci_high", "n_docs", "n_paths"]
    if found.height == 0 or found.select(keys).unique().height != 1:
        raise LookupError(f"accuracy_x {stratum}: {found.height} rows that do not all agree")
    return found.row(0, named=True)


def verdict(r: dict, paper_sign: int) -> str:
    """*holds*, *not settled* or *reversed*: the row's interval against the paper's sign."""
    if _missing(r["ci_low"]) or _missing(r["ci_high"]):
        return "no interval"
    if (r["ci_low"] > 0 and paper_sign > 0) or (r["ci_high"] < 0 and paper_sign < 0):
        return "holds"
    if r["ci_low"] > 0 or r["ci_high"] < 0:
        return "reversed"
    return "not settled"


def level(r: dict) -> str:
    return f"{100 * r['ci_level']:.6g}%"


def per(table, estimand, actions, scale=100.0, digits=1) -> str:
    return " / ".join(fmt(row(table, estimand, a), scale, digits) for a in actions)


def main(check: bool = False) -> None:
    s1, s2 = _csv(HERE / "study1" / "estimands.csv"), _csv(HERE / "study2" / "estimands.csv")
    locks = {s: json.loads((HERE / s / "lock.json").read_text()) for s in ("study1", "study2")}
    MODEL[:] = [locks["study1"]["design"]["models"][0]]
    plans = {s: json.loads((HERE / s / "plan.json").read_text()) for s in ("study1", "study2")}
    run = (HERE / "run.txt").read_text().splitlines()
    draws = {s: sorted(set(t["draws"])) for s, t in (("study1", s1), ("study2", s2))}
    out: list[str] = []
    add = out.append

    add("# CPU study of SmolLM2")
    add("")
    add(
        "`configs/cpu-study.yaml` runs the paper's design at CPU scale on SmolLM2-135M-Instruct "
        '(Q4_1 weights dequantized to float32; `docs/models.md`, "SmolLM2, the default model"). '
        "Run it with"
    )
    add("")
    add("```bash")
    add("snakemake --configfile configs/cpu-study.yaml --replace-workflow-config --cores 2")
    add("```")
    add("")
    add(
        "This page is written by `python docs/cpu-study/make_readme.py` from the files of one run "
        "that `docs/cpu-study/collect.sh` copied here; every number on it is a row of one of them. "
        "The run (`run.txt`):"
    )
    add("")
    add("```")
    out.extend(run)
    add("```")
    add("")
    recorded = dict(line.split(" values sha256: ") for line in run if " values sha256: " in line)
    for name, digest in recorded.items():
        now = values_digest(HERE.parents[1] / "configs" / name)
        same = "equal to" if now == digest else "DIFFERENT FROM"
        add(
            f"`configs/{name}` as committed has values {same} the run's copy (SHA-256 of the "
            "parsed YAML; comments may differ)."
        )
    add("")
    add(
        "Its wall time was measured on a development machine shared with other jobs: it says how "
        "long this run took there, not how fast the pipeline is (`benchmarks/README.md` has "
        "timings on a quiet machine)."
    )
    add("")
    add("## Design")
    add("")
    d1, d2 = locks["study1"]["design"], locks["study2"]["design"]
    add(
        f"- **The paper's horizon and clock**: H = {d1['H']}; the fixed branch cohort τ ≤ "
        f"{d1['H'] // 2}, early window lags 1–{d1['H'] // 8}, late window lags "
        f"{d1['H'] // 2 - d1['H'] // 8 + 1}–{d1['H'] // 2} (`analysis.clock`, fractions of H)."
    )
    add(
        f"- **Strata** {', '.join(d1['strata'])}: RULER at 2K and 4K SmolLM2 tokens "
        "(prompt + H within the stratum's length); the essay tasks read real public-domain prose "
        '(`docs/datasets.md`, "RULER").'
    )
    add(
        f"- **Documents**: {plans['study1']['documents_per_stratum']} evaluation documents per "
        f"stratum for each study (cohorts `{d1['cohort']}` and `{d2['cohort']}`), after the "
        "development cohort that planned K."
    )
    add(
        f"- **Replicates**: K = {d1['K']} (study 1) and {d2['K']} (study 2), each study's plan "
        f"bounded by `analysis.planning.max_K` = {plans['study1']['max_K']}; K_control = "
        f"{d1['K_control']}. The plans' notes:"
    )
    for study in ("study1", "study2"):
        for note in plans[study]["notes"]:
            add(f"  - {study}: {note}")
    add(
        f"- **Intervals**: a stratified paired document bootstrap, "
        f"{', '.join(f'{d:,}' for d in draws['study1'])} draws for study 1 and "
        f"{', '.join(f'{d:,}' for d in draws['study2'])} for study 2, at least 50 in each tail of "
        "the widest "
        "interval (95% pointwise; 99.375% for study 2's eight prespecified endpoints, "
        '`docs/method.md`, "Uncertainty").'
    )
    add("")
    add("## Files here")
    add("")
    add(
        "`study1/` and `study2/` each hold, as the pipeline wrote them: estimands.csv and "
        "estimands.md (every estimand), plan.json, lock.json and lock_history.jsonl (the "
        "registration), plan_check.csv and plan_check.md (predicted versus achieved "
        "half-widths), accuracy.csv and table_accuracy.md, Tables 1–3, contrasts.md, the "
        "summary.md and estimands_summary.md pages and the figures. `greedy/` holds the accuracy "
        "tables of "
        "`configs/cpu-study-greedy.yaml` (the same documents, greedy decoding)."
    )
    add("")

    add("## What the full cache solves")
    add("")
    add(
        "Task accuracy of the full cache's own generation X, scored with each RULER task's metric "
        "on its first H tokens (estimand `accuracy_x`: the same full-cache paths under every "
        "action), per "
        "stratum, at the study's temperature 1 (`studyN/accuracy.csv`) and greedy "
        "(`greedy/studyN/accuracy.csv`, from `configs/cpu-study-greedy.yaml`); brackets: 95% "
        "document-bootstrap intervals:"
    )
    add("")
    add("| study | stratum | documents | T = 1, % | greedy, % |")
    add("|---|---|---|---|---|")
    accuracy = {}
    for study in ("study1", "study2"):
        a1 = _csv(HERE / study / "accuracy.csv")
        greedy_file = HERE / "greedy" / study / "accuracy.csv"
        a0 = _csv(greedy_file) if greedy_file.exists() else None
        for stratum in [*d1["strata"], "pooled"]:
            r1 = x_accuracy(a1, stratum)
            r0 = x_accuracy(a0, stratum) if a0 is not None else None
            accuracy[(study, stratum)] = (r1, r0)
            add(
                f"| {study} | {stratum} | {r1['n_docs']} | {fmt(r1)} | "
                f"{fmt(r0) if r0 else 'not run'} |"
            )
    add("")
    r1, r0 = accuracy[("study2", "pooled")]
    solved = f"{fmt(r1)}% of study 2's documents at T = 1" + (f", {fmt(r0)}% greedy" if r0 else "")
    if not r1["value"] and not (r0 and r0["value"]):
        add(
            f"The full cache solves none of these tasks ({solved}): the estimands below measure "
            "how eviction changes what the model writes, with no retrieval to lose."
        )
    else:
        add(
            f"The full cache solves part of the tasks ({solved}), so eviction has retrieval to "
            "lose here: the estimands below say how often and how far the evicted cache's text "
            "departs from a full-cache text that is right on that share of documents, and "
            "`table_accuracy.md` gives what the departure costs in task accuracy "
            "(`accuracy_drop`, and by divergence timing: an association under this coupling, "
            "not a causal effect). A divergence is a different text, not by itself a wrong "
            "answer."
        )
    add("")
    drops = []
    for study, actions in (("study1", A1), ("study2", A2)):
        a1 = _csv(HERE / study / "accuracy.csv")
        for a in actions:
            drops.append(f"{a} {fmt(row(a1, 'accuracy_drop', a))}")
    add(
        "What eviction costs in accuracy at T = 1, pooled (`accuracy_drop` = X − Y, pp, "
        f"`studyN/accuracy.csv`): {'; '.join(drops)}. The greedy column is the better measure "
        "of what the model can retrieve; sampling at T = 1 lowers it, and the estimands are "
        "about the T = 1 paths."
    )
    add("")

    add("## The estimands")
    add("")
    add(
        "Pooled over the two strata (the per-stratum rows are in `estimands.csv`); percent of "
        "paths or of the horizon, pp for differences, steps for entry times; brackets: pointwise "
        "95% intervals except where a row says otherwise."
    )
    add("")
    rows: list[tuple[str, str, str]] = []  # (quantity, the paper's, SmolLM2's)
    rows.append(
        (
            "study 1: diverged by step 32, % (512 / half / recent-half)",
            PAPER["div32"],
            per(s1, "div_cdf@32", A1),
        )
    )
    rows.append(
        (f"study 1: diverged by step {d1['H']}, %", PAPER["div128"], per(s1, "div_prob", A1))
    )
    rows.append(
        (
            "study 1: mean entry time E[τ \\| τ ≤ H], steps",
            PAPER["entry"],
            per(s1, "mean_entry_time", A1, 1.0),
        )
    )
    for b in ("snapkv-512", "recent-half"):
        c = f"{b} - snapkv-half"
        rows.append(
            (
                f"study 1: {c}: ΔR_SMC, pp; exposure term, pp; exposure share, %",
                PAPER[c],
                f"{fmt(row(s1, 'R_smc', contrast=c))}; {fmt(row(s1, 'gap_exposure', contrast=c))}; "
                f"{fmt(row(s1, 'exposure_share', contrast=c), digits=0)}",
            )
        )
    rows.append(("study 1: C_H, %", PAPER["C_H"], per(s1, "C_H", A1)))
    rows.append(
        (
            f"study 1: branch cohort τ ≤ {d1['H'] // 2}, %",
            PAPER["cohort1"],
            per(s1, "branch_cohort_fraction", A1),
        )
    )
    rows.append(("study 1: B(a), pp", PAPER["B1"], per(s1, "branch_contrast_B", A1)))
    rows.append(
        ("study 1: b^pre (B before EOS), pp", "not reported", per(s1, "branch_pre_contrast_B", A1))
    )
    rows.append(("study 1: S_.99, %", PAPER["S99_1"], per(s1, "S_99", A1)))
    for b in ("snapkv-512", "recent-half"):
        c = f"{b} - snapkv-half"
        rows.append(
            (
                f"study 1: {c}: Δ(R − F), pp; its pre-EOS part, pp",
                PAPER[f"rf {c}"],
                f"{fmt(row(s1, 'R_minus_F', contrast=c))}; {fmt(row(s1, 'rf_S0', contrast=c))}",
            )
        )
    c2 = "recent-90 - snapkv-90"
    rows.append(
        (
            f"study 2: diverged by step {d2['H']}, % (SnapKV-90 / recent-90)",
            PAPER["div128_2"],
            per(s2, "div_prob", A2),
        )
    )
    rows.append(
        ("study 2: mean entry time, steps", PAPER["entry2"], per(s2, "mean_entry_time", A2, 1.0))
    )
    rows.append(
        ("study 2: branch cohort, %", PAPER["cohort2"], per(s2, "branch_cohort_fraction", A2))
    )
    rows.append(
        (
            f"study 2: {c2}: ΔR_SMC, pp; exposure term, pp; exposure share, %",
            PAPER[c2],
            f"{fmt(row(s2, 'R_smc', contrast=c2))}; {fmt(row(s2, 'gap_exposure', contrast=c2))}; "
            f"{fmt(row(s2, 'exposure_share', contrast=c2), digits=0)}",
        )
    )
    s99 = row(s2, "S_99", "snapkv-90")
    rows.append((f"study 2: S_.99 at {level(s99)}, %", PAPER["S99_2"], per(s2, "S_99", A2)))
    rows.append(
        (
            "study 2: branch TV early → late, %",
            PAPER["branch2"],
            " / ".join(
                f"{fmt(row(s2, 'branch_early', a))} → {fmt(row(s2, 'branch_late', a))}" for a in A2
            ),
        )
    )
    b2 = {a: row(s2, "branch_contrast_B", a) for a in A2}
    rows.append(
        (
            f"study 2: B(a) at {level(b2['snapkv-90'])}, pp",
            PAPER["B2"],
            per(s2, "branch_contrast_B", A2),
        )
    )
    rows.append(("study 2: b^pre, pp", PAPER["bpre2"], per(s2, "branch_pre_contrast_B", A2)))
    rows.append((
        f"study 2: {c2}: Δ(R − F), pp; its pre-EOS part, pp", PAPER[f"rf {c2}"],
        f"{fmt(row(s2, 'R_minus_F', contrast=c2))}; {fmt(row(s2, 'rf_S0', contrast=c2))}",
    ))  # fmt: skip
    add("| quantity | the paper: Llama / Qwen | SmolLM2 |")
    add("|---|---|---|")
    for quantity, paper, ours in rows:
        add(f"| {quantity} | {paper} | {ours} |")
    add("")
    add(
        "The paper's column is quoted from its tables (Llama-3.1-8B-Instruct / "
        "Qwen2.5-7B-Instruct, 288 documents per study from 4K–32K prompts, K = 64 / 32); it is "
        "there for the definitions, not as a target a 135M model should reach."
    )
    add("")

    add("## The paper's findings here")
    add("")
    add(
        "Each bullet states one of the paper's findings (in bold) and then what this run's "
        "intervals support about it here, no more: *holds* where the interval points the "
        "paper's way and excludes the null, *not settled* where it covers the null, *reversed* "
        "where it excludes the null the other way."
    )
    add("")
    for b in ("snapkv-512", "recent-half"):
        c = f"{b} - snapkv-half"
        entry = row(s1, "mean_entry_time", contrast=c)
        often = row(s1, "div_prob", contrast=c)
        later = {
            "is negative (its interval excludes 0)": "SnapKV-half's paths enter later",
            "is positive (its interval excludes 0)": "SnapKV-half's paths enter earlier",
        }.get(sign_word(entry), "which enters first is not settled")
        rarer = {
            "is positive (its interval excludes 0)": "SnapKV-half diverges less often",
            "is negative (its interval excludes 0)": "SnapKV-half diverges more often",
        }.get(sign_word(often), "which diverges more often is not settled")
        add(
            f"- **The paper: SnapKV-half enters divergence later and less often than {b}.** "
            f"Here, {c}: mean entry time {fmt(entry, 1.0)} steps, {sign_word(entry)}: {later} "
            f"({verdict(entry, -1)}); share of paths diverged by step {d1['H']} {fmt(often)} pp, "
            f"{sign_word(often)}: {rarer} ({verdict(often, +1)})."
        )
    for table, c, label in ((s1, "snapkv-512 - snapkv-half", "study 1"),
                            (s1, "recent-half - snapkv-half", "study 1"),
                            (s2, c2, "study 2")):  # fmt: skip
        share = row(table, "exposure_share", contrast=c)
        if _missing(share["ci_low"]):
            said = "has no interval"
        elif share["ci_low"] > 0.5:
            said = "lies above one half: exposure carries most of the gap (holds)"
        elif share["ci_high"] < 0.5:
            said = "lies below one half: exposure does not carry most of the gap (reversed)"
        else:
            said = (
                "covers one half: whether exposure carries most of the gap is not settled "
                "(not settled)"
            )
        add(
            f"- **The paper: exposure carries most of the gap.** Here ({label}, {c}), the "
            f"exposure share {fmt(share, digits=0)} (%) {said}."
        )
    add(
        f"- **The paper: post-divergence disagreement stays high.** Here, after divergence the "
        f"texts still differ "
        f"at C_H = {per(s1, 'C_H', A1)} (%, study 1; SnapKV-512 / SnapKV-half / recent-half); "
        f"saturation S_.99 is {per(s1, 'S_99', A1)} (%). The paper's C_H is 89.7–96.2% and its "
        "S_.99 44.9–82.5% (Llama and Qwen, study 1). Whether this counts as staying high is a "
        "matter of threshold; the numbers are lower than the paper's."
    )
    for table, actions, label in ((s2, A2, "study 2, at the family's level"),
                                  (s1, A1, "study 1, pointwise")):  # fmt: skip
        for a in actions:
            r = row(table, "branch_contrast_B", a)
            pre = row(table, "branch_pre_contrast_B", a)
            add(
                f"- **The paper: late-window branch TV exceeds early-window (B(a) > 0).** Here "
                f"({label}, {a}): B(a) = {fmt(r)} pp at {level(r)} {sign_word(r)} "
                f"({verdict(r, +1)}); before EOS, b^pre = {fmt(pre)} pp at {level(pre)} "
                f"{sign_word(pre)} ({verdict(pre, +1)})."
            )
    add("")

    add("## Predicted versus achieved precision")
    add("")
    add(
        "Each study's plan predicted every entry's half-width at the evaluation design from the "
        "development documents alone, with the development stage's own 90% bootstrap interval "
        'of that prediction (`docs/method.md`, "Sample-size planning"); the estimands step set '
        "the achieved half-widths beside them (`plan_check.md`):"
    )
    add("")
    for study in ("study1", "study2"):
        add(f"{study}:")
        add("")
        text = (HERE / study / "plan_check.md").read_text().splitlines()
        out.extend(line for line in text if line.startswith("|"))
        add("")
    add("## The registration")
    add("")
    for study in ("study1", "study2"):
        lock = locks[study]
        reg = lock.get("registration") or {}
        models = lock["rollout"]["models"]
        add(
            f"- {study}: lock `{lock['hash']}`, registration {lock['chain']['number']} "
            f"({reg.get('reason', '')}); rollout code `{lock['rollout']['code']}`; "
            + "; ".join(
                f"{name}: weights `{m['weights'][:16]}…`, tokenizer `{m['tokenizer'][:16]}…`, "
                f"{m['device']}, {m['dtype']}, kernels "
                + ", ".join(f"{k} {v}" for k, v in m["kernel"].items())
                for name, m in models.items()
            )
        )
    add("")
    add(
        "What the lock binds, and what its history can and cannot guarantee: "
        "`docs/prespecification.md`."
    )
    add("")
    add("## What this is not")
    add("")
    add(
        "The model is quantized and small, the prompts are 2K and 4K tokens (the paper's "
        "4K–32K), and the intervals come from the documents and replicates above: these are the "
        "pipeline's numbers for this setting, not a replication of the paper's models. The "
        "plans' notes say how many documents the planned precision would need."
    )
    text = "\n".join(out) + "\n"
    if check:
        if (HERE / "README.md").read_text(encoding="utf-8") != text:
            raise SystemExit(
                "docs/cpu-study/README.md is not what make_readme.py writes from the files here"
            )
        return
    (HERE / "README.md").write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--values-digest"]:
        print(values_digest(Path(sys.argv[2])))
    else:
        main(check=sys.argv[1:2] == ["--check"])
