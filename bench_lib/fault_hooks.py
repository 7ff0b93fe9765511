"""The environment variables of the hooks a test sets to bend a run (``bench_lib.launch.faults``:
an injected fault or slowdown; ``measure.flop_peak``: a quick FLOP probe). A run made with one
set is not a real measurement, and env.json says so: its ``test_hooks`` field (the results
schema's name, which old run folders carry) records the ones set (``measure.environment``).
Torch-free and outside the instruments, so that the readers (``compare``) can name them."""

TEST_FAULT_ENV = "PARABENCH_TEST_FAULT"
INJECT_SLOWDOWN_ENV = "PARABENCH_INJECT_SLOWDOWN"
QUICK_PEAK_ENV = "PARABENCH_TEST_QUICK_PEAK"
"""TEST-ONLY: set (to anything) in the test suite's environment, the FLOP peak probe runs for
``flop_peak.QUICK_PEAK_MIN_TIME_S`` instead of ``PEAK_MIN_TIME_S``: a test's run reads no MFU
anyone bets on, and the suite's ~45 runs each paid ~5 CPU-seconds of probing."""
TEST_HOOK_VARIABLES = (INJECT_SLOWDOWN_ENV, TEST_FAULT_ENV, QUICK_PEAK_ENV)
