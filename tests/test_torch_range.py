"""The torch range pyproject.toml states (2.10 to the newest), held where the API differs.

The adapters (``strategies.schedules``: ``step``'s pre-split micro-batches, the warm-up
sends to a stage's own rank; ``strategies.ddp``: PowerSGD's CPU buckets) are checked here
on the torch that runs the tests, each branch on stand-ins of the other signature;
``make test-compat TORCH=X.Y.Z`` runs the tests marked ``compat`` (these, and each
strategy's one-case run, the schedules and fsdp against one device, a tiny parity run) on
the floor, on 2.11.0 and on the newest release, each in its own venv.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import pipelining as pp

from bench_lib import strategies
from bench_lib.results.read import read_cases, run_dirs_in
from bench_lib.strategies.schedules import skip_warmup_sends_to_self, step_arguments
from tests.conftest import in_process

pytestmark = pytest.mark.compat


def _new_step(*args, target=None, losses=None, return_outputs=True, arg_mbs=None,
              target_mbs=None, **kwargs):
    """torch 2.14's signature."""


def _old_step(*args, target=None, losses=None, return_outputs=True, **kwargs):
    """torch 2.10's signature: no pre-split micro-batches."""


def test_pre_split_micro_batches_where_step_takes_them():
    x, y = torch.arange(8.0).reshape(8, 1), torch.arange(8)
    args, kwargs = step_arguments(_new_step, x, y, 2)
    assert args == () and kwargs["return_outputs"] is False
    assert [mb[0].tolist() for mb in kwargs["arg_mbs"]] == [[[0.0], [1.0]], [[2.0], [3.0]],
                                                            [[4.0], [5.0]], [[6.0], [7.0]]]
    assert [t.tolist() for t in kwargs["target_mbs"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # A middle stage gets neither.
    assert step_arguments(_new_step, None, None, 2) == ((), {"return_outputs": False})


def test_the_whole_batch_where_step_splits_it_itself_into_the_same_micro_batches():
    x, y = torch.arange(8.0).reshape(8, 1), torch.arange(8)
    args, kwargs = step_arguments(_old_step, x, y, 2)
    assert kwargs == {"target": y, "return_outputs": False} and len(args) == 1 and args[0] is x
    # torch splits the whole batch with tensor_split into n_microbatches chunks: the very
    # micro-batches the pre-split path hands over, as the split divides the batch.
    pre_split = step_arguments(_new_step, x, y, 2)[1]["arg_mbs"]
    assert all(torch.equal(a, b[0]) for a, b in zip(torch.tensor_split(x, 4), pre_split))
    assert step_arguments(_old_step, None, None, 2) == ((), {"return_outputs": False})
    assert step_arguments(_old_step, x, None, 2) == ((x,), {"return_outputs": False})


def test_the_real_steps_signature_takes_one_of_the_two_paths():
    params = inspect.signature(pp.ScheduleGPipe.step).parameters
    assert "losses" in params and "target" in params  # every torch in the range
    args, kwargs = step_arguments(pp.ScheduleGPipe.step, torch.zeros(4, 1), torch.zeros(4), 2)
    assert ("arg_mbs" in kwargs) == ("arg_mbs" in params) and ("target" in kwargs) != (
        "arg_mbs" in params)


class _Stage:
    """A stage on rank 1 whose neighbours are on rank 0 and on rank 1 itself."""

    group_rank = 1

    def _get_init_p2p_neighbors_ops(self):
        # dist.P2POp's own constructor needs a process group: stand-ins with its field.
        return [SimpleNamespace(group_peer=0), SimpleNamespace(group_peer=1),
                SimpleNamespace(group_peer=1)]


def test_warm_up_messages_to_the_stages_own_rank_are_dropped():
    stage = _Stage()
    skip_warmup_sends_to_self(stage)  # type: ignore[arg-type]
    assert [op.group_peer for op in stage._get_init_p2p_neighbors_ops()] == [0]
    # torch 2.15's stages have no such method (they warm up by a vote): left as they are.
    bare = SimpleNamespace(group_rank=1)
    skip_warmup_sends_to_self(bare)  # type: ignore[arg-type]
    assert vars(bare) == {"group_rank": 1}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.integration
def test_the_smoke_sweep_runs_every_strategy_with_its_predictions(tmp_path, capsys):
    """The smoke profile on the cpu rig, every registered strategy, predicted before launch:
    every case ok, or unsupported for the reason its strategy states (dp needs CUDA)."""
    out = tmp_path / "out"
    proc = in_process(
        capsys, "run", "--profile", "smoke", "--rig", "cpu", "--devices", "2",
        "--strategies", ",".join(sorted(strategies.REGISTRY)), "--models", "resnet-tiny",
        "--image-sizes", "32", "--batch-sizes", "8", "--split-sizes", "2,4",
        "--timed-steps", "2", "--predict", "--quiet", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cases = read_cases(run_dirs_in(out)[0])
    assert set(cases.strategy) == set(strategies.REGISTRY)
    unsupported = cases[cases.status == "unsupported"]
    assert set(unsupported.strategy) == {"dp"}, unsupported.reason.tolist()
    ok = cases[cases.status == "ok"]
    assert len(ok) == len(cases) - 1, cases[cases.status != "ok"][["case_id", "reason"]]
    assert ok.step_time_s_predicted.notna().all() and ok.peak_mem_mib_predicted_max.notna().all()
    print(f"torch {torch.__version__}: {len(ok)} cases ok")
