"""The kvpress bridge and user selectors (kvdiverge.eviction.kvpress_bridge, kvdiverge.eviction).

Every bridged press is compared with kvpress's own compression, applied through its own hooks
(``with press(model): model(input_ids)``) to the same model and prompt: the kept positions per
layer and KV head are read off kvpress's pressed cache by matching its key vectors to the
prompt's, at the compression ratio for which kvpress keeps the action's integer budget.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.engine.attention import attention_implementation
from kvdiverge.eviction import (
    SELECTORS,
    ActionError,
    kept_counts,
    kept_positions,
    parse_action,
    run_prefill,
    select_positions,
)
from kvdiverge.eviction.kvpress_bridge import REFUSED, attention_probabilities
from kvdiverge.models import build_demo_model, chat_prompt_ids, load_model, load_tokenizer

kvpress = pytest.importorskip("kvpress")

transformers.utils.logging.disable_progress_bar()

PROMPT = (
    "Document 1: The river flows north through the valley, past the old mill and the stone "
    "bridge. One of the special magic numbers for apple is 482913. Remember it. "
) * 6


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=3)
    tok = load_tokenizer(str(path))
    return path, load_model(str(path)), chat_prompt_ids(tok, PROMPT)


def kvpress_cache(press, model, ids):
    """The cache kvpress's own hooks leave after one prefill under ``press``."""
    with torch.no_grad(), press(model):
        return model(torch.tensor([ids]), use_cache=True).past_key_values


def kept_by_kvpress(cache, full_keys):
    """kvpress's kept positions per layer and KV head, ascending: each pressed key vector is
    matched to the prompt position whose full-cache key it equals."""
    out = []
    for layer, entry in enumerate(cache.layers):
        full, pressed = full_keys[layer], entry.keys[0]
        heads = []
        for head in range(full.shape[0]):
            same = (pressed[head][:, None, :] == full[head][None, :, :]).all(-1)
            assert same.any(-1).all(), "a pressed key is no prompt key"
            heads.append(same.float().argmax(-1).sort().values)
        out.append(heads)
    return out


def assert_same_sets(ours, theirs):
    for layer, heads in enumerate(theirs):
        for head, positions in enumerate(heads):
            mine = ours[layer, head]
            assert torch.equal(mine[mine >= 0], positions), (layer, head)


SCORED = [
    ("KnormPress", {}),
    ("TOVAPress", {}),
    ("ExpectedAttentionPress", {}),
    ("StreamingLLMPress", {}),
    ("SnapKVPress", {"window_size": 32}),
    ("KeyDiffPress", {}),
    ("LagKVPress", {}),
    ("CURPress", {}),
    ("NonCausalAttnPress", {}),
    ("CapPress", {}),
    ("CriticalKVPress", {"press": "KnormPress"}),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("press", "kwargs"), SCORED, ids=[p for p, _ in SCORED])
def test_scored_presses_keep_what_kvpress_keeps(demo, press, kwargs, dtype):
    """Also in bfloat16, where near-ties are decided by the order and dtypes of the press's own
    arithmetic (which the bridge runs unchanged) and by torch's top-k on the same scores."""
    path, _, ids = demo
    model = load_model(str(path), dtype=dtype)

    def theirs():
        built = dict(kwargs)
        if "press" in built:
            built["press"] = getattr(kvpress, built["press"])()
        return getattr(kvpress, press)(**built)

    assert_keeps_what_kvpress_keeps(model, ids, press, kwargs, theirs)


