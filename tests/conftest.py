"""Suite-wide settings.

The README's test command runs two pytest-xdist workers on a 2-core machine. Each worker keeps
one torch thread, and the processes it starts (Snakemake runs, training jobs) inherit
``OMP_NUM_THREADS=1``, so that the two workers do not oversubscribe the cores. Tests that compare
results across thread counts set their own counts explicitly.
"""

import os


def pytest_configure(config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
