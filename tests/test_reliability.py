"""Faults, hangs, memory exhaustion, interrupts and bad input lose no results.

Faults are injected through the test-only PARABENCH_TEST_FAULT hook (bench_lib/launch/faults.py).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import psutil
import pytest

from bench_lib import commands
from bench_lib.prediction.kept_counts import CACHE_ENV
from bench_lib.results.read import run_dirs_in
from bench_lib.results.schema import SCHEMA_VERSION
from bench_lib.results.store import RunWriter, prepare_resume, write_json_atomic
from bench_lib.rig import Rig
from bench_lib.sweep.expansion import expand
from bench_lib.sweep.profile import Profile
from tests.conftest import PYTHON, REPO, in_process

# Pinned to the cpu rig (a GPU box would detect cuda): the memory cap's alloc fault grows host
# memory, which only a cpu rig's resident-memory cap stops.
TINY = ["--profile", "smoke", "--rig", "cpu", "--models", "resnet-tiny", "--image-sizes", "32",
        "--batch-sizes", "4", "--split-sizes", "2", "--warmup-steps", "1", "--timed-steps", "2",
        "--launches", "1"]


def start(out: Path, *args: str, fault: str = "") -> subprocess.Popen:
    # Every run counts its memory on fake tensors, none reads the counts an earlier one kept
    # (prediction.kept_counts): runs of one test take alike (a warm run was 15-20% shorter,
    # which put the Ctrl-C test's later interrupts past the sweep), and a Ctrl-C can land in
    # a count.
    env = dict(os.environ, PARABENCH_TEST_FAULT=fault, **{CACHE_ENV: ""})
    return subprocess.Popen([PYTHON, "-m", "bench_lib", "run", *TINY, *args, "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def only_run_dir(out: Path) -> Path:
    (run_dir,) = run_dirs_in(out)  # not its latest-run link
    return run_dir


def workers_of(run_dir: Path) -> list[psutil.Process]:
    """Live worker processes started for cases of ``run_dir``: those writing a case's
    worker.log in it (a rank forked by the fork server shows the server's command line)."""
    found = []
    for p in psutil.process_iter():
        try:
            files = p.open_files()
        except psutil.Error:
            continue
        if any(f.path.startswith(str(run_dir)) and f.path.endswith("worker.log")
               for f in files):
            found.append(p)
    return found


def left_behind(run_dir: Path, grace_s: float = 10.0) -> list[psutil.Process]:
    """``workers_of(run_dir)`` still alive after up to ``grace_s``: a runner killed with
    SIGKILL takes its ranks down through the parent-death chain (runner -> fork server ->
    rank), which the kernel runs a moment after the runner is reaped."""
    deadline = time.monotonic() + grace_s
    while (alive := workers_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def statuses(run_dir: Path) -> dict[str, str]:
    cases = pd.read_csv(run_dir / "cases.csv", keep_default_na=False)
    assert cases["case_id"].is_unique
    return dict(zip(cases.strategy, cases.status))


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_sigkilled_rank_is_an_error_row_and_the_sweep_goes_on(tmp_path):
    code, _, err = finish(start(tmp_path, "--strategies", "ddp,single",
                                fault="ddp:1:sigkill"))
    run_dir = only_run_dir(tmp_path)
    assert code == 1, err  # a failed case: exit 1, not a crash
    assert statuses(run_dir) == {"single": "ok", "ddp": "error"}
    reason = pd.read_csv(run_dir / "cases.csv").set_index("strategy").loc["ddp", "reason"]
    assert "rank 1 was killed by SIGKILL" in reason
    assert not workers_of(run_dir), "no process of the case may be left behind"


def _loopback_sockets_while_running(proc: subprocess.Popen, out: Path) -> list[str]:
    """The local addresses of the listening and connected inet sockets of the case workers of
    the run ``proc`` writes under ``out``, from the first moment they have any (polled until
    then, or until the run ends)."""
    bound: list[str] = []
    while proc.poll() is None and not bound:
        time.sleep(0.2)
        dirs = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
        for worker in workers_of(dirs[0]) if dirs else []:
            try:
                conns = worker.net_connections(kind="inet")
            except psutil.Error:
                continue
            bound += [c.laddr.ip for c in conns
                      if c.status in (psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED)]
    return bound


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_hung_rank_times_out_and_its_whole_group_is_killed_and_ranks_listen_on_loopback_only(
        tmp_path):
    proc = start(tmp_path, "--strategies", "ddp,mp", "--case-timeout-s", "12",
                 fault="ddp:1:hang")
    # While the ddp case is held open (rank 1 hangs after joining the group): a single-node
    # run's ranks listen and connect on loopback only.
    bound = _loopback_sockets_while_running(proc, tmp_path)
    code, _, err = finish(proc)
    assert bound, "the ranks never opened a socket"
    assert set(bound) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, bound
    run_dir = only_run_dir(tmp_path)
    assert code == 1, err
    assert statuses(run_dir) == {"ddp": "timeout", "mp": "ok"}
    assert not workers_of(run_dir)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault,rank,missing", [
    # Rank 1 blocks as its diagnostics start, as a rank waiting in an NCCL collective for a
    # peer does: both ranks give up at the diagnostic's time bound.
    ("ddp:1:diag-hang", 1, "rank 1: the compute-only steps did not finish within"),
    # Rank 0 runs out of memory there and exits; its peer, left in the compute-only steps'
    # collectives (no_sync still broadcasts BatchNorm buffers), fails there on gloo, and
    # would be stopped after the runner's grace period on NCCL.
    ("ddp:0:diag-oom", 0, "rank 0: out of memory in the compute-only steps after the timed "
                          "ones: PARABENCH_TEST_FAULT: simulated out of memory"),
], ids=["hang", "oom"])
@pytest.mark.integration
def test_a_rank_that_fails_in_its_diagnostics_keeps_the_case_and_its_steps(
        tmp_path, fault, rank, missing):
    began = time.monotonic()
    code, _, err = finish(start(tmp_path, "--strategies", "ddp", fault=fault))
    wall = time.monotonic() - began
    run_dir = only_run_dir(tmp_path)
    assert code == 0, err
    cases = pd.read_csv(run_dir / "cases.csv", keep_default_na=False).set_index("strategy")
    assert cases.loc["ddp", "status"] == "ok", cases.loc["ddp", "reason"]
    assert cases.loc["ddp", "timed_steps"] == 2 and cases.loc["ddp", "step_time_s_median"] > 0
    assert "diagnostics incomplete: " in cases.loc["ddp", "note"]
    assert missing in cases.loc["ddp", "note"], cases.loc["ddp", "note"]
    steps = pd.read_csv(run_dir / "steps.csv")
    assert set(steps["rank"]) == {0, 1} and (steps["step_time_s"] > 0).all()
    assert not workers_of(run_dir), "no process of the case may be left behind"
    # Ended by the diagnostic's bound or the peer's failure, not by the process group's
    # timeout (120 s), which waiting in the collective would have reached.
    assert wall < 90, wall


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_memory_cap_turns_a_runaway_case_into_an_oom_row(tmp_path):
    code, _, err = finish(start(tmp_path, "--strategies", "single,mp",
                                "--max-memory-per-device", "1.5GiB", fault="single:0:alloc"))
    run_dir = only_run_dir(tmp_path)
    assert code == 0, err  # oom is an expected outcome, not a failure of the suite
    assert statuses(run_dir) == {"single": "oom", "mp": "ok"}
    reason = pd.read_csv(run_dir / "cases.csv").set_index("strategy").loc["single", "reason"]
    assert "over the 1536 MiB cap" in reason
    assert not workers_of(run_dir)


