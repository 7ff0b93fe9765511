"""``gate``: base and head measured in the same job on this machine, judged round by round.

``compare`` judges a run against a stored baseline, which must come from the same hardware:
on a runner that changes CPU kind from one job to the next it has nothing to compare with,
and between jobs the spread is many times that within one. ``gate`` measures both sides
here and now instead:

* **Sides.** The base is a commit (``--base REF``); the head another (``--head REF``) or, by
  default, the working tree as it is when the gate starts: a commit object is made of it
  (tracked changes and the untracked files git does not ignore, through a temporary index:
  the branch, index and stash are left alone), so edits made while the gate runs are not
  measured. Each side is checked out into its own git worktree in a temporary folder and
  run by this same Python with ``PYTHONPATH`` at that worktree: torch and every other
  package are the same on both sides, only the code differs (and ``--head-env``, which sets
  environment variables on the head's side only: with the base equal to the head it compares
  settings, an allocator or thread variable, and it is how the error-rate demonstration
  plants a slowdown through the test-only ``PARABENCH_INJECT_SLOWDOWN``). The test hooks are
  removed from both sides' environment otherwise.
* **Refusals** (exit 2, before anything is measured): a REF that names no commit; a folder
  that is no git checkout; a working tree with unmerged files (a merge or rebase half done:
  no one version of it to measure); a side whose ``bench_lib`` cannot be imported from its
  own worktree, whose results schema is not this gate's (it could not read what that side
  writes), or whose ``run`` refuses the sweep (a dry run of it on each side first); a
  malformed ``--head-env``; run flags the gate sets itself.
* **Rounds.** ``--rounds`` R (default 5). In each round each side runs the sweep once
  (``run --launches 1``: every case launched once, in fresh processes; 2 warm-up and 6
  timed steps unless the run flags say otherwise, ``DEFAULT_STEPS``). Where both sides can
  (``bench_lib.TAKES_TURNS``) and ``--apart`` is not given, both at once, each case's ranks
  taking turns step by step with the other side's on the same devices (``bench_lib.turns``,
  ``rounds``): each pair of steps meets the machine in the same second. Otherwise base then
  head in even rounds and head then base in odd ones (B H | H B | B H | ...: ABBA), so that
  a linear drift, and a co-runner that lasts about a round, hit both sides alike.
* **The verdict.** Taking turns, per case: the log ratio head over base of each pair of
  steps (the k-th timed step of each side, after the same fixed warm-up, so that the two
  ran one right after the other; a step's time its slowest rank's), every round's pairs
  pooled: the change is their Hodges-Lehmann estimate less 1 (+ is slower), its interval
  the signed-rank interval (``analysis.stats.pair_rounds_interval``); where a
  Kruskal-Wallis test tells the rounds apart (p < 0.25), the rounds are the units as
  apart. Apart, per round r, head_r / base_r of the two launch medians (over the speed
  probe where both timed it): the change is their geometric mean over the rounds less 1,
  its interval the t interval over rounds (``paired_ratio_interval``: R - 1 degrees of
  freedom). What a round shares, the machine's state, cancels in each ratio;
  what remains is launch-to-launch and step-to-step noise. The
  rule is ``compare``'s: a regression only beyond ``--threshold-pct`` AND with the interval
  wholly above 0 (improvement likewise), the exit codes 0, 1 (a regression, or a case
  that ran in the base and failed in the head) and 2. Every case is judged on its step
  time (``--metric step_time``); in the same job, pairing does what the ``speedup``
  metric does for runs made apart. ``--metric speedup`` (or ``auto``: speedup for all
  but ``single``) judges each case on its time over its round's ``single``, paired the same.
* **Threshold.** 2.5% by default (``compare``'s is 10%). Taking turns on 2 Intel Xeon
  cores, a pair's log ratio spread 3-7% (robust SD) and the deciding intervals' median
  half-width was 2.3-2.6% (5 rounds of 6 pairs); over 24 gates the A/A cases' estimates
  spread 0.97% (SD): an unchanged case reads over 2.5% about 0.5% of the time, a case
  slowed by 3% more often than not. ``benchmarks/same_job_gate.py`` measures the
  false-alarm and detection rates (docs/ci-gate.md).
* **Output.** ``--out`` (default ``results/gates``) receives a gate folder: each round's
  run folders (``base/round-1/<run>``, ...), ``gate.json`` (sides, order, per-case
  verdicts, durations) and ``gate.md`` (the pull-request comment); ``--markdown`` and
  ``--json`` (github-action-benchmark's ``customBiggerIsBetter``) as in ``compare``. A
  gate that fails or is interrupted removes its folder; the worktrees always go.

The modules, by job: ``plan`` (``GatePlan``, the flags' values, and the refusals that need
nothing but them), ``worktrees`` (git: the working tree's commit, each side's worktree),
``sides`` (a side, its environment, its checks and its runs, each a ``python -m bench_lib
run`` in its own process), ``rounds`` (the ABBA order, the measuring, a side's reused
calibration) and ``job`` (the whole command: refuse, prepare, measure, judge, write). The
verdicts, read from the rounds' run folders, are ``bench_lib.compare.paired``. Never
imports torch: each side's ``run`` does, in its own process.
"""
