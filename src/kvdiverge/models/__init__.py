"""Models: loading a model folder (:mod:`kvdiverge.models.loading`, re-exported here), its
sources (:mod:`kvdiverge.models.sources`: GGUF, safetensors, hub folders), detokenizing answers
(:mod:`kvdiverge.models.detokenize`) and the demo models' training
(:mod:`kvdiverge.models.training`, :mod:`kvdiverge.models.training_job`).

The tokenizer's checks against its model folder: :mod:`kvdiverge.models.checks`; the demo
models' curriculum: :mod:`kvdiverge.models.curriculum`.
"""

import importlib
from typing import Any

# Re-exported from kvdiverge.models.loading on first use, so that reading a model's source
# (kvdiverge.models.sources, at the Snakefile's parse) imports no torch.
__all__ = [
    "DEMO_KINDS",
    "DeviceError",
    "build_demo_model",
    "chat_prompt_ids",
    "demo_spec_digest",
    "demo_tokenizer_and_config",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "save_model_dir",
]


def __getattr__(name: str) -> Any:
    """A name of :mod:`kvdiverge.models.loading`, imported on first use."""
    if name in __all__:
        return getattr(importlib.import_module("kvdiverge.models.loading"), name)
    raise AttributeError(f"module 'kvdiverge.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
