"""THE REPORT: figures, report.html and the end-of-run headlines, read from run folders only.

``runs`` (load_runs: the run folders read and checked), ``build`` (write_report),
``figures`` and ``device_figures`` (one Figure each), ``figure_kit`` (the parts and the
style they are drawn with), ``gantt`` (the pipeline timeline's bubble and Gantt chart),
``html`` (the page), ``row_values`` (a row's name, throughput and speedup), ``ranking`` (the
best case of a workload against its runner-up) and ``headlines`` (the table the CLI prints
after a run). Never imports torch, and never chooses a matplotlib backend or changes
rcParams outside its own drawing.
"""
