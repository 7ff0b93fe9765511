"""The report: figures from files, failures drawn as such, bad folders refused, the notebook."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.container import BarContainer

from bench_lib import commands
from bench_lib.analysis.stats import launch_interval, paired_ratio_interval
from bench_lib.report import build, device_figures, figure_kit, figures
from bench_lib.report.runs import Runs, load_runs
from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.results.store import RunWriter, write_json_atomic
from tests.conftest import PYTHON, REPO
from tests.test_timeline import gpipe_events

BATCH = 16
# Hand-chosen median step times (s) per (strategy, split) at each image size.
STEP_S = {64: {("single", None): 0.80, ("ddp", None): 0.50, ("mp", None): 0.90,
               ("pipeline", 2): 0.70, ("pipeline", 4): 0.60, ("pipeline", 8): 0.75},
          128: {("single", None): 2.00, ("ddp", None): 1.25, ("mp", None): 2.10,
                ("pipeline", 2): 1.90, ("pipeline", 4): 1.80, ("pipeline", 8): 1.60}}
MEM = {"single": "0:800.0", "ddp": "0:700.0;1:350.0", "mp": "0+1:900.0", "pipeline": "0+1:950.0"}
# The gross figures include the runtime: the memory figure must draw the net ones.
GROSS = {"single": "0:1800.0", "ddp": "0:1700.0;1:1350.0", "mp": "0+1:1900.0",
         "pipeline": "0+1:1950.0"}
# Each case ran in 3 rounds of launches: round drift every case shares (it cancels in a ratio
# of the same round), times a small jitter of the case's own, rotated from case to case; both
# have geometric mean 1, so the case's median step time is the hand-chosen one.
DRIFT = (0.97, 1.0, 1 / 0.97)
JITTER = (1.0, 1.01, 1 / 1.01)


def launch_medians(step_s: float, k: int) -> list[float]:
    """The k-th case's launch medians, in round order, around ``step_s``."""
    return [step_s * d * JITTER[(r + k) % 3] for r, d in enumerate(DRIFT)]


def launch_columns(medians: list[float], batch: int = BATCH) -> dict:
    """The step-time columns as the runner makes them from the launch medians."""
    step = launch_interval(medians)
    nan = float("nan")
    return {"launches": len(medians), "launch_medians_s": ";".join(f"{m:.6g}" for m in medians),
            "step_time_s_median": step.point,
            "step_time_s_ci_low": nan if len(medians) < 2 else step.low,
            "step_time_s_ci_high": nan if len(medians) < 2 else step.high,
            "throughput_img_s": batch / step.point}


def env(torch_version: str = "2.14.1") -> dict:
    return {"schema_version": SCHEMA_VERSION, "rig": {"label": "cpu:2x1t", "kind": "cpu"},
            "device_names": ["cpu worker 0 (cores 0)", "cpu worker 1 (cores 1)"],
            "cpu_model": "Test CPU", "versions": {"torch": torch_version,
                                                  "torchvision": "0.29.1", "cuda": None},
            "git": {"sha": "abcdef0123", "dirty": False}}


def ok_row(strategy: str, image: int, split: int | None, medians: list[float]) -> dict:
    case_id = f"{strategy}_img{image}_s{split or '-'}"
    return {"case_id": case_id, "strategy": strategy, "model": "resnet50", "rig": "cpu:2x1t",
            "world_size": 1 if strategy == "single" else 2, "image_size": image,
            "batch_size": BATCH, "split_size": "" if split is None else split,
            "num_microbatches": BATCH // split if split else "", "precision": "fp32",
            "loss": "ce", "status": "ok", "timed_steps": 3 * len(medians),
            "steps_per_launch": ";".join("3" for _ in medians),
            **launch_columns(medians), "peak_mem_mib_max": 1950.0,
            "peak_mem_mib_by_device": GROSS[strategy], "peak_mem_net_mib_max": 950.0,
            "peak_mem_net_mib_by_device": MEM[strategy], "peak_mem_source": "vmhwm"}


