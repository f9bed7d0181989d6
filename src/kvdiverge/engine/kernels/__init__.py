"""The attention kernels and their dispatch (``docs/architecture.md``, "Attention kernels").

* :mod:`kvdiverge.engine.kernels.registry`: one registry keyed by (layout, device, dtype, head
  size) that validates each candidate once per process and logs its choice;
  :func:`kernel_choices` says which kernel each layout used so far.
"""

from kvdiverge.engine.kernels.registry import kernel_choices

__all__ = ["kernel_choices"]
