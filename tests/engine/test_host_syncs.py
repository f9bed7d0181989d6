"""Host synchronisations per decode step (engine.rows and the attention it calls), counted:
engine.rows' own tests (its row batch's relayouts are read here).

On a GPU every read of a device value on the host (``item``, ``bool``, ``int``, ``tolist``,
``nonzero``, ``torch.equal``) and every tensor built from host data (a host-to-device copy)
stalls the stream until the device catches up. This test traces the torch calls of a coupled
rollout on the CPU (a ``TorchFunctionMode`` for the Python-level reads and copies, a
``TorchDispatchMode`` for ``nonzero``), splits them by decode step with the engine's ``on_step``
hook, and attributes each to the engine or to the coupling (``kvdiverge.theory.coupling``).

Stated bounds, for a document with three actions (two evicting halves and the full control):

* a step whose row layout does not change: at most ONE host read by the engine (the step's
  batched flags: ended rows, Z rows to start, ended streams), no host-to-device copy; with the
  coupling's own (one ``bool`` in the inverse CDF, one ``nonzero`` per action for the rows
  rejecting X) at most 1 + 1 + 3 = 5 in all. Before, such a step made 27 (12 ``bool``, 8
  ``int``, 6 ``nonzero``, 1 copy).
* a step whose layout changes (Z rows start, ended rows leave): at most 12 by the engine.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from kvdiverge.engine import RolloutSettings, batched_paths
from kvdiverge.engine import rows as rows_module
from kvdiverge.eviction import parse_action

READS = {"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "equal"}
STEADY_ENGINE, STEADY_TOTAL, RELAYOUT_ENGINE = 1, 5, 12

pytestmark = pytest.mark.usefixtures("one_thread_module")


def _origin() -> str:
    frames = [f for f in traceback.extract_stack() if "kvdiverge" in f.filename]
    if not frames:
        return "torch"
    return "coupling" if "theory" in frames[-1].filename else "engine"


class _Reads(TorchFunctionMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "tensor" and args and not isinstance(args[0], torch.Tensor)):
            self.counts[_origin()] += 1
        return func(*args, **(kwargs or {}))


class _Nonzero(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("nonzero", "_local_scalar_dense")):
            self.counts[_origin()] += 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_the_device_at_most_once(monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    actions = [
        parse_action({"selector": "recent", "budget": 0.5}, "recent-half"),
        parse_action({"selector": "snapkv", "budget": 0.5, "window": 8}, "snapkv-half"),
        parse_action({"selector": "recent", "budget": 1.0}, "full"),
    ]
    H, K = 16, 6
    documents = [("d", list(range(1, 61)), K)]  # one reference group: one unit of 6 replicates
    settings = RolloutSettings(H, 3, prompt_attention="auto")
    for _ in batched_paths(model, documents, actions, [0], settings):
        pass  # kernels validated: warm
    relayouts = []
    real = rows_module._RowBatch.relayout  # this file is engine.rows' own tests

    def counted(self):
        relayouts.append(len(steps))
        return real(self)

    monkeypatch.setattr(rows_module._RowBatch, "relayout", counted)
    counts: collections.Counter = collections.Counter()
    steps: list[dict] = []

    def on_step(batch, batches, t, horizon):
        assert (batch, batches) == (0, 1)  # the document's one unit, decoded in one batch
        steps.append(dict(counts))

    with _Reads(counts), _Nonzero(counts):  # the prefill and selections fall in step 1
        results = dict(batched_paths(model, documents, actions, [0], settings, on_step=on_step))
    assert len(steps) == H
    split = results["d"]["recent-half"].x_token != results["d"]["recent-half"].y_token
    assert split.any()  # Z rows started: the layout changed at some step
    per_step = [
        {k: after.get(k, 0) - before.get(k, 0) for k in ("engine", "coupling", "torch")}
        for before, after in zip([{}] + steps[:-1], steps, strict=True)
    ]
    # step t's counts: the host work after step t − 1's coupling, its model call, step t's
    # coupling; a relayout recorded while ``steps`` had length s falls in step s + 1's counts
    changed = {s + 1 for s in relayouts}
    steady = [c for t, c in enumerate(per_step, start=1) if t > 2 and t not in changed]
    assert len(steady) >= H // 2
    for c in steady:
        assert c["engine"] <= STEADY_ENGINE, per_step
        assert sum(c.values()) <= STEADY_TOTAL, per_step
    for t in changed & set(range(3, H + 1)):
        assert per_step[t - 1]["engine"] <= RELAYOUT_ENGINE, per_step
