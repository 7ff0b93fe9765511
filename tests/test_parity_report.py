"""The report of a parity run folder: the learning curves, the verdict table, refusals."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pandas as pd
import pytest

from bench_lib import commands
from bench_lib.report import build, parity_report
from bench_lib.results.schema import PARITY_COLUMNS, PARITY_VERDICT_COLUMNS
from bench_lib.results.store import write_json_atomic
from tests.test_report import env, synthetic_run
from tests.test_report_browser import CHROMIUM, probe

RUN = "20260101T000000Z_host_abcdef0"
# mlp: every strategy as single; resnet-tiny: 1f1b ends away from accum (diverged).
ENDS = {("mlp", "single"): 0.20, ("mlp", "ddp"): 0.20 + 1e-8, ("mlp", "gpipe"): 0.20 + 2e-8,
        ("resnet-tiny", "single"): 0.30, ("resnet-tiny", "accum"): 0.33,
        ("resnet-tiny", "1f1b"): 0.36}


def _epoch_rows() -> list[dict]:
    rows = []
    runs = [(m, s, "fp32", 0) for m, s in ENDS] + [("mlp", "single", "fp64", 0),
                                                   ("resnet-tiny", "single", "fp64", 0),
                                                   ("resnet-tiny", "single", "fp32", 1),
                                                   ("resnet-tiny", "single", "fp32", 2)]
    for model, strategy, precision, seed in runs:
        end = ENDS[(model, strategy)] + 0.01 * seed
        for epoch in range(3):
            loss = end * (3 - epoch)
            rows.append({"run_id": RUN, "model": model, "strategy": strategy,
                         "precision": precision, "seed": seed, "world_size": 1,
                         "epoch": epoch, "train_loss": loss * 1.1, "test_loss": loss,
                         "test_accuracy": 0.9 - 0.1 * (2 - epoch), "epoch_time_s": 0.5})
    return rows


def _verdict_rows() -> list[dict]:
    def row(model, strategy, verdict, **more):
        return {"run_id": RUN, "model": model, "strategy": strategy, "verdict": verdict,
                "world_size": 1, "test_loss": ENDS.get((model, strategy)),
                "test_accuracy": 0.9} | more

    rounding = {"tolerance_kind": "rounding", "loss_tolerance": 2e-6,
                "accuracy_tolerance": 1 / 360, "tolerance_note": "loss: max(10 x ...)"}
    seeds = {"tolerance_kind": "seeds", "loss_tolerance": 0.08, "accuracy_tolerance": 0.04,
             "tolerance_note": "loss: t x sqrt(2) x s over 3 seeds of single = ..."}
    return [
        row("mlp", "single", "reference", **rounding),
        row("mlp", "ddp", "match", compared_with="single", test_loss_diff=1e-8, **rounding),
        row("mlp", "gpipe", "match", compared_with="single", test_loss_diff=2e-8, **rounding),
        row("mlp", "dp", "unsupported", test_loss=None, test_accuracy=None,
            reason="dp needs CUDA devices"),
        row("resnet-tiny", "single", "reference", bn_statistics="whole batch", **rounding),
        row("resnet-tiny", "accum", "match", bn_statistics="per micro-batch",
            compared_with="single", test_loss_diff=0.03, **seeds),
        row("resnet-tiny", "1f1b", "diverged", bn_statistics="per micro-batch",
            compared_with="accum", test_loss_diff=0.03, **rounding),
    ]


def parity_run(root: Path) -> Path:
    """A parity run folder as ``python -m bench_lib parity`` writes it."""
    run_dir = root / RUN
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "env.json", env())
    pd.DataFrame(_epoch_rows(), columns=PARITY_COLUMNS).to_csv(run_dir / "parity.csv",
                                                               index=False)
    pd.DataFrame(_verdict_rows(), columns=PARITY_VERDICT_COLUMNS).to_csv(
        run_dir / "parity_verdicts.csv", index=False)
    return run_dir


@pytest.mark.integration
def test_parity_report_has_the_curves_and_the_verdicts(tmp_path):
    run_dir = parity_run(tmp_path)
    assert commands.main(["report", str(run_dir)]) == 0
    html = (run_dir / "report.html").read_text()
    (image,) = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert base64.b64decode(image) == (run_dir / "fig_parity.png").read_bytes()
    assert (run_dir / "fig_parity.png").read_bytes().startswith(b"\x89PNG")
    assert "http" not in html and "<script" not in html
    assert "3 of 4 judged strategies match; resnet-tiny 1f1b (diverged)" in html
    rows = re.findall(r"<tr( class=notok)?><td>([^<]+)</td><td>([^<]+)</td>", html)
    assert [(m, s, bool(bad)) for bad, m, s in rows] == [
        ("mlp", "single", False), ("mlp", "ddp", False), ("mlp", "gpipe", False),
        ("mlp", "dp", False), ("resnet-tiny", "single", False), ("resnet-tiny", "accum", False),
        ("resnet-tiny", "1f1b", True)]
    assert "dp needs CUDA devices" in html and "per micro-batch" in html
    assert "t x sqrt(2) x s over 3 seeds" in html  # each tolerance's own numbers


def test_parity_figure_draws_every_strategy_per_model(tmp_path):
    run = parity_report.read_parity(parity_run(tmp_path))
    fig = parity_report.fig_parity(run)
    assert fig is not None
    axes = fig.axes
    # 2 models x (train loss, test loss, test accuracy, difference, the row's legend)
    assert len(axes) == 10
    labels = {line.get_label() for line in axes[6].get_lines()}  # resnet-tiny's test loss
    assert {"single", "accum", "1f1b (diverged)", "single fp64",
            "single, other seeds"} <= labels
    mlp_test = {line.get_label(): list(line.get_ydata()) for line in axes[1].get_lines()}
    assert mlp_test["ddp"] == pytest.approx([0.6, 0.4, 0.2], abs=1e-7)
    # The difference panel: 1f1b against accum, each epoch, beside both tolerances.
    diff = {line.get_label(): list(line.get_ydata()) for line in axes[8].get_lines()}
    assert diff["1f1b"] == pytest.approx([0.09, 0.06, 0.03])
    assert diff["seeds tolerance"] == [0.08, 0.08] and diff["rounding tolerance"] == [2e-6] * 2
    legend = [t.get_text() for t in axes[9].get_legend().get_texts()]
    assert "1f1b (diverged)" in legend and "seeds tolerance" in legend


def test_a_parity_folder_is_reported_alone(tmp_path, capsys):
    run_dir = parity_run(tmp_path / "p")
    sweep = synthetic_run(tmp_path / "s")
    assert commands.main(["report", str(sweep), str(run_dir)]) == 2
    assert "reported on its own" in capsys.readouterr().err
    assert not (sweep / "report.html").exists()


def test_an_unfinished_parity_folder_exits_2(tmp_path, capsys):
    run_dir = parity_run(tmp_path)
    (run_dir / "parity_verdicts.csv").unlink()
    assert commands.main(["report", str(run_dir)]) == 2
    assert "the parity run did not finish" in capsys.readouterr().err
    assert not (run_dir / "report.html").exists()


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium "
                    "(apt-get install chromium; .ci/run installs it)")
@pytest.mark.integration
def test_parity_report_loads_in_a_browser_without_errors(tmp_path):
    html = build.write_report([parity_run(tmp_path)]).read_text()
    seen = probe(tmp_path, html)
    assert seen["images"] == 1 and seen["shown"] == 1, seen
    assert seen["errors"] == 0 and seen["console"] == [], seen
