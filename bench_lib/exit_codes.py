"""The exit codes of ``python -m bench_lib``'s commands, defined once: every command returns
one of these, ``--help`` lists them (``commands.parser.EXIT_CODES``), and a command that
ends with another's check returns that check's code (``run --compare-to``: the gate's).

A worker process's exit code is another protocol, from a worker to the runner that reads
it, and stays with the workers: ``launch.worker`` (``EXIT_FAILED``, ``EXIT_DIAGNOSTIC_FAILED``),
``processes.lifeline`` (``EXIT_ORPHANED``). Torch-free, and imports nothing of ours.
"""

EXIT_OK = 0
"""Success: ``run``, every case ended without an error or timeout (an ``oom``, ``skipped``
or ``unsupported`` row is an answer, not a failure); ``compare``, ``gate``, no regression;
``tune``, a recommendation; ``parity``, every strategy ends where its mathematics does;
``distance``, every case ran and agrees with the reference; any other command, done."""
EXIT_NOT_OK = 1
"""The command ran and its answer is no: ``run``, a case failed (``error``, ``timeout``),
or a node other than node 0 lost node 0; ``compare``, ``gate`` (and ``run --compare-to``),
a regression or a case that broke; ``tune``, no candidate measured ok; ``parity``, a
strategy diverged or failed; ``distance``, a case failed or disagrees."""
EXIT_USAGE = 2
"""Bad input, nothing run or written: a value no case can use, an unknown name, a results
folder that cannot be read (``commands.main``); runs that cannot be compared (``compare``,
``gate``), or a gate side that could not be measured."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C, any command, or SIGTERM where the command catches it: ``run``,
``tune``, ``gate``; 128 + SIGINT, as a shell reports it): ``run`` keeps its finished cases
(``run --resume RUN_DIR`` finishes it), ``tune`` its launches so far in tune.csv; ``gate``
keeps nothing."""
