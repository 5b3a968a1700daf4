"""The library's plots: units picked from the data, and what ``gnnpar report`` draws."""

from __future__ import annotations

import io
import json

import pytest

from gnnpar.fmt import byte_unit, format_bytes, time_unit
from gnnpar.plotting import new_figure, plain_axis
from gnnpar.train.report import report_figures, write_report

pytest.importorskip("matplotlib")


def _gpt_records(steps: int = 6, eval_every: int = 3) -> list[dict]:
    """Records as ``gnnpar train gpt`` writes them: tokens/s, val_loss every few steps."""
    records: list[dict] = [{"event": "start", "grid": {"data": 2}}]
    for step in range(1, steps + 1):
        r = {
            "loss": 5.0 - 0.1 * step,
            "tokens_per_s": 1000.0 + step,
            "seconds": 0.05,
            "bytes": {"data": {"all_gather": 24_000_000, "reduce_scatter": 24_000_000}},
            "step": step,
        }
        if step % eval_every == 0:
            r["val_loss"] = 5.05 - 0.1 * step
        records.append(r)
    return [*records, {"event": "end"}]


def _gcn_records(epochs: int = 4, vary: bool = False) -> list[dict]:
    """Records as ``gnnpar train gcn`` writes them: seconds per epoch, no rate of its own."""
    return [
        {
            "loss": 1.0 / epoch,
            "seconds": 0.02,
            "bytes": {
                "x": {"all_gather": 3_000_000_000 + (epoch * 10**8 if vary else 0)},
                "y": {"all_reduce": 256, "all_gather": 2_000_000_000},
            },
            "epoch": epoch,
        }
        for epoch in range(1, epochs + 1)
    ]


def _drawn(fig) -> None:
    fig.savefig(io.BytesIO(), format="png")  # tick labels and offsets exist once drawn


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.parametrize(
    "n, unit",
    [(999, ("B", 1.0)), (256_412, ("kB", 1e3)), (3e7, ("MB", 1e6)), (2.5e9, ("GB", 1e9))],
)
def test_byte_unit_is_picked_from_the_data(n, unit):
    assert byte_unit(n) == unit


def test_byte_and_time_formats():
    assert byte_unit(3 * 2**20, binary=True) == ("MiB", 2.0**20)
    assert format_bytes(256_412) == "256 kB" and format_bytes(16) == "16 B"
    assert time_unit(0.04) == ("ms", 1e-3) and time_unit(12.0) == ("s", 1.0)


def test_plain_axis_has_no_offset_or_powers_of_ten():
    fig = new_figure(4, 3)
    ax = fig.subplots()
    ax.plot([1, 2, 3], [10_000_001, 10_000_001, 10_000_001])
    plain_axis(ax.yaxis)
    log = fig.add_subplot(2, 1, 2)
    log.plot([1, 2], [4.6, 5.7])
    log.set_yscale("log")
    plain_axis(log.yaxis)
    _drawn(fig)
    assert ax.yaxis.get_offset_text().get_text() == ""
    labels = [t.get_text() for t in log.yaxis.get_ticklabels(minor=True) if t.get_text()]
    assert labels and all("10^" not in s and "times" not in s for s in labels), labels


def test_gpt_report_has_validation_loss_tokens_per_second_and_bytes_in_mb():
    figs = report_figures(_gpt_records(), "gpt")
    assert set(figs) == {"loss", "throughput", "bytes"}
    (loss,) = figs["loss"].axes
    assert [line.get_label() for line in loss.get_lines()] == ["train loss", "validation loss"]
    val = loss.get_lines()[1]
    assert list(val.get_xdata()) == [3, 6]
    (rate,) = figs["throughput"].axes
    assert "tokens/s" in rate.get_ylabel() and _legend(rate) == ["tokens/s"]
    (sent,) = figs["bytes"].axes
    _drawn(figs["bytes"])
    assert sent.get_ylabel().startswith("MB per step")
    assert sent.yaxis.get_offset_text().get_text() == ""
    # Constant bytes are bars, one per (axis, collective), not flat lines.
    assert not sent.get_lines() and len(sent.patches) == 2
    assert [p.get_height() for p in sent.patches] == [24.0, 24.0]


def test_gcn_report_throughput_is_epochs_per_second_and_bytes_in_gb():
    figs = report_figures(_gcn_records(), "gcn")
    (rate,) = figs["throughput"].axes
    assert rate.get_ylabel() == "throughput (epochs/s)" and _legend(rate) == ["epochs/s"]
    assert rate.get_lines()[0].get_ydata()[0] == pytest.approx(50.0)
    (sent,) = figs["bytes"].axes
    # 256 B next to 2 GB: a log scale keeps the small bar visible.
    assert sent.get_ylabel().startswith("GB per epoch") and sent.get_yscale() == "log"
    assert sorted(_legend(sent)) == ["all_gather", "all_reduce"]
    assert [t.get_text() for t in sent.get_xticklabels()] == ["axis x", "axis y"]


def test_bytes_that_change_are_lines_per_axis():
    figs = report_figures(_gcn_records(vary=True), "gcn")
    (sent,) = figs["bytes"].axes
    assert [line.get_label() for line in sent.get_lines()] == ["axis x", "axis y"]
    assert sent.get_ylabel().startswith("GB per epoch")
    assert sent.get_lines()[0].get_ydata()[0] == pytest.approx(3.1)


def test_sage_throughput_is_training_seeds_per_second():
    records = [{"loss": 1.0, "seeds_per_s": 470.0, "seconds": 0.2, "epoch": e} for e in (1, 2)]
    (rate,) = report_figures(records, "sage")["throughput"].axes
    assert rate.get_ylabel() == "throughput (training seeds/s)"


def test_write_report_writes_the_gpt_plots(tmp_path):
    lines = "".join(json.dumps(r) + "\n" for r in _gpt_records())
    (tmp_path / "metrics.jsonl").write_text(lines)
    summary = write_report(tmp_path)
    for name in ("loss", "throughput", "bytes"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "final val_loss" in summary