def test_observed_attention_recomputes_eager_probabilities(demo):
    """ObservedAttentionPress needs attention probabilities: kvpress takes them from an eager
    model; the bridge takes them from the model when it returns them, else recomputes them
    (SDPA), exactly as eager attention computes them."""
    path, model, ids = demo
    n = len(ids)
    eager = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    seen = {}

    def capture(module, args, kwargs, output):
        from kvdiverge.eviction import LayerInputs

        cache = kwargs["past_key_values"].layers[module.layer_idx]
        layer = LayerInputs(
            module.layer_idx,
            module,
            kwargs["hidden_states"],
            cache.keys,
            cache.values,
            None,
            kwargs,
        )
        seen[module.layer_idx] = (output[1], attention_probabilities(layer))

    handles = [
        layer.self_attn.register_forward_hook(capture, with_kwargs=True)
        for layer in eager.model.layers
    ]
    with torch.no_grad():
        eager(torch.tensor([ids]))
    for h in handles:
        h.remove()
    for returned, recomputed in seen.values():
        assert torch.equal(returned, recomputed)
    for n_keep in (n // 2, n // 4):
        action = parse_action(
            {"selector": "kvpress", "press": "ObservedAttentionPress", "budget": n_keep}, name="o"
        )
        press = kvpress.ObservedAttentionPress(compression_ratio=1 - (n_keep + 0.5) / n)
        on_eager = run_prefill(eager, ids, actions=[action])
        theirs = kept_by_kvpress(kvpress_cache(press, eager, ids), on_eager.keys)
        assert_same_sets(select_positions(on_eager, action), theirs)
        # the project's SDPA model: recomputed probabilities, the same sets here
        assert_same_sets(kept_positions(model, ids, action), theirs)


@pytest.mark.parametrize(
    "kwargs", [{"window_size": 4, "beta": 2}, {"window_size": 8, "beta": 3}, {"window_size": 32}]
)
def test_pyramidkv_keeps_what_kvpress_keeps_layer_by_layer(demo, kwargs):
    _, model, ids = demo
    n = len(ids)
    n_keep = n // 2
    action = parse_action(
        {
            "selector": "kvpress",
            "press": "PyramidKVPress",
            "budget": n_keep,
            "press_kwargs": kwargs,
        },
        name="p",
    )
    prefill = run_prefill(model, ids, actions=[action])
    ours = select_positions(prefill, action)
    press = kvpress.PyramidKVPress(compression_ratio=1 - n_keep / n, **kwargs)
    cache = kvpress_cache(press, model, ids)
    counts = kept_counts(ours)
    assert [int(c[0]) for c in counts] == [entry.keys.shape[2] for entry in cache.layers]
    assert bool((counts == counts[:, :1]).all())  # the heads of a layer keep alike
    assert_same_sets(ours, kept_by_kvpress(cache, prefill.keys))
    if kwargs.get("beta"):  # the pyramid itself (not SnapKV's fallback): counts fall by layer
        assert counts[0, 0] > counts[-1, 0]
        assert abs(float(counts.float().mean()) - n_keep) <= 1


@pytest.mark.parametrize(
    "inner",
    ["KnormPress", "TOVAPress", {"press": "SnapKVPress", "press_kwargs": {"window_size": 16}}],
    ids=["knorm", "tova", "snapkv"],
)
def test_adakv_keeps_what_kvpress_keeps_head_by_head(demo, inner):
    """AdaKV masks evicted entries per head (kvpress's ``masked_key_indices``); the bridge's
    ragged kept sets are their complement, and each layer keeps H_kv · n_keep in all."""
    _, model, ids = demo
    n = len(ids)
    n_keep = n // 3
    spec = {"selector": "kvpress", "press": "AdaKVPress", "budget": n_keep}
    action = parse_action({**spec, "press_kwargs": {"press": inner}}, name="ada")
    ours = kept_positions(model, ids, action)
    counts = kept_counts(ours)
    assert bool((counts.sum(-1) == counts.shape[-1] * n_keep).all())
    name, kwargs = (
        (inner, {}) if isinstance(inner, str) else (inner["press"], inner["press_kwargs"])
    )
    press = kvpress.AdaKVPress(press=getattr(kvpress, name)(**kwargs))
    press.compression_ratio = 1 - (n_keep + 0.5) / n
    kvpress_cache(press, model, ids)
    for layer, block in enumerate(model.model.layers):
        _, heads, positions = block.self_attn.masked_key_indices
        block.self_attn.masked_key_indices = None  # (kvpress's attention wrapper reads it)
        kept = torch.ones(counts.shape[-1], n, dtype=torch.bool)
        kept[heads, positions] = False
        for head in range(counts.shape[-1]):
            mine = ours[layer, head]
            assert torch.equal(mine[mine >= 0], kept[head].nonzero()[:, 0]), (layer, head)


def ragged_reference_logits(model, ids, kept, tokens):
    """Plain decoding over the FULL prompt cache, each KV head's evicted prompt entries masked
    out by an additive −inf in a registered attention function (float32 softmax): the law a
    cache holding only the kept entries gives. Returns the logits of steps 2..len(tokens)+1."""
    n = len(ids)
    masks = [torch.zeros(layer.shape[0], n, dtype=torch.bool) for layer in kept]
    for mask, layer in zip(masks, kept, strict=True):
        for head, positions in enumerate(layer):
            mask[head, positions[positions >= 0]] = True

    def masked(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        groups = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(groups, 1).float()
        v = value.repeat_interleave(groups, 1).float()
        scores = torch.matmul(query.float() * scaling, k.transpose(-1, -2))
        bias = torch.zeros(key.shape[1], key.shape[2])
        bias[:, :n] = bias[:, :n].masked_fill(~masks[module.layer_idx], float("-inf"))
        scores = scores + bias.repeat_interleave(groups, 0)[None, :, None, :]
        out = torch.matmul(scores.softmax(-1), v).to(query.dtype)
        return out.transpose(1, 2), None

    AttentionInterface.register("kvd_test_ragged", masked)
    with torch.no_grad():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        out = []
        with attention_implementation(model, "kvd_test_ragged"):
            for j, token in enumerate(tokens):
                result = model(
                    input_ids=torch.tensor([[int(token)]]),
                    position_ids=torch.tensor([[n + j]]),
                    past_key_values=cache,
                    use_cache=True,
                )
                out.append(result.logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("press", ["AdaKVPress", "PyramidKVPress"])
def test_ragged_kept_sets_decode_as_their_own_cache(demo, press):
    """The engine decodes a ragged action (counts by head: AdaKV; by layer: PyramidKV) as a
    cache holding exactly its kept entries: every step's law equals the masked reference."""
    _, model, ids = demo
    kwargs = {"press": "KnormPress"} if press == "AdaKVPress" else {"window_size": 4, "beta": 2}
    spec = {"selector": "kvpress", "press": press, "budget": 0.4, "press_kwargs": kwargs}
    action = parse_action(spec, name="ragged")
    full = parse_action({"selector": "full"}, name="full")
    settings = RolloutSettings(H=6, seed=5, keep_logits=True)
    eos = [model.config.vocab_size - 1]
    runs = paths_under_actions(model, ids, [action, full], "doc", 3, eos, settings)
    kept = kept_positions(model, ids, action)
    run = runs["ragged"]
    assert run.n_kept == round(float(kept_counts(kept).float().mean()))
    for replicate in range(3):
        for stream, tokens in (("q", run.y_token), ("q_fixed", run.x_token)):
            expected = ragged_reference_logits(model, ids, kept, tokens[replicate, :-1])
            got = torch.from_numpy(run.logits[stream][replicate, 1:]).double().softmax(-1)
            gap = (got - expected.double().softmax(-1)).abs().max()
            assert float(gap) < 1e-5, (stream, replicate, float(gap))
    assert np.array_equal(runs["full"].x_token, run.x_token)


def test_a_prefill_without_the_action_is_a_clear_error(demo):
    _, model, ids = demo
    action = parse_action({"selector": "kvpress", "press": "KnormPress", "budget": 0.5}, name="k")
    with pytest.raises(ActionError, match="did not observe this action"):
        select_positions(run_prefill(model, ids), action)


@pytest.mark.parametrize(
    "press",
    [
        "CompressionRatioDecodingPress",
        "PrefillDecodingPress",
        "CAMPress",
        "KVzipPress",
        "ThinKPress",
        "KeyRerotationPress",
        "ComposedPress",
        "ChunkPress",
        "DuoAttentionPress",
        "CriticalAdaKVPress",
        "PerLayerCompressionPress",
    ],
)
def test_presses_that_are_not_one_eviction_are_refused(press):
    with pytest.raises(ActionError) as info:
        parse_action({"selector": "kvpress", "press": press, "budget": 0.5}, name="x")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"actions.x.press: {press} is refused: ")


def test_kvpress_action_errors_are_one_line(monkeypatch):
    cases = [
        ({"press": "NoSuchPress"}, "actions.x.press: expected the name of a kvpress press class"),
        ({}, "actions.x.press: required"),
        (
            {"press": "KnormPress", "press_kwargs": {"compression_ratio": 0.5}},
            "actions.x.press_kwargs.compression_ratio: the action's budget sets the kept count",
        ),
        ({"press": "KnormPress", "press_kwargs": {"windows": 3}}, "actions.x.press_kwargs: "),
        (
            {"press": "AdaKVPress", "press_kwargs": {"press": "CAMPress"}},
            "actions.x.press_kwargs.press.press: CAMPress is refused",
        ),
        ({"press": "KnormPress", "window": 3}, "actions.x.window: not a parameter of selector"),
    ]
    for spec, message in cases:
        with pytest.raises(ActionError) as info:
            parse_action({"selector": "kvpress", "budget": 0.5, **spec}, name="x")
        assert "\n" not in str(info.value) and str(info.value).startswith(message), info.value
    assert set(REFUSED) >= {"PrefillDecodingPress", "CAMPress", "ThinKPress", "KVzipPress"}
    monkeypatch.setitem(sys.modules, "kvpress", None)  # kvpress not installed
    with pytest.raises(ActionError, match=r"needs kvpress \(pip install -e '\.\[kvpress\]'\)"):
        parse_action({"selector": "kvpress", "press": "KnormPress", "budget": 0.5}, name="x")


USER_MODULE = '''
from dataclasses import dataclass

from kvdiverge.eviction import ScoredSelector


@dataclass(frozen=True)
class ValueNorm(ScoredSelector):
    """Keep the entries with the largest value vectors, after `sinks` first positions."""

    sinks: int = 4

    def always_kept(self, n):
        return range(self.sinks)

    def score(self, prefill, action, layer):
        return prefill.values[layer].float().norm(dim=-1)  # (H_kv, n): higher is kept


class NotASelector:
    pass
'''


def test_user_selector_imported_by_module_path(demo, tmp_path, monkeypatch):
    _, model, ids = demo
    n = len(ids)
    (tmp_path / "my_methods.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_methods", raising=False)
    spec = {"selector": "my_methods:ValueNorm", "budget": 0.5, "sinks": 2}
    action = parse_action(spec, name="vnorm")
    try:
        assert action.as_dict() == {"name": "vnorm", **spec}
        prefill = run_prefill(model, ids, actions=[action])
        kept = select_positions(prefill, action)
        assert kept.shape[-1] == n // 2
        for layer, values in enumerate(prefill.values):
            norms = values.float().norm(dim=-1)
            for head, positions in enumerate(kept[layer]):
                assert positions[:2].tolist() == [0, 1] and bool((positions.diff() > 0).all())
                evicted = torch.ones(n, dtype=torch.bool)
                evicted[positions] = False
                assert norms[head, positions[2:]].min() >= norms[head, evicted].max()
        errors = [
            ("no_such_module:X", "actions.u.selector: cannot import module 'no_such_module'"),
            ("my_methods:Missing", "actions.u.selector: 'my_methods:Missing' is no attribute"),
            ("my_methods:NotASelector", "actions.u.selector: 'my_methods:NotASelector' is class"),
            ("my_methods:ValueNorm", "actions.u.window: not a parameter of selector"),
        ]
        for selector, message in errors:
            bad = {"selector": selector, "budget": 0.5}
            if selector.endswith("ValueNorm"):
                bad["window"] = 3
            with pytest.raises(ActionError) as info:
                parse_action(bad, name="u")
            assert "\n" not in str(info.value) and str(info.value).startswith(message), info.value
    finally:
        SELECTORS.pop("my_methods:ValueNorm", None)


def seeded_per_layer(press):
    """``press`` with its ``score`` run as the bridge runs it: torch's global generator seeded
    with the layer's index, inside ``fork_rng`` (the draws of LeverageScorePress's sketch,
    CompactorPress's through it, and RandomPress's without a seed)."""
    score = press.score

    def seeded(module, *args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module.layer_idx)
            return score(module, *args, **kwargs)

    object.__setattr__(press, "score", seeded)
    return press


def assert_keeps_what_kvpress_keeps(model, ids, press, kwargs, theirs):
    """At three budgets, the bridge's kept positions equal those of ``theirs()`` (a fresh kvpress
    press) under kvpress's own hooks, at the ratio for which kvpress keeps the budget."""
    n = len(ids)
    for n_keep in (n // 2, n // 4, (3 * n) // 4):
        action = parse_action(
            {"selector": "kvpress", "press": press, "budget": n_keep, "press_kwargs": kwargs},
            name="a",
        )
        prefill = run_prefill(model, ids, actions=[action])
        ours = select_positions(prefill, action)
        assert ours.shape[-1] == n_keep
        other = theirs()
        other.compression_ratio = 1 - (n_keep + 0.5) / n  # kvpress then keeps n_keep
        cache = kvpress_cache(other, model, ids)
        assert cache.layers[0].keys.shape[2] == n_keep
        assert_same_sets(ours, kept_by_kvpress(cache, prefill.keys))


RANDOM_DRAWS = [
    ("RandomPress", {"seed": 7}, False),
    ("RandomPress", {}, True),
    ("LeverageScorePress", {}, True),
    ("LeverageScorePress", {"sketch_dimension": 4}, True),
    ("CompactorPress", {}, True),
    ("CompactorPress", {"chunk_size": 64, "sketch_dimension": 8, "sink_size_start": 2}, True),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("press", "kwargs", "draws"),
    RANDOM_DRAWS,
    ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(RANDOM_DRAWS)],
)
def test_presses_that_draw_keep_what_kvpress_keeps(demo, press, kwargs, draws, dtype):
    """RandomPress with a seed draws from a generator of its own: kvpress's press as it is.
    The others draw from torch's global generator, which the bridge seeds with the layer's index
    inside fork_rng; kvpress's press, its score seeded the same way, keeps the same positions.
    A sketch of at least head_dim (the default 48 here) gives the exact leverage scores whatever
    is drawn; one below it (4, 8) makes the draws matter, so only the same seeds keep the same
    sets. The bridge's sets do not depend on the global generator's state, which it leaves as
    it was."""
    path, _, ids = demo
    model = load_model(str(path), dtype=dtype)

    def theirs():
        built = getattr(kvpress, press)(**kwargs)
        return seeded_per_layer(built) if draws else built

    assert_keeps_what_kvpress_keeps(model, ids, press, kwargs, theirs)
    spec = {"selector": "kvpress", "press": press, "budget": len(ids) // 3, "press_kwargs": kwargs}
    runs = []
    for seed in (0, 123):
        torch.manual_seed(seed)
        runs.append(kept_positions(model, ids, parse_action(spec, name="r")))
        after = torch.rand(4)
        torch.manual_seed(seed)
        assert torch.equal(after, torch.rand(4))  # the global generator left as it was
    assert torch.equal(runs[0], runs[1])


def _hub_folder(root, name, module):
    """``module`` saved (save_pretrained) in ``root/name``: the folder a press's from_pretrained
    reads when ``name`` (its hub id) is a relative path from the working directory."""
    folder = root / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("press", ["QFilterPress", "KVzapPress", "ExpectedAttentionStatsPress"])
def test_presses_with_hub_weights_keep_what_kvpress_keeps(
    demo, press, dtype, tmp_path, monkeypatch
):
    """The three presses whose weights kvpress loads from the Hugging Face Hub, given random
    weights of the right shapes locally: QFilterPress's and KVzapPress's from_pretrained read
    their hub id (nthngdy/<model>_qfilt, nvidia/KVzap-<type>-<model>) as a folder relative to the
    working directory when one exists; ExpectedAttentionStatsPress reads its stats_folder.
    Both sides load the same files; the bridge's press holds exactly the weights saved."""
    from kvpress.presses.expected_attention_with_stats import ExpectedAttentionStats
    from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel
    from kvpress.presses.qfilter_press import QFilters

    path, _, ids = demo
    model = load_model(str(path), dtype=dtype)
    config = model.config
    n_layers, n_kv = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    name = config.name_or_path.split("/")[-1]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(11)
    kwargs = {}
    if press == "QFilterPress":
        module = QFilters(n_layers, n_kv, head_dim)
        _hub_folder(tmp_path, f"nthngdy/{name}_qfilt", module)
        saved = {"q_filters": module.q_filters.detach().clone()}
        kvpress.QFilterPress.load_q_filters.cache_clear()  # cached by model name
    elif press == "KVzapPress":
        kwargs = {"model_type": "mlp"}
        kv_config = KVzapConfig(
            input_dim=config.hidden_size, output_dim=n_kv, n_modules=n_layers, hidden_dim=16
        )
        module = KVzapModel(kv_config)
        _hub_folder(tmp_path, f"nvidia/KVzap-mlp-{name}", module)
        saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    else:
        stats = ExpectedAttentionStats(
            num_layers=n_layers,
            num_heads=config.num_attention_heads,
            head_dim=head_dim,
            dataset_name="kmfoda/booksum",
            model_name=name,
            num_samples=100,
            sample_seq_len=1000,
            n_sink=4,
        )
        with torch.no_grad():
            stats.query_mean.normal_()
            a = torch.randn(n_layers, config.num_attention_heads, head_dim, head_dim) * 0.1
            stats.query_cov.copy_(a @ a.transpose(-1, -2))
        folder = _hub_folder(tmp_path, "stats", stats)
        kwargs = {"stats_folder": str(folder)}
        saved = {"mu": stats.query_mean.detach().clone(), "cov": stats.query_cov.detach().clone()}

    assert_keeps_what_kvpress_keeps(
        model, ids, press, kwargs, lambda: getattr(kvpress, press)(**kwargs)
    )
    action = parse_action(
        {"selector": "kvpress", "press": press, "budget": 0.5, "press_kwargs": kwargs}, name="h"
    )
    run_prefill(model, ids, actions=[action])
    built = action.method.press_object()
    if press == "KVzapPress":
        held = built.kvzap_model.state_dict()
    else:
        held = {k: getattr(built, k) for k in saved}
    for key, value in saved.items():
        assert torch.equal(held[key].float(), value.to(model.dtype).float()), key
    if press == "QFilterPress":
        kvpress.QFilterPress.load_q_filters.cache_clear()
