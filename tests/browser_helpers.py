"""Headless Chromium for the tests of HTML pages (shared by tests): the page's DOM after its
scripts ran and a screenshot's pixels. Tests that use it skip when Chromium is not installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
"""The Chromium executable, or None."""

_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
)


def render_in_chromium(
    page: Path, tmp_path: Path, size: tuple[int, int] = (1200, 900)
) -> tuple[str, np.ndarray]:
    """Open ``page`` in headless Chromium (a fresh profile under ``tmp_path``): its DOM as
    drawn (``--dump-dom``) and the RGB pixels of a screenshot of ``size`` (width, height); each
    step must succeed and the screenshot be more than a blank image's few kilobytes."""
    from PIL import Image

    assert CHROMIUM is not None, "headless Chromium is not installed"
    uri = page.resolve().as_uri()
    flags = [*_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    flags.append(f"--window-size={size[0]},{size[1]}")
    dom = subprocess.run(
        [CHROMIUM, *flags, "--dump-dom", uri], capture_output=True, text=True, timeout=120
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = tmp_path / "page.png"
    done = subprocess.run(
        [CHROMIUM, *flags, f"--screenshot={shot}", uri], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and shot.stat().st_size > 10_000, done.stderr[-2000:]
    return dom.stdout, np.asarray(Image.open(shot).convert("RGB")).astype(int)


def has_colour(pixels: np.ndarray, rgb: tuple[int, int, int], tolerance: int = 12) -> bool:
    """Whether any pixel lies within ``tolerance`` (summed over channels) of ``rgb``."""
    return bool((np.abs(pixels - np.array(rgb)).sum(-1) < tolerance).any())
