from bench_lib.cli import main
from bench_lib.run.lifeline import exit_lightly

exit_lightly(main())
