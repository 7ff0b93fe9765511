"""The duty cycle (run/duty.py): where a run's wall time went, from hand-made launches."""

from __future__ import annotations

import json

import pytest

from bench_lib.run.duty import DUTY_FILE, DutyCycle, DutyMeter, write_duty


def test_parts_and_shares_from_hand_made_seconds():
    duty = DutyCycle(wall_s=100.0, timed_s=60.0, warmup_s=15.0, launches_wall_s=90.0,
                     launches=6)
    assert duty.duty_cycle == pytest.approx(0.60)
    assert duty.per_launch_s == pytest.approx(15.0)  # 90 - 60 - 15
    assert duty.per_run_s == pytest.approx(10.0)  # 100 - 90
    assert duty.fixed_s == pytest.approx(25.0)
    # The three parts add up to the wall time.
    assert duty.timed_s + duty.warmup_s + duty.fixed_s == pytest.approx(duty.wall_s)
    d = duty.as_dict()
    assert d["warmup_share"] == pytest.approx(0.15) and d["fixed_share"] == pytest.approx(0.25)
    assert DutyCycle.from_dict(json.loads(json.dumps(d))) == duty
    line = duty.text()
    assert line.startswith("duty cycle 60% of 100 s: timed steps 60 s; warm-up 15 s (15%)")
    assert "fixed 25 s (25%: per launch 15 s over 6 launches, per run 10 s)" in line


def test_the_meter_counts_each_launch():
    meter = DutyMeter()
    meter.add([0.5, 0.5, 1.0], warmup_time_s=1.5, wall_time_s=4.0)
    meter.add([1.0], warmup_time_s=0.5, wall_time_s=3.0)
    duty = meter.finish()
    assert (duty.timed_s, duty.warmup_s, duty.launches_wall_s, duty.launches) == (
        3.0, 2.0, 7.0, 2)
    assert duty.wall_s >= 0


def test_a_resumed_run_adds_its_sitting_to_the_file(tmp_path):
    first = DutyCycle(50.0, 30.0, 5.0, 40.0, 3)
    second = DutyCycle(20.0, 10.0, 2.0, 15.0, 1)
    assert write_duty(tmp_path, first) == first
    total = write_duty(tmp_path, second)
    assert total == DutyCycle(70.0, 40.0, 7.0, 55.0, 4)
    assert json.loads((tmp_path / DUTY_FILE).read_text())["launches"] == 4
