"""docs/compression.md's kvpress table lists every press class the installed kvpress exports,
with the status the bridge gives it (kvdiverge.eviction.kvpress_status), and claims a test
against kvpress's own output only for presses tests/eviction/test_kvpress_bridge.py,
tests/eviction/test_kvpress_decoding.py or tests/eviction/test_kvpress_merging.py runs."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("kvpress")

from kvdiverge.eviction.kvpress_status import exported_presses, press_status  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compression.md"
BRIDGE_TESTS = [
    ROOT / "tests" / "eviction" / f"test_kvpress_{n}.py" for n in ("bridge", "decoding", "merging")
]


def _table() -> dict[str, list[str]]:
    """The rows of the table under the heading "kvpress presses": press -> its other cells."""
    text = DOC.read_text()
    section = text.split("## kvpress presses", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_every_exported_press_is_listed_once_with_its_status():
    from importlib.metadata import version

    table = _table()
    exported = exported_presses()
    assert len(exported) == 44  # kvpress 0.5.5: 44 presses besides BasePress and ScorerPress
    assert version("kvpress") == "0.5.5"
    assert sorted(table) == exported
    tests = "".join(path.read_text() for path in BRIDGE_TESTS)
    for name, (status, why, tested) in table.items():
        assert (status, why) == press_status(name), name
        if status == "refused":
            assert tested == "—", name
        else:  # "yes" only where the bridge's tests run the press against kvpress's own
            assert tested == ("yes" if f'"{name}"' in tests else "no"), name


def test_table_is_kvpress_all_enumerated_here():
    """The table's presses against ``kvpress.__all__`` read here, independently of
    kvdiverge.eviction.kvpress_status: every exported name ending in "Press" but the two base
    classes, and no other exported class is a press."""
    import inspect

    import kvpress

    named = {n for n in kvpress.__all__ if n.endswith("Press")} - {"BasePress", "ScorerPress"}
    for name in kvpress.__all__:
        obj = getattr(kvpress, name)
        if inspect.isclass(obj) and issubclass(obj, kvpress.BasePress):
            assert name.endswith("Press"), name
        if name in named:
            assert inspect.isclass(obj) and issubclass(obj, kvpress.BasePress), name
    assert len(named) == 44 and sorted(_table()) == sorted(named)


def test_counts_in_the_text_match_the_table():
    table = _table()
    bridged = sum(status == "bridged" for status, _, _ in table.values())
    text = DOC.read_text()
    assert f"{bridged} are bridged" in text and f"{len(table) - bridged} are refused" in text
