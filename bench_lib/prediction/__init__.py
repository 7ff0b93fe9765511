"""THE PREDICTION: a case's step time and peak memory, worked out before it runs.

docs/prediction.md is its page. Time: a workload's calibration (``calibration``, its
launch; ``calibration_worker``, the process; ``calibration_timing``, its clocks;
``calibration_data``, its figures as data; ``calibration_file``, calibration.json), the
rig's collectives (``collectives``), a case as the model sees it (``case_shape``), the
step's parts (``step_time``, and ``pipeline_time`` for the pipelining schedules, whose
passes ``schedule_orders`` lists), and the runner's ``Predictor`` (``predictor``).
Memory: ``memory`` (peak per device), counted on fake tensors (``fake_step``) and replayed
through CUDA's caching allocator (``allocator``).
"""
