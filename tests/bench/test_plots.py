"""The lab's figure: explained metric names, which way is better, n/a drawn as n/a, MIA's chance
line (issue 27, item 9); checked on the figure's texts before it is written."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.lab import plot  # noqa: E402


def test_lab_plot_explains_metrics_and_draws_na(tmp_path, monkeypatch):
    seen = {}
    real_close = plt.close

    def keep(fig=None):
        seen["fig"] = fig
        real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    result = {"results": [{"method": "FL (with target)", "ter": 0.058, "ba_asr": 1.0, "mia_asr": 0.52, "arp": None},
                          {"method": "starfish", "ter": 0.071, "ba_asr": 0.0, "mia_asr": 0.5, "arp": 78.0}],
              "config": {"dataset": "digits", "model": "logreg", "clients": 20, "rounds": 40, "targets": [0]}}
    plot(result, tmp_path / "lab.png")
    assert (tmp_path / "lab.png").stat().st_size > 0
    axes = seen["fig"].axes
    titles = [ax.get_title() for ax in axes]
    assert "test error rate" in titles[0] and "lower is better" in titles[0]
    assert "nearer 50% (chance) is better" in titles[2] and "higher is better" in titles[3]
    assert [t.get_text() for t in axes[3].texts] == ["n/a", "78.0"]      # ARP of plain FL does not apply
    assert [t.get_text() for t in axes[1].texts] == ["100.0", "0.0"]      # a true zero is labelled
    assert any(abs(line.get_ydata()[0] - 50.0) < 1e-9 for line in axes[2].lines)   # the chance line


def test_steps_plot_sets_the_paper_beside_mnist_only(tmp_path):
    from bench.steps import plot as steps_plot

    row = {"sample": False, "extrapolated": False, "online_bytes": 2e9, "offline_bytes": 5e9,
           "online_s": 10.0, "offline_s": 20.0}
    mnist = [{**row, "step": "TC", "paper": {"offline_s": 1.0, "online_s": 2.0, "offline_gb": 3.0, "online_gb": 2.66}},
             {**row, "step": "UE"}]
    steps_plot(mnist, tmp_path / "mnist.png", "config mnist")
    steps_plot([{**row, "step": "TC"}], tmp_path / "tiny.png", "config tiny")
    assert (tmp_path / "mnist.png").stat().st_size > 0 and (tmp_path / "tiny.png").stat().st_size > 0
