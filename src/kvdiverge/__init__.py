"""kvdiverge: divergence timing and post-divergence disagreement under KV-cache eviction.

The package implements ``../shared/SPEC.md``; each public function's docstring names the
section it implements.
"""

__version__ = "0.1.0"
