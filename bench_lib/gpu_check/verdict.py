"""The one verdict of a GPU check: trust this box's figures, or not and why (every problem
of the run folders, every failed test, every shard or collection that did not finish)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench_lib.gpu_check.shards import ShardResult


@dataclass(frozen=True)
class Verdict:
    """What the check found; ``tests`` is None where the suite was not run."""

    folder_problems: tuple[str, ...]
    folders: int
    tests: tuple[ShardResult, ...] | None = None
    collection_problems: tuple[str, ...] = ()
    """Test files pytest could not collect, or why it listed none."""
    tests_label: str = "the test suite with the GPU visible"
    """What ``tests`` ran, in the headline."""
    required_tests: int = 0
    """Tests that must have run, not skipped (the two-GPU tests: one per strategy)."""
    preflight: str | None = None
    """The pre-flight's failure ("" where it passed; None where none ran)."""

    @property
    def failed_tests(self) -> tuple[str, ...]:
        return tuple(t for r in self.tests or () for t in r.failed)

    @property
    def test_problems(self) -> tuple[str, ...]:
        """Collection errors, shards that did not finish, and GPU tests that did not see
        the GPU (torch without CUDA, or no device left to it)."""
        shards = self.tests or ()
        out = list(self.collection_problems)
        out += [f"{r.shard.describe()}: {r.problem} (log {r.log})" for r in shards if r.problem]
        gpu_skipped = sum(r.gpu_skipped for r in shards)
        if gpu_skipped:
            out.append(f"{gpu_skipped} GPU tests skipped: torch in the tests saw no GPU")
        ran = sum(r.passed + len(r.failed) for r in shards)
        if self.tests is not None and ran < self.required_tests:
            out.append(f"{ran} of the {self.required_tests} tests required ran (the rest "
                       "skipped or never started: did torch in the tests see too few GPUs?)")
        return tuple(out)

    @property
    def trusted(self) -> bool:
        return not (self.preflight or self.folder_problems or self.failed_tests
                    or self.test_problems)

    def lines(self) -> list[str]:
        """The verdict as printed: its headline, then what stands against trust."""
        plural = "s" * (self.folders != 1)
        checked = [] if self.preflight is None else ["the pre-flight"]
        if self.folders or not self.tests:
            checked.append(f"{self.folders} run folder{plural}")
        if self.tests is not None:
            passed = sum(r.passed for r in self.tests)
            skipped = sum(r.skipped for r in self.tests)
            checked.append(f"{self.tests_label} ({passed} passed, "
                           f"{len(self.failed_tests)} failed, {skipped} skipped, in "
                           f"{len(self.tests)} shard{'s' * (len(self.tests) != 1)})")
        else:
            checked.append("not the test suite")
        head = "TRUST" if self.trusted else "DO NOT TRUST"
        out = [f"verdict: {head} this box's figures (checked {'; '.join(checked)})"]
        out += _listed("problem", "in the pre-flight", (self.preflight,) if self.preflight
                       else ())
        out += _listed("problem", "in the run folders", self.folder_problems)
        out += _listed("test", "failed", self.failed_tests)
        out += _listed("problem", "running the tests", self.test_problems)
        return out


def _listed(noun: str, where: str, items: Sequence[str]) -> list[str]:
    if not items:
        return []
    return [f"  {len(items)} {noun}{'s' * (len(items) != 1)} {where}:",
            *(f"    {item}" for item in items)]