def _wait_for_rows(run_dir_parent: Path, rows: int, timeout: float = 200) -> Path:
    """The run folder, once its cases.csv holds ``rows`` final rows (not provisional)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dirs = [p for p in run_dir_parent.iterdir() if p.is_dir() and not p.is_symlink()]
        if dirs and (dirs[0] / "cases.csv").exists():
            with (dirs[0] / "cases.csv").open(newline="") as f:
                final = [r for r in csv.DictReader(f) if not r.get("provisional")]
            if len(final) >= rows:
                return dirs[0]
        time.sleep(0.2)
    raise AssertionError(f"no {rows} rows within {timeout} s")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
@pytest.mark.integration
def test_interrupted_sweep_resumes_with_every_case_exactly_once(tmp_path, capsys, how):
    # Two workloads (image sizes), each launched in 2 rounds: a workload's rows are written
    # when its last round ends, so the run is cut in the second workload.
    proc = start(tmp_path, "--strategies", "single,ddp", "--image-sizes", "32,40",
                 "--launches", "2")
    run_dir = _wait_for_rows(tmp_path, 2)  # the first workload's two cases
    time.sleep(2)  # let the next workload get going, so it is cut mid-way
    proc.send_signal(how)
    code, _, err = finish(proc)
    if how == signal.SIGINT:
        assert code == 130, err
        assert "--resume" in err
    recorded = pd.read_csv(run_dir / "cases.csv", keep_default_na=False)
    done_before = recorded[recorded.provisional == ""]
    assert len(done_before) == 2, "the sweep was interrupted in its second workload"
    # The second workload's rows after its first round, if it got that far: provisional.
    assert set(recorded[recorded.provisional != ""].provisional) <= {"after round 1 of 2"}
    # Every CSV still parses, and holds only whole rows of finished cases.
    steps = pd.read_csv(run_dir / "steps.csv")
    assert set(steps.case_id) <= set(done_before.case_id)
    assert not left_behind(run_dir)

    resumed = in_process(capsys, "run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    cases = pd.read_csv(run_dir / "cases.csv", keep_default_na=False)
    assert sorted(cases.strategy) == ["ddp", "ddp", "single", "single"]
    assert cases.case_id.is_unique
    steps = pd.read_csv(run_dir / "steps.csv")
    ok = cases[cases.status == "ok"]
    assert set(steps.case_id) == set(ok.case_id)
    per_case = steps.groupby(["case_id", "launch", "rank"]).size()
    assert (per_case == 2).all(), "each launch's steps recorded exactly once"
    assert len(per_case) == 2 * (1 + 2) * 2  # 2 workloads x (single, 2 ddp ranks) x 2 launches
    # The resumed workload paired its speedups with its own single, round by round.
    assert (ok.speedup_ci_note == "").all() and (ok.launches == 2).all()


@pytest.mark.timeout(300)
@pytest.mark.integration
def test_two_concurrent_runs_do_not_collide(tmp_path):
    procs = [start(tmp_path, "--strategies", "ddp") for _ in range(2)]
    results = [finish(p) for p in procs]
    assert [r[0] for r in results] == [0, 0], [r[2] for r in results]
    dirs = run_dirs_in(tmp_path)
    assert len(dirs) == 2
    for d in dirs:
        assert statuses(d) == {"ddp": "ok"}


def test_resume_refuses_other_schema_versions_and_extra_flags(tmp_path, capsys):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    (run_dir / "env.json").write_text(json.dumps({"schema_version": 0}))
    (run_dir / "cases.csv").write_text("run_id,case_id\n")
    assert commands.main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "schema version 0" in err and f"reads version {SCHEMA_VERSION}" in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["cases.csv", "env.json"]
    assert commands.main(["run", "--resume", str(run_dir), "--strategies", "single"]) == 2
    assert "drop --strategies" in capsys.readouterr().err


def test_dry_run_lists_cases_and_an_estimate_and_writes_nothing(tmp_path, capsys):
    code = commands.main(["run", *TINY, "--dry-run", "--batch-sizes", "4,16", "--microbatches",
                     "2,8", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0
    assert "pipeline_resnet-tiny_img32_b4_s2_fp32" in out  # 2 micro-batches of 2
    assert "8 micro-batches do not fit in batch size 4" in out
    assert "dp needs CUDA" in out
    assert "estimated duration" in out
    assert not (tmp_path / "out").exists()


def _recorded_run(run_dir: Path) -> None:
    """A run folder as a real run leaves it: env.json, two cases with steps and samples."""
    rig = Rig("cpu", 2, 1, (0, 1))
    profile = Profile(strategies=("single", "ddp"), models=("resnet-tiny",), image_sizes=(32,),
                      batch_sizes=(4,))
    run_dir.mkdir()
    write_json_atomic(run_dir / "env.json", {"schema_version": SCHEMA_VERSION,
                                             "rig": rig.as_dict(), "profile": profile.as_dict()})
    with RunWriter(run_dir) as w:
        for case in expand(profile, rig):
            row = {"case_id": case.case_id, "strategy": case.strategy, "status": "ok",
                   "step_time_s_median": 0.1, "throughput_img_s": 40.0}
            w.write_case(row, steps=[{"rank": 0, "step": 0, "step_time_s": 0.1}],
                         samples=[{"time_unix_s": 1.0, "device": "0", "cpu_pct": 99.0}])


def _cut_header(run_dir: Path) -> None:
    path = run_dir / "cases.csv"
    path.write_bytes(path.read_bytes()[:300])  # the header alone is longer


def _no_case_id(run_dir: Path) -> None:
    path = run_dir / "cases.csv"
    path.write_text(path.read_text().replace("case_id", "case", 1))


@pytest.mark.parametrize("damage", [_cut_header, _no_case_id])
def test_resume_refuses_an_unreadable_run_folder_before_touching_it(tmp_path, capsys, damage):
    run_dir = tmp_path / "run"
    _recorded_run(run_dir)
    damage(run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    assert commands.main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot resume") and "nothing was changed" in err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_resume_of_an_undamaged_folder_keeps_every_recorded_row(tmp_path):
    run_dir = tmp_path / "run"
    _recorded_run(run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    assert prepare_resume(run_dir) == {"single_resnet-tiny_img32_b4_s-_fp32",
                                       "ddp_resnet-tiny_img32_b4_s-_fp32"}
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def _sigint_caught(pid: int) -> bool:
    """Whether process ``pid`` catches SIGINT yet (its interpreter has set a handler)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines()
                  if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGINT - 1) & 1)