def failed_row(strategy: str, image: int, split, status: str, reason: str) -> dict:
    return {"case_id": f"{strategy}_img{image}_s{split}", "strategy": strategy,
            "model": "resnet50", "rig": "cpu:2x1t", "world_size": 2, "image_size": image,
            "batch_size": BATCH, "split_size": split, "precision": "fp32", "loss": "ce",
            "status": status, "reason": reason}


def synthetic_run(root: Path, name: str = "20260101T000000Z_host_abcdef0", scale: float = 1.0,
                  samples: bool = True, timeline: bool = True) -> Path:
    """A run folder with hand-chosen numbers, written through the real RunWriter."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "env.json", env())
    with RunWriter(run_dir) as writer:
        for image, steps in STEP_S.items():
            single = launch_medians(steps[("single", None)] * scale, 0)
            for k, ((strategy, split), step_s) in enumerate(steps.items()):
                medians = launch_medians(step_s * scale, k)
                row = ok_row(strategy, image, split, medians)
                # Filled as the runner fills them (rows.speedup_table.SpeedupTable): single runs
                # first, the speedup paired with it by round.
                speedup = paired_ratio_interval(single, medians)
                row |= {"speedup_vs_single": speedup.point, "speedup_ci_low": speedup.low,
                        "speedup_ci_high": speedup.high,
                        "scaling_efficiency": speedup.point / row["world_size"]}
                events = gpipe_events(2, BATCH // (split or BATCH), 0.01)
                ticks = [{"time_unix_s": 1e9 + t / 10, "device": d, "cpu_pct": 50.0 + t,
                          "rss_mib": 100.0 * t} for t in range(5) for d in ("0", "1")]
                writer.write_case(
                    row, [{"launch": r, "rank": 0, "step": i, "step_time_s": m}
                          for r, m in enumerate(medians) for i in range(3)],
                    timeline=events.to_dict("records") if split and timeline
                    else (), samples=ticks if samples else ())
            writer.write_case(failed_row("dp", image, "", "unsupported", "dp needs CUDA"))
            writer.write_case(failed_row("pipeline", image, 32, "skipped",
                                         "split size 32 is larger than batch 16"))
    return run_dir


def load(*dirs: Path) -> Runs:
    return load_runs(list(dirs))


def test_speedup_and_efficiency_computed_from_the_files(tmp_path):
    cases = load(synthetic_run(tmp_path)).cases.set_index("case_id")
    assert cases.loc["ddp_img64_s-", "speedup_vs_single"] == pytest.approx(0.80 / 0.50)
    assert cases.loc["ddp_img64_s-", "scaling_efficiency"] == pytest.approx(0.8)
    assert cases.loc["pipeline_img128_s8", "speedup_vs_single"] == pytest.approx(2.0 / 1.6)
    assert pd.isna(cases.loc["dp_img64_s", "speedup_vs_single"])


def hatched(fig) -> list:
    return [p for ax in fig.axes for p in ax.patches if p.get_hatch()]


def test_failed_cases_are_hatched_bars_not_missing_bars(tmp_path):
    cases = load(synthetic_run(tmp_path)).cases
    for draw in (figures.fig_throughput, device_figures.fig_memory, figures.fig_scaling):
        fig = draw(cases)
        # One representative per strategy: dp (unsupported) in each of the 2 image sizes.
        assert len(hatched(fig)) == 2, draw.__name__
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert texts.count("unsupported") == 2
        plt.close(fig)


def test_split_tradeoff_stars_the_optimum_and_crosses_the_skipped(tmp_path):
    fig = figures.fig_split_tradeoff(load(synthetic_run(tmp_path)).cases)
    stars = {ax.get_title(): line.get_xdata()[0] for ax in fig.axes for line in ax.lines
             if line.get_marker() == "*"}
    assert stars == {"resnet50 · 64 px · batch 16 · fp32": 4,
                     "resnet50 · 128 px · batch 16 · fp32": 8}
    crosses = [line for ax in fig.axes for line in ax.lines if line.get_marker() == "x"]
    assert [c.get_xdata()[0] for c in crosses] == [32, 32]
    plt.close(fig)


def test_winner_grid_names_the_winner_and_its_speedup(tmp_path):
    fig = figures.fig_winner_grid(load(synthetic_run(tmp_path)).cases)
    texts = [t.get_text() for t in fig.axes[0].texts]
    # ddp (1.60x at both sizes) wins every cell: splits 2, 4, 8 and the skipped 32, clear of
    # the runner-up; its speedup's 95% interval, paired with single by round.
    assert texts.count("ddp\n1.60x\n[1.53, 1.67]") == 8
    assert texts.count("best pipeline split") == 2
    assert "paired by round" in fig.get_suptitle() and "rough range" not in fig.get_suptitle()
    plt.close(fig)


def relaunch(cases: pd.DataFrame, case_id: str, medians: list[float]) -> None:
    """Give a case other launch medians, and the figures the runner makes from them (its
    speedup interval dropped: not what these tests read, and none with 1 launch)."""
    sel = cases.case_id == case_id
    for col, value in launch_columns(medians).items():
        cases.loc[sel, col] = value
    cases.loc[sel, ["speedup_ci_low", "speedup_ci_high"]] = float("nan")


@pytest.mark.integration
def test_winner_grid_marks_a_tie_and_a_missing_interval(tmp_path):
    cases = load(synthetic_run(tmp_path)).cases
    ddp128 = launch_medians(1.25, 1)
    # 128 px, split 8: the pipeline within 2% of ddp, ahead in one round of three: a tie.
    relaunch(cases, "pipeline_img128_s8", [m * f for m, f in zip(ddp128, [1.04, 0.99, 1.03],
                                                                  strict=True)])
    # 128 px, split 4: 4-5% behind ddp in every round: clear, though their intervals overlap.
    relaunch(cases, "pipeline_img128_s4", [m * f for m, f in zip(ddp128, [1.04, 1.05, 1.045],
                                                                  strict=True)])
    row = cases.set_index("case_id").loc
    assert row["ddp_img128_s-", "step_time_s_ci_high"] > row["pipeline_img128_s4",
                                                             "step_time_s_ci_low"]
    # 64 px: ddp ran 1 launch, so no interval: no pairing, no winner claimed.
    relaunch(cases, "ddp_img64_s-", [0.5])
    fig = figures.fig_winner_grid(cases)
    texts = [t.get_text() for t in fig.axes[0].texts]
    ties = [t for t in texts if t.startswith("tie:")]
    assert ties == ["tie: ddp\n~ pipeline s8\n1.60x\n[1.53, 1.67]"]  # split 8 at 128 px
    assert texts.count("ddp\n1.60x\n[1.53, 1.67]") == 3  # 128 px: splits 2, 4 and 32
    assert texts.count("ddp\n1.60x\n(no interval)") == 4  # 64 px: no winner claimed
    plt.close(fig)
    from bench_lib.report.html import _headlines

    heads = _headlines(cases)
    assert "<span class=best>tie:</span> ddp 12.8 [12.0, 13.7] images/s ~ pipeline s8 12.6 " \
        "[11.4, 13.9] (paired 1.02x [0.96, 1.09]); 1.60x [1.53, 1.67] vs single (2 of" in heads
    assert "<span class=best>best (no interval):</span> ddp 32.0 images/s vs pipeline s4 26.7 " \
        "[24.9, 28.5]; 1.60x vs single (2 of" in heads
    assert "95% t interval across 3 launches" in heads and "rough range" not in heads
    html = build.write_report([synthetic_run(tmp_path, "other")]).read_text()
    assert "<span class=best>ddp</span> 32.0 [29.9, 34.2] images/s &gt; pipeline s4 26.7 " \
        "[24.9, 28.5] (paired 1.20x [1.20, 1.20]); 1.60x [1.53, 1.67] vs single" in html
    # The cases table: the launches, and the speedup's interval (none for single itself).
    assert "<th>launches</th>" in html and "<th>speedup 95% CI</th>" in html
    assert ("<td class=status>ok</td><td class=num>3</td><td class=num>0.5000</td><td "
            "class=num>0.4677–0.5346</td><td class=num>32.0</td><td class=num>1.60</td><td "
            "class=num>1.53–1.67</td>") in html
    assert "<td class=num>1.00</td><td class=num></td>" in html  # single


def bars_with_error_bars(ax) -> list[bool]:
    """Per bar drawn, in order: does it carry an error bar?"""
    return [c.errorbar is not None for c in ax.containers if isinstance(c, BarContainer)]


def test_error_bars_come_from_the_launches_and_a_single_launch_has_none(tmp_path):
    cases = load(synthetic_run(tmp_path)).cases
    relaunch(cases, "ddp_img64_s-", [0.5])  # 1 launch: no interval of its own or its speedup
    relaunch(cases, "pipeline_img64_s8", [0.75])
    fig = figures.fig_throughput(cases)
    # single, dp (unsupported: hatched), ddp (1 launch), mp, pipeline
    assert bars_with_error_bars(fig.axes[0]) == [True, False, False, True, True]
    assert bars_with_error_bars(fig.axes[1]) == [True, False, True, True, True]
    plt.close(fig)
    fig = figures.fig_scaling(cases)
    assert bars_with_error_bars(fig.axes[0]) == [False, False, True, True]
    assert bars_with_error_bars(fig.axes[1]) == [False, True, True, True]
    # ddp at 128 px: its speedup's interval over its 2 devices
    ddp = next(c for c in fig.axes[1].containers if isinstance(c, BarContainer)
               and c.errorbar is not None)
    (low, high), = [(seg[0][1], seg[1][1]) for seg in ddp.errorbar.lines[2][0].get_segments()]
    row = cases.set_index("case_id").loc["ddp_img128_s-"]
    assert (low, high) == pytest.approx((row.speedup_ci_low / 2, row.speedup_ci_high / 2))
    assert "95% CI" in fig.get_suptitle()
    plt.close(fig)
    fig = figures.fig_split_tradeoff(cases)  # a 1-launch split draws its point, no bar
    assert fig is not None
    plt.close(fig)


def test_memory_bars_show_each_device(tmp_path):
    fig = device_figures.fig_memory(load(synthetic_run(tmp_path)).cases)
    heights = sorted(p.get_height() for p in fig.axes[0].patches if not p.get_hatch())
    assert heights == [350.0, 700.0, 800.0, 900.0, 950.0]
    assert any(t.get_text().endswith("\n2.00x") for t in fig.axes[0].get_xticklabels())
    assert "max over min" in fig.get_suptitle()
    plt.close(fig)


@pytest.mark.integration
def test_report_html_is_self_contained_with_every_figure(tmp_path):
    run_dir = synthetic_run(tmp_path)
    path = build.write_report([run_dir])
    assert path == run_dir / "report.html"
    html = path.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 7
    for data in images:
        assert base64.b64decode(data).startswith(b"\x89PNG")
    assert sorted(p.name for p in run_dir.glob("fig*.png")) == [
        "fig1_throughput.png", "fig2_split_tradeoff.png", "fig3_winner_grid.png",
        "fig4_memory.png", "fig5_samples.png", "fig6_timeline.png", "fig7_scaling.png"]
    assert "http" not in html.replace("http-equiv", "") and "<script" not in html
    assert "dp needs CUDA" in html and "split size 32 is larger than batch 16" in html
    assert "torch 2.14.1" in html and "Test CPU" in html
    assert "20.0%" in html  # theoretical bubble of S=2, M=4 beside the measured one


@pytest.mark.integration
def test_missing_samples_and_timeline_say_not_measured(tmp_path):
    run_dir = synthetic_run(tmp_path, samples=False, timeline=False)
    html = build.write_report([run_dir]).read_text()
    assert html.count("not measured in this run") == 2
    assert not (run_dir / "fig5_samples.png").exists()
    assert not (run_dir / "fig6_timeline.png").exists()


@pytest.mark.integration
def test_two_runs_side_by_side(tmp_path):
    a = synthetic_run(tmp_path, "20260101T000000Z_boxa_abcdef0")
    b = synthetic_run(tmp_path, "20260102T000000Z_boxb_abcdef0", scale=0.5)
    runs = load(a, b)
    fig = figures.fig_throughput(runs.cases)
    assert runs.names == {"A": a.name, "B": b.name}
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["A", "B"]
    # Each strategy has a bar per run: B ran twice as fast, so twice the throughput.
    bars = sorted((p.get_x(), p.get_height()) for p in fig.axes[0].patches if not p.get_hatch())
    assert [round(h2 / h1, 6) for (_, h1), (_, h2) in zip(bars[::2], bars[1::2],
                                                          strict=True)] == [2.0] * 4
    plt.close(fig)
    html = build.write_report([a, b]).read_text()
    assert f"A = {a.name}" in html and f"B = {b.name}" in html
    assert not (b / "report.html").exists()  # written into the first run folder only


def test_run_where_nothing_ran_still_gets_a_report(tmp_path):
    run_dir = tmp_path / "20260101T000000Z_host_abcdef0"
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", env())
    with RunWriter(run_dir) as writer:
        writer.write_case(failed_row("dp", 64, "", "unsupported", "dp needs CUDA"))
        writer.write_case(failed_row("pipeline", 64, 4, "oom", "rank 0: out of memory"))
        writer.write_case(failed_row("ddp", 64, "", "timeout", "still running after 300 s"))
    runs = load(run_dir)
    fig = figures.fig_throughput(runs.cases)
    assert len(hatched(fig)) == 3  # every case is there, as a hatched bar
    plt.close(fig)
    html = build.write_report([run_dir]).read_text()
    for reason in ("dp needs CUDA", "rank 0: out of memory", "still running after 300 s"):
        assert reason in html
    assert "no case ran" in html


# Run in a fresh interpreter that picked its own backend and style, as a notebook does.
KEEPS_MATPLOTLIB = """
import sys
from pathlib import Path

