"""kvdiverge: divergence timing and post-divergence disagreement under KV-cache eviction.

``docs/method.md`` explains what the package computes and ``docs/architecture.md`` how it is
organised; each module's docstring names the sections it implements.
"""

__version__ = "0.1.0"
