"""Symbolic links in ``kvdiverge compare``'s output folder: every path ``--force``
removes (or compare writes) is resolved inside ``--out``, so a symbolic link inside it named in
the manifest cannot lead to deleting outside; ``--out`` as a dangling link is refused before any
work (kvdiverge.compare.folder)."""

from __future__ import annotations

import json

import pytest
from refusal_helpers import one_line

from kvdiverge.compare.actions import CompareError
from kvdiverge.compare.folder import MANIFEST, check_out, claim_out


def manifest(root, files):
    (root / MANIFEST).write_text(json.dumps({"written_by": "kvdiverge compare", "files": files}))


@pytest.fixture
def linked(tmp_path):
    """--out holding a link ``sub`` to a folder outside, and a manifest listing sub/keep.txt."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not compare's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").symlink_to(outside, target_is_directory=True)
    manifest(out, ["sub/keep.txt", "summary.md"])
    (out / "summary.md").write_text("earlier")
    return out, outside


def test_force_refuses_a_manifest_path_that_a_link_leads_outside(linked):
    out, outside = linked
    with pytest.raises(CompareError) as info:
        check_out(out, ["summary.md"], force=True)
    assert one_line(info) == (
        f"--out: {out}/sub/keep.txt (listed in {MANIFEST}) leads outside {out} through a "
        f"symbolic link, to {outside}/keep.txt; expected every file compare writes or --force "
        "removes inside --out: remove the link or name another folder"
    )
    assert (outside / "keep.txt").read_text() == "not compare's"


def test_the_removal_itself_checks_again_and_removes_nothing(linked):
    out, outside = linked
    with pytest.raises(CompareError):
        claim_out(out, ["summary.md"])
    assert (outside / "keep.txt").read_text() == "not compare's"
    assert (out / "summary.md").read_text() == "earlier"


def test_a_file_compare_would_write_through_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").symlink_to(outside, target_is_directory=True)
    manifest(out, [])
    with pytest.raises(CompareError) as info:
        check_out(out, ["sub/trajectories.parquet"], force=True)
    assert "(a file compare writes) leads outside" in one_line(info)


def test_a_link_listed_itself_is_removed_as_a_link_only(tmp_path):
    """A manifest entry that is itself a link: removing it removes the link, not its target."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not compare's")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.md").symlink_to(outside)
    manifest(out, ["summary.md"])
    check_out(out, ["summary.md"], force=True)
    claim_out(out, ["summary.md"])
    assert not (out / "summary.md").exists() and not (out / "summary.md").is_symlink()
    assert outside.read_text() == "not compare's"


def test_links_inside_out_are_fine(tmp_path):
    out = tmp_path / "out"
    (out / "real").mkdir(parents=True)
    (out / "alias").symlink_to(out / "real", target_is_directory=True)
    (out / "alias" / "a.txt").write_text("ours")
    manifest(out, ["alias/a.txt"])
    check_out(out, ["b.txt"], force=True)
    claim_out(out, ["b.txt"])
    assert not (out / "real" / "a.txt").exists()


def test_out_as_a_dangling_link_is_refused_before_work(tmp_path):
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "gone")
    with pytest.raises(CompareError) as info:
        check_out(out, ["summary.md"], force=False)
    assert one_line(info) == (
        f"--out: {out} is a symbolic link to {tmp_path / 'gone'}, which does not exist; "
        "expected a folder (new or from compare): remove the link or name another folder"
    )


def test_out_as_a_link_to_a_folder_is_that_folder(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    out = tmp_path / "out"
    out.symlink_to(real, target_is_directory=True)
    assert check_out(out, ["summary.md"], force=False) == out
