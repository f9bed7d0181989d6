"""Figure files (kvdiverge.plots.base.save_figure) are byte-identical on a rerun: no creation date
in the PDF, unlike matplotlib's default."""

from __future__ import annotations

import time


def test_figures_are_byte_identical_on_a_rerun(tmp_path):
    import matplotlib.pyplot as plt

    from kvdiverge.plots.base import save_figure

    def figure():
        fig, ax = plt.subplots(figsize=(3, 2))
        ax.plot([0, 1, 2], [0, 1, 4], label="a")
        ax.set_title("rerun")
        return fig

    save_figure(figure(), tmp_path / "a.png", tmp_path / "a.pdf")
    plain = figure()
    plain.savefig(tmp_path / "plain-a.pdf")
    time.sleep(1.1)  # PDF dates have one-second resolution
    save_figure(figure(), tmp_path / "b.png", tmp_path / "b.pdf")
    plain.savefig(tmp_path / "plain-b.pdf")
    plt.close(plain)
    assert (tmp_path / "a.pdf").read_bytes() == (tmp_path / "b.pdf").read_bytes()
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    # what the metadata changes: matplotlib's default stamps each PDF with its creation date
    assert b"/CreationDate" not in (tmp_path / "a.pdf").read_bytes()
    assert (tmp_path / "plain-a.pdf").read_bytes() != (tmp_path / "plain-b.pdf").read_bytes()
