"""INSTRUMENTS: code that touches a clock or a device and writes no file.

``timing`` (the whole timing rule), ``sampler``, ``flops`` (FLOPs counted), ``flop_peak``
(the rig's attainable FLOP peak), ``memory``, ``trace`` (the pipeline timeline's hooks),
``collectives`` (the collective micro-benchmark) and ``environment`` (what env.json
records). The arithmetic on what they read is ``bench_lib.analysis``'s; nothing here
imports the runner (``bench_lib.run``).
"""