import matplotlib

matplotlib.use("svg")
matplotlib.rcParams["axes.grid"] = False
matplotlib.rcParams["figure.dpi"] = 72.0
before = dict(matplotlib.rcParams)

from bench_lib.report import build, device_figures, figures, gantt, headlines, html  # noqa

assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert dict(matplotlib.rcParams) == before, "importing the report changed rcParams"
path = build.write_report([Path(sys.argv[1])])
assert path.exists()
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
changed = {k for k, v in matplotlib.rcParams.items() if before[k] != v}
assert not changed, f"writing a report changed rcParams {sorted(changed)}"
assert matplotlib.rcParams["axes.grid"] is False and matplotlib.rcParams["figure.dpi"] == 72.0
assert "matplotlib.pyplot" not in sys.modules, "the report went through pyplot"
"""


@pytest.mark.integration
def test_report_leaves_the_callers_matplotlib_backend_and_style_alone(tmp_path):
    run_dir = synthetic_run(tmp_path)
    proc = subprocess.run([PYTHON, "-c", KEEPS_MATPLOTLIB, str(run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(list(run_dir.glob("fig*.png"))) == 7


def test_figures_are_drawn_in_the_report_style_without_keeping_it(tmp_path):
    import matplotlib

    cases = load(synthetic_run(tmp_path)).cases
    with matplotlib.rc_context({"axes.grid": False, "figure.dpi": 72.0}):
        fig = figures.fig_throughput(cases)
        assert matplotlib.rcParams["axes.grid"] is False
        assert matplotlib.rcParams["figure.dpi"] == 72.0
    assert fig.dpi == figure_kit.STYLE["figure.dpi"]
    ax = fig.axes[0]
    assert not ax.spines["top"].get_visible() and ax.spines["left"].get_visible()
    assert any(line.get_visible() for line in ax.yaxis.get_gridlines())


@pytest.mark.integration
def test_cli_report_prints_the_path(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path)
    assert commands.main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")


def _truncate(run_dir: Path) -> None:
    data = (run_dir / "cases.csv").read_bytes()
    (run_dir / "cases.csv").write_bytes(data[:-40])


def _ragged(run_dir: Path) -> None:
    lines = (run_dir / "cases.csv").read_text().splitlines(keepends=True)
    lines[2] = ",".join(lines[2].split(",")[:10]) + "\n"
    (run_dir / "cases.csv").write_text("".join(lines))


def _word_in_number(run_dir: Path) -> None:
    df = pd.read_csv(run_dir / "cases.csv", dtype=str, keep_default_na=False)
    df.loc[0, "step_time_s_median"] = "fast"
    df.to_csv(run_dir / "cases.csv", index=False)


def _no_case(run_dir: Path) -> None:
    header = (run_dir / "cases.csv").read_text().splitlines(keepends=True)[0]
    (run_dir / "cases.csv").write_text(header)


def _old_schema(run_dir: Path) -> None:
    data = json.loads((run_dir / "env.json").read_text())
    (run_dir / "env.json").write_text(json.dumps(data | {"schema_version": 0}))


@pytest.mark.parametrize("spoil,message", [
    (None, "is not a folder"), (_truncate, "truncated"), (_ragged, "fields, the header"),
    (_word_in_number, "column step_time_s_median holds 'fast'"),
    (_old_schema, "schema version 0"), (_no_case, "holds no case yet"),
])
def test_unusable_run_folder_exits_2_and_writes_nothing(tmp_path, capsys, spoil, message):
    run_dir = tmp_path / "missing"
    if spoil is not None:
        run_dir = synthetic_run(tmp_path)
        spoil(run_dir)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert commands.main(["report", str(run_dir)]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_notebook_runs_against_a_run_folder(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    run_dir = synthetic_run(tmp_path)
    nb = nbformat.read(REPO / "notebooks" / "analysis.ipynb", as_version=4)
    nb.cells[0].source = re.sub(r"RUN_DIR = .*", f"RUN_DIR = {str(run_dir)!r}",
                                nb.cells[0].source)
    nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 7  # every figure, drawn inline


def test_the_samples_figure_draws_a_cases_first_launch_not_a_line_across_the_others(tmp_path):
    # Three launches 100 s apart (other cases ran between): the first one only is drawn.
    ticks = [{"time_unix_s": 1e9 + start + t / 10, "device": d, "cpu_pct": 90.0,
              "rss_mib": 10.0, "case_key": "k"}
             for start in (0, 100, 200) for t in range(20) for d in ("0", "1")]
    samples = pd.DataFrame(ticks)
    first, launches = device_figures.first_launch(samples, "time_unix_s")
    assert launches == 3 and len(first) == 40
    assert first.time_unix_s.max() - first.time_unix_s.min() == pytest.approx(1.9)
    assert device_figures.first_launch(samples.iloc[:0], "time_unix_s")[1] == 0
    # A sampler ticking every 5 s: its ticks are not launches.
    slow = samples.assign(time_unix_s=1e9 + 5.0 * samples.index // 2)
    assert device_figures.first_launch(slow, "time_unix_s")[1] == 1
    runs = load(synthetic_run(tmp_path))
    keys = runs.samples.case_key.unique()
    later = runs.samples.assign(time_unix_s=runs.samples.time_unix_s + 100)
    fig = device_figures.fig_samples(runs.swept, pd.concat([runs.samples, later]))
    assert all(ax.get_title().endswith("launch 1 of 2") for ax in fig.axes[:len(keys)]
               if ax.get_title())
    assert max(max(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()) < 1
    plt.close(fig)
