"""The doctor's gradient-histogram PNG: the legend stays clear of the titles (issue 15.4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mixprec.numerics._histogram import plot_gradient_histogram


def _report(bins: dict[int, int], scale: float) -> dict[str, Any]:
    total = sum(bins.values()) + 5
    return {"histograms": {"activation_grads": {"bins": bins, "total": total, "zero": 5}},
            "scale_range": {"recommended": scale}}


@pytest.mark.parametrize("report", [
    _report({k: 10 for k in range(-30, -4)}, 2.0**10),  # typical: BF16's range covers the axis (a legend-only entry)
    _report({k: 10 for k in range(-140, 3)}, 2.0**16),  # very wide: the BF16 smallest-normal line is drawn
    _report({-3: 5}, 1.0),  # one bin, no scaling
], ids=["typical", "wide", "one-bin"])
def test_the_legend_does_not_cover_the_titles(report: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))  # keep the figure to measure it
    try:
        path = plot_gradient_histogram(report, tmp_path / "hist.png",
                                       title="gpt: activation-gradient magnitudes (FP32 run, 10 steps) vs the "
                                             "FP16/BF16 ranges")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        (fig,) = figures
        fig.canvas.draw()  # Agg (set by _plots): extents as written to the PNG
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert legends
        titles = [ax.title for ax in fig.axes if ax.get_title()]
        assert len(titles) == 2
        if fig._suptitle is not None:
            titles.append(fig._suptitle)
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for t in titles:
                assert not box.overlaps(t.get_window_extent(renderer)), f"the legend covers the title {t.get_text()!r}"
            for ax in fig.axes:  # nor the panels themselves (data, tick labels, axis labels)
                assert not box.overlaps(ax.get_tightbbox(renderer)), "the legend covers a panel"
            assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1), "legend outside the PNG"
    finally:
        for fig in figures:
            real_close(fig)
