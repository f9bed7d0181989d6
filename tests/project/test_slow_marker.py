"""The ``slow`` marker holds to what docs/testing.md says (tests/conftest.py): a test not marked
slow that starts Snakemake fails with one line naming it, before the process starts; other
programs start as usual, and a test marked slow may start Snakemake; a test not marked slow that
asks for the materialized SmolLM2 by name (``request.getfixturevalue``) fails the same way,
before it is materialized."""

from __future__ import annotations

import subprocess
import sys

import pytest
from workflow_helpers import SNAKEMAKE

THIS = "tests/project/test_slow_marker.py"


def test_an_unmarked_test_cannot_start_snakemake():
    with pytest.raises(RuntimeError) as info:
        subprocess.run([SNAKEMAKE, "--version"], capture_output=True)
    assert str(info.value) == (
        f"{THIS}::test_an_unmarked_test_cannot_start_snakemake starts snakemake but is not "
        "marked slow: add @pytest.mark.slow (or a module's pytestmark), so that the fast run "
        '(-m "not slow", docs/testing.md) leaves it out'
    )
    with pytest.raises(RuntimeError):
        subprocess.Popen(f"{SNAKEMAKE} -n", shell=True)  # a command line too
    done = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
    assert done.stdout == "1\n"


@pytest.mark.slow
def test_a_slow_test_may_start_snakemake():
    done = subprocess.run([SNAKEMAKE, "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip()


def test_an_unmarked_test_cannot_ask_for_smollm2_by_name(request):
    with pytest.raises(RuntimeError) as info:
        request.getfixturevalue("smollm2_folder")
    assert str(info.value) == (
        f"{THIS}::test_an_unmarked_test_cannot_ask_for_smollm2_by_name uses smollm2_folder but "
        "is not marked slow: add @pytest.mark.slow (or a module's pytestmark), so that the fast "
        'run (-m "not slow", docs/testing.md) leaves it out'
    )
    assert request.getfixturevalue("tmp_path").is_dir()  # other fixtures as usual
