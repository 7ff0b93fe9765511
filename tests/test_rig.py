"""Rig detection, validation and CPU pinning."""

import os

import pytest
import torch

from bench_lib.pinning import pin_worker
from bench_lib.rig import Rig, RigError
from bench_lib.rig_detection import detect_rig
from bench_lib.topology import read_cpu_topology


def test_cpu_rig_defaults_and_cores():
    rig = detect_rig("cpu")
    assert rig.kind == "cpu" and 1 <= rig.num_devices <= 2
    assert rig.devices() == [torch.device("cpu")] * rig.num_devices
    owned = [c for i in range(rig.num_devices) for c in rig.cores_of(i)]
    assert len(owned) == len(set(owned)), "workers never share a core"


def test_rig_labels_and_round_trip():
    rig = Rig("cpu", 2, 1, (0, 1))
    assert rig.label == "cpu:2x1t"
    assert rig.cores_of(1) == [1]
    assert Rig.from_dict(rig.as_dict()) == rig


def test_too_many_devices_is_refused_with_the_count():
    n = len(read_cpu_topology().cores)  # physical cores: workers never share one
    with pytest.raises(RigError, match=f"this cpu rig has {n} physical core"):
        detect_rig("cpu", num_devices=n + 1)
    with pytest.raises(RigError, match="needs 4 cores"):
        Rig("cpu", 2, 2, (0, 1))
    with pytest.raises(RigError, match="unknown rig kind 'tpu'"):
        Rig("tpu", 1)


def test_cuda_rig_without_gpu_is_refused(visible_gpus):
    visible_gpus(0)  # the no-GPU message, on every machine (a GPU box skipped it)
    with pytest.raises(RigError, match="no CUDA GPU"):
        detect_rig("cuda")
    assert detect_rig().kind == "cpu"  # and the default is the cpu rig
    visible_gpus(1)
    assert detect_rig().kind == "cuda" and detect_rig("cpu").kind == "cpu"


def test_pin_worker_sets_affinity_and_threads():
    before = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before[0])
    try:
        pin_worker(Rig("cpu", 1, 1, (core,)), 0)
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
        # A process driving both devices (mp, pipeline) is pinned like single: worker 0's.
        cores = sorted(before[0])
        if len(cores) >= 2:
            pin_worker(Rig("cpu", 2, 1, tuple(cores[:2])), 0)
            assert os.sched_getaffinity(0) == {cores[0]}
    finally:
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])


@pytest.mark.gpu
def test_cuda_rig_names_its_gpus():
    rig = detect_rig("cuda")
    assert rig.devices()[0] == torch.device("cuda", 0)
    assert all(rig.device_names())
