"""The package layout's promises, checked by importing: the readers of run folders, the
arithmetic and the commands that read files never import torch (tests/test_layering.py
checks the rules from the source)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import PYTHON, REPO

TORCH_FREE = [
    "bench_lib.report", "bench_lib.report.build", "bench_lib.report.figures",
    "bench_lib.report.device_figures", "bench_lib.report.gantt", "bench_lib.report.html",
    "bench_lib.report.headlines", "bench_lib.report.memory_prediction", "bench_lib.compare",
    "bench_lib.compare.verdicts", "bench_lib.compare.paired", "bench_lib.gate.job",
    "bench_lib.compare.output", "bench_lib.compare.baseline", "bench_lib.results",
    "bench_lib.results.schema", "bench_lib.results.read", "bench_lib.results.store",
    # the arithmetic the runner, the report and compare share
    "bench_lib.analysis", "bench_lib.analysis.bubble", "bench_lib.analysis.stats",
    "bench_lib.analysis.bound", "bench_lib.analysis.step_parts",
    "bench_lib.analysis.collective_fits",
]


@pytest.mark.integration
def test_report_compare_and_results_never_import_torch():
    code = (f"import {', '.join(TORCH_FREE)}; import sys; "
            "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not leaked, leaked")
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


PARSE_WITHOUT_TORCH = """\
import contextlib, io, sys
from bench_lib import commands
from bench_lib.commands import compare, merge, report
for argv in (["report", "r"], ["compare", "a", "b"], ["merge", "m"]):
    assert commands.build_parser(argv).parse_args(argv).command == argv[0]
    helped = [argv[0], "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        commands.build_parser(helped).parse_args(helped)
    assert "usage:" in out.getvalue(), argv
leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not leaked, leaked[:5]
"""


@pytest.mark.integration
def test_the_commands_that_read_files_parse_without_torch():
    """``bench_lib.commands``, the modules of ``report``, ``compare`` and ``merge``, and the
    parser built for each (its flags and ``--help``) import no torch: those commands skip
    its seconds of imports (``run``'s flags, which name strategies and models, are built
    for ``run`` alone)."""
    proc = subprocess.run([PYTHON, "-c", PARSE_WITHOUT_TORCH], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.integration
def test_compare_runs_without_torch():
    """The real entry point, end to end: ``python -m bench_lib compare`` of a run folder
    with itself imports no torch (``-X importtime`` names every module imported)."""
    run_dir = REPO / "tests" / "data" / "h100-2026-11-26" / "smoke-1gpu"
    proc = subprocess.run([PYTHON, "-X", "importtime", "-m", "bench_lib", "compare",
                           str(run_dir), str(run_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")]
    assert "bench_lib.compare.output" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


@pytest.mark.integration
def test_the_worker_starts_without_scipy():
    """Every launch imports the worker; scipy.stats alone added ~0.8 s to each on 2 cores.

    Only the runner and the readers compute t intervals (``stats.t_quantile`` imports scipy
    when first called); the interval itself still uses it there.
    """
    code = ("import bench_lib.launch.worker, sys; "
            "leaked = sorted(m for m in sys.modules if m.startswith('scipy')); "
            "assert not leaked, leaked; "
            "from bench_lib.analysis.stats import t_quantile; "
            "assert abs(t_quantile(0.95, 2) - 4.302653) < 1e-5")
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
