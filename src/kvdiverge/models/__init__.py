"""Models: loading a model folder (:mod:`kvdiverge.models.loading`, re-exported here), its
sources (:mod:`kvdiverge.models.sources`: GGUF, safetensors, hub folders), detokenizing answers
(:mod:`kvdiverge.models.detokenize`) and the demo models' training
(:mod:`kvdiverge.models.training`, :mod:`kvdiverge.models.training_job`).

The tokenizer's checks against its model folder: :mod:`kvdiverge.models.checks`; the demo
models' curriculum: :mod:`kvdiverge.models.curriculum`.
"""

from kvdiverge.models.loading import (
    DEMO_KINDS,
    DeviceError,
    build_demo_model,
    chat_prompt_ids,
    demo_spec_digest,
    demo_tokenizer_and_config,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    save_model_dir,
)

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