def _interrupted_at(out: Path, delay_s: float
                    ) -> tuple[int, str, list[psutil.Process], float]:
    """A tiny run under ``out``, sent SIGINT ``delay_s`` after its interpreter catches it
    (unless it ended first): its exit code, its stderr, its processes that were alive then
    and still are, and its wall time."""
    started = time.monotonic()
    proc = start(out, "--strategies", "single,ddp")
    while not _sigint_caught(proc.pid) and proc.poll() is None:
        time.sleep(0.01)
    deadline = time.monotonic() + delay_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.returncode is not None:
        ended_s = time.monotonic() - started
        code, _, err = finish(proc)
        return code, err, [], ended_s
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)
    ended_s = time.monotonic() - started
    _, alive = psutil.wait_procs(family, timeout=10)
    return code, err, alive, ended_s


@pytest.mark.timeout(300)
@pytest.mark.slow  # 45-140 s on 2 cores: started first (conftest), not last
@pytest.mark.integration
def test_ctrl_c_at_any_moment_of_a_run_exits_130_or_0_never_by_a_signal(tmp_path, capsys):
    # Two whole tiny runs first, at once as the interrupted ones run: their wall time W
    # spaces nine interrupts over a run's life, at W/16, 3W/16, ..., 17W/16 (imports,
    # planning, the fork server, the run folder, each launch, the rows, the teardown, and
    # a run that may have ended). Before processes.interrupts, about half ended by SIGINT
    # (-2: a KeyboardInterrupt outside the sweep's handling, or one CPython marked
    # unhandled), a rare one by SIGABRT (-6: raised inside torch's C++, which
    # tests/test_interrupts.py provokes at will), and one went on with a half-imported numpy.
    # A run that was not interrupted (it ended first, or the interrupt came as it was
    # ending, which exits 0) sets W for the later ones: the machine can be far less busy
    # than while the whole runs ran (at the suite's start, beside its other slow tests:
    # twice as long in one suite run), and interrupts spaced over W of then would fall
    # past the sweep of most runs.
    started = time.monotonic()
    wholes = [start(tmp_path / f"whole{i}", "--strategies", "single,ddp") for i in range(2)]
    for code, _, err in map(finish, wholes):
        assert code == 0, err
    wall_s = time.monotonic() - started
    codes = []
    with ThreadPoolExecutor(2) as pool:  # two at a time, as on a loaded machine
        for pair in ((i, i + 1) if i < 8 else (i,) for i in range(0, 9, 2)):
            at = [(tmp_path / f"at{i}", wall_s * (i + 0.5) / 8) for i in pair]
            results = pool.map(lambda a: (a[1], *_interrupted_at(*a)), at)
            for delay, code, err, alive, ended_s in results:
                assert "terminate called" not in err, f"at {delay:.1f} s: {err[-2000:]}"
                assert code in (0, 130), f"at {delay:.1f} s: exit {code}\n{err[-2000:]}"
                assert code == 0 or "interrupted" in err, err[-2000:]
                assert not alive, f"at {delay:.1f} s: {alive} outlived the run"
                codes.append(code)
                if code == 0:
                    wall_s = min(wall_s, ended_s)
    assert codes.count(130) >= len(codes) // 2, codes  # most were interrupted, not done
    # The resume contract, on an interrupted run whose folder was started.
    started_dirs = [d for at in tmp_path.glob("at*") for d in run_dirs_in(at)
                    if (d / "env.json").exists() and not (d / "duty.json").exists()]
    assert started_dirs, "no interrupt fell in a sweep"
    for run_dir in started_dirs[:1]:
        resumed = in_process(capsys, "run", "--resume", str(run_dir))
        assert resumed.returncode == 0, resumed.stderr
        cases = pd.read_csv(run_dir / "cases.csv", keep_default_na=False)
        assert sorted(cases.strategy) == ["ddp", "single"] and cases.case_id.is_unique
