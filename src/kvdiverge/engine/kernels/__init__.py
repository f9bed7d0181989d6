"""The attention kernels and their dispatch (``docs/engine.md``, "Attention kernels").

* :mod:`kvdiverge.engine.kernels.reference`: the float32 reference attention, the oracle every
  kernel is validated against;
* :mod:`kvdiverge.engine.kernels.library`: torch's fused kernels in the registry's conventions
  (masks as a padded-stride additive bias);
* :mod:`kvdiverge.engine.kernels.native`, ``prompt_attention.c`` and ``own_attention.c``: the
  native prompt kernel and the rows' own-entries kernel (AVX-512, one library), split over the
  threads torch is given;
* :mod:`kvdiverge.engine.kernels.build`: its build cache, verified before every load;
* :mod:`kvdiverge.engine.kernels.registry`: one registry keyed by (layout, device, dtype, head
  size) that validates each candidate once per process and logs its choice;
  :func:`kernel_choices` says which kernel each layout used so far;
* :mod:`kvdiverge.engine.kernels.dispatch`: the registered candidates and the calls
  :mod:`kvdiverge.engine.attention` makes through them.
"""

from kvdiverge.engine.kernels.dispatch import attend_own, attend_prompt, fused_masked_kernel
from kvdiverge.engine.kernels.reference import math_attention, prompt_reference
from kvdiverge.engine.kernels.registry import kernel_choices

__all__ = [
    "attend_own",
    "attend_prompt",
    "fused_masked_kernel",
    "kernel_choices",
    "math_attention",
    "prompt_reference",
]
