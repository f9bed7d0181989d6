"""Acceptance of the trained demo models (docs/models.md, "Acceptance"; issue "A tiny
trained demo model").

Prints, per demo model of configs/tiny.yaml:

1. needle accuracy with the full cache (greedy reply contains every gold answer, RULER's
   string_match_all) on held-out prompts of the RULER generators at the default strata's
   prompt budgets, per task, against chance: a random value of the answer's type (7-digit
   number: 1/9,000,000; UUID: 2^-122) and a stronger baseline, a uniform pick among the
   prompt's candidate values of that type (1 for a single-needle prompt: copying the only
   number is enough there);
2. the same on the default's own RULER documents (all cohorts, materialized exactly as rule
   materialize_documents does; never seen in training: other seeds);
3. divergence timing of full vs snapkv-half vs recent-half from coupled rollouts
   (kvdiverge.engine.paths_under_action) on held-out needle documents and on the default's RULER
   documents: pooled P(τ ≤ t) for t = 4, 8, H, mean δ_t and E[δ_2] (δ_1 = 0: eviction
   follows the first token) — documents weigh equally.

Run: ``python benchmarks/demo_model_acceptance.py [--docs 4] [--K 8]`` (CPU, a few minutes).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
import transformers
import yaml

from kvdiverge.config import validate_config
from kvdiverge.datasets import DatasetsConfig, materialize_stratum
from kvdiverge.datasets.fitting import derive_seed
from kvdiverge.datasets.ruler import RULER_TASKS
from kvdiverge.engine import RolloutSettings, paths_under_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer
from kvdiverge.models.training import TrainingSample, evaluate_answers, heldout_samples

ROOT = Path(__file__).resolve().parents[1]
NIAH = tuple(t for t in RULER_TASKS if t.startswith("niah_"))
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
NUMBER = re.compile(r"(?<!\d)\d{7}(?!\d)")


def char_agreement(reply: str, answer: str) -> float:
    """Share of the gold answer's characters that the reply's first characters reproduce,
    position by position (a near-miss copy such as 2090400 for 2090410 scores 6/7)."""
    got = reply.strip()
    return sum(a == b for a, b in zip(got, answer, strict=False)) / len(answer)


def candidate_baseline(prompt: str, answers: tuple[str, ...]) -> float:
    """Probability that a uniform pick of len(answers) distinct candidate values (of the
    answers' type, found in the prompt) is exactly the gold set."""
    pattern = UUID if UUID.fullmatch(answers[0]) else NUMBER
    candidates = set(pattern.findall(prompt))
    return 1.0 / math.comb(max(len(candidates), len(answers)), len(answers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=6, help="accuracy prompts per task/length")
    parser.add_argument("--docs", type=int, default=4, help="rollout documents per length")
    parser.add_argument("--K", type=int, default=8, help="replicates per rollout document")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="*", help="demo model names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    H, seed = config["rollout"]["H"], config["seed"]
    reserve = config["datasets"]["generation_reserve"]
    lengths = [
        s["target_tokens"] - reserve for s in config["datasets"]["strata"] if s["env"] == "ruler"
    ]
    actions = {name: config["actions"][name] for name in ("full", "snapkv-half", "recent-half")}
    bench_seed = derive_seed(seed, "acceptance-benchmark")
    for name, spec in config["models"].items():
        if not spec.get("demo") or (args.models and name not in args.models):
            continue
        path = ROOT / "data" / "models" / name
        model, tokenizer = load_model(str(path), device="cpu"), load_tokenizer(str(path))
        eos = eos_token_ids(model, tokenizer)
        start = time.perf_counter()
        samples = heldout_samples(tokenizer, bench_seed, NIAH, lengths, args.per_task)
        results = evaluate_answers(model, tokenizer, [s for _, s in samples])
        print(f"\n## {name} ({spec['demo']}): needle accuracy, full cache, greedy")
        print(f"held-out prompts at {lengths} tokens; {args.per_task} per task and length")
        print("chance of a random value: 1/9,000,000 (number), 2^-122 (UUID)")
        print("| task | n | accuracy | answer recall | char agreement | candidate-pick baseline |")
        print("|---|---|---|---|---|---|")
        for task in NIAH:
            rows = [(r, s) for r, (_, s) in zip(results, samples, strict=True) if r["task"] == task]
            acc = np.mean([r["correct"] for r, _ in rows])
            rec = np.mean([r["answer_recall"] for r, _ in rows])
            ch = np.mean([candidate_baseline(s.prompt, s.answers) for _, s in rows])
            ca = np.mean([char_agreement(r["reply"], s.answers[0]) for r, s in rows])
            print(f"| {task} | {len(rows)} | {acc:.3f} | {rec:.3f} | {ca:.3f} | {ch:.3f} |")
        acc = np.mean([r["correct"] for r in results])
        ch = np.mean([candidate_baseline(s.prompt, s.answers) for _, s in samples])
        rec = np.mean([r["answer_recall"] for r in results])
        ca = np.mean(
            [
                char_agreement(r["reply"], s.answers[0])
                for r, (_, s) in zip(results, samples, strict=True)
            ]
        )
        print(
            f"| all needle tasks | {len(results)} | {acc:.3f} | {rec:.3f} | {ca:.3f} | {ch:.3f} |"
        )
        for length in lengths:
            sel = [r["correct"] for r, (n, _) in zip(results, samples, strict=True) if n == length]
            print(f"accuracy at <= {length} prompt tokens: {np.mean(sel):.3f} ({len(sel)})")
        print(f"[{time.perf_counter() - start:.0f} s]")

        docs = heldout_samples(
            tokenizer,
            derive_seed(bench_seed, "rollouts"),
            ("niah_single_2", "niah_multikey_1"),
            lengths,
            max(1, args.docs // 2),
        )
        divergence(model, tokenizer, eos, [s for _, s in docs], actions, args.K, H, seed, name)

        default_docs = default_ruler_documents(config, tokenizer)
        results = evaluate_answers(model, tokenizer, default_docs)
        print(f"\n{name}: the default's RULER documents ({len(default_docs)}), full cache, greedy")
        print("| task | n | accuracy | answer recall | char agreement |")
        print("|---|---|---|---|---|")
        for r, s in zip(results, default_docs, strict=True):
            r["chars"] = char_agreement(r["reply"], s.answers[0])
        for task in sorted({r["task"] for r in results}):
            rows = [r for r in results if r["task"] == task]
            acc = np.mean([r["correct"] for r in rows])
            rec = np.mean([r["answer_recall"] for r in rows])
            ca = np.mean([r["chars"] for r in rows])
            print(f"| {task} | {len(rows)} | {acc:.3f} | {rec:.3f} | {ca:.3f} |")
        needle = [r for r in results if r["task"].startswith("niah")]
        acc = np.mean([r["correct"] for r in needle])
        rec = np.mean([r["answer_recall"] for r in needle])
        ca = np.mean([r["chars"] for r in needle])
        print(f"| needle tasks | {len(needle)} | {acc:.3f} | {rec:.3f} | {ca:.3f} |")
        divergence(model, tokenizer, eos, default_docs, actions, args.K, H, seed, name)


def default_ruler_documents(config: dict, tokenizer) -> list[TrainingSample]:
    """The default's RULER documents, every cohort, as rule materialize_documents makes them
    (length model: the datasets section's length tokenizer, the committed tiny-llama's)."""
    cfg = DatasetsConfig.from_config(config["datasets"])
    length_tok = load_tokenizer(str(ROOT / "data" / "models" / cfg.length_tokenizer))

    def length_fn(prompt: str) -> int:
        return len(chat_prompt_ids(length_tok, prompt))

    out = []
    for stratum in cfg.strata:
        if stratum.env != "ruler":
            continue
        frame = materialize_stratum(cfg, stratum.name, length_fn)
        for task, prompt, answers in frame.select("task", "prompt", "answers").iter_rows():
            out.append(TrainingSample(task, prompt, tuple(answers)))
    return out


def divergence(model, tokenizer, eos, samples, actions, K, H, seed, name) -> None:
    """Print pooled divergence timing of each action over ``samples`` (documents weigh equally)."""
    start = time.perf_counter()
    print(f"\n{name}: coupled rollouts, H={H}, K={K}, {len(samples)} documents")
    print("| action | P(τ≤4) | P(τ≤8) | P(τ≤H) | mean δ | E[δ_2] | mean n_kept/n |")
    print("|---|---|---|---|---|---|---|")
    for action_name, action in actions.items():
        per_doc = []
        for i, sample in enumerate(samples):
            ids = chat_prompt_ids(tokenizer, sample.prompt)
            spec = {"name": action_name, **action}
            r = paths_under_action(
                model, ids, spec, f"acceptance/{name}/{i}", K, eos, RolloutSettings(H, seed)
            )
            mismatch = r.x_token != r.y_token
            tau = np.where(mismatch.any(1), mismatch.argmax(1) + 1, H + 1)
            per_doc.append(
                [
                    np.mean(tau <= 4),
                    np.mean(tau <= 8),
                    np.mean(tau <= H),
                    r.tv_rollout.mean(),
                    r.tv_rollout[:, 1].mean(),
                    r.n_kept / r.n_prompt,
                ]
            )
        m = np.mean(per_doc, axis=0)
        print(f"| {action_name} | " + " | ".join(f"{v:.3f}" for v in m) + " |")
    print(f"[{time.perf_counter() - start:.0f} s]")


if __name__ == "__main__":
    main()
