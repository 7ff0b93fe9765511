"""The results schema: every file of a run folder, each column with its unit and meaning.

A run folder ``results/<run_id>/`` holds::

    env.json     environment, rig, profile, command line, schema version; ``sweep``: the
                 sweep's id (``run.shard.sweep_id``) and the shard K/N a ``run --shard``
                 ran (with its case ids), or the shards a ``merge`` joined (``merged_from``);
                 ``launcher``: local or torchrun, nodes, node rank, rendezvous endpoint
                 and timeout; in a multi-node run ``nodes``, every node (host, devices, versions,
                 fingerprint), and the fingerprint covers all of them (``fingerprint.nodes``);
                 ``multi_gpu``: /dev/shm, NCCL_* variables, on a cuda rig the GPUs' links
                 through NVML (``topology``: PCIe path, P2P read/write/nvlink, NVLinks), the
                 ``iommu`` and PCIe ``acs`` state where the OS shows them (``unknown``
                 otherwise) and ``summary``, the line the captions show (``2 GPUs: PCIe host
                 bridge, P2P read/write ok, no NVLink, IOMMU off, ACS unknown``);
                 ``preflight`` (a cuda run; else null): each check's ``name``, ``status``,
                 ``detail``, its ``seconds``, and ``nccl_fallback``: null, or the variable the
                 run went on with and why (``NCCL_P2P_DISABLE=1: the all-reduce hung with
                 peer-to-peer on``), also on every figure's caption
    cases.csv    exactly one row per case, whatever happened to it
    steps.csv    every timed step of every rank
    timeline.csv pipelined cases only: per stage, micro-batch and phase, start and end
    samples.csv  the sampler's readings while each case ran
    calibration.json  where the profile predicts step times (``predict_time``): each
                 workload's calibration (``prediction.calibration``), or why it failed,
                 and the collectives the run measured (``collectives``, as env.json's),
                 which ``run --calibration`` reuses for the same sweep (env.json then
                 says ``collectives_reused_from``)
    shards/K/    a merged folder only: shard K's own env.json (``run.merge``)
    distance.csv a ``distance`` run folder only (with env.json, no cases.csv): one row per
                 pairwise-distance case (``DISTANCE``; ``bench_lib.distance``)
    tune.csv     a ``tune`` folder (``bench_lib.tune``): one row per launch the race made
                 (``TUNE``); its tune.json holds the verdict, env.json ``tune`` the settings

Version 5 (this one) measures every case in several fresh launches, interleaved in rounds
(``launches``, ``steps_per_launch``, ``launch_medians_s``; steps.csv ``launch``): the
median step time is the geometric mean of the launches' medians and its interval a t
interval across launches; the speedup over single has its own interval, paired by round
(``speedup_ci_low``, ``speedup_ci_high``, ``speedup_ci_note``); the lag-1
autocorrelation is pooled within launches; ``warmup_steps`` is the most any launch ran.
Version 4 was version 3 with contention made visible: each rank's CPU time per
timed step (steps.csv ``cpu_time_s``) and, per case, the machine's steal and other
processes' CPU over the case and a ``contention`` reason (``cpu_steal_pct``,
``other_cpu_pct``, ``contention``; ``bench_lib.measure.contention``); and with numbers you
can bet on: ``warmup_steps`` is the warm-up actually run (the profile's is its minimum), the
median's interval says its method or why there is none (``step_time_ci_method``,
``step_time_ci_note``: exact order statistics under 8 steps, none under 6), and
``step_time_lag1_autocorr`` shows how correlated consecutive steps are.
Version 3 read peak memory after warm-up instead of over the process's lifetime
and adds it net of the runtime (``peak_mem_net_mib_*``, ``peak_mem_source``;
``mem_imbalance_ratio`` now from the net figures), and the pipeline bubble per device and
per schedule (``bubble_*_pct``, ``traced_*``; timeline rows name their device slot and a
``wgt`` phase); with the FLOP peak probing GEMM and convolutions on every device at once
(``mfu_note``), cpu utilisation 0-100 of the cores a worker holds (``cpu_pct``), energy net
of idle power and only from windows long enough (``energy_j_per_img_net``,
``sampler_note``; env.json ``idle_power``, ``math_mode``, ``cpu_topology``).
Version 2 differed from version 1 in the
option columns (``partition``, ``channels_last``, ``compile``, ``sync_bn``). Readers refuse
any other version rather than guess: re-run the sweep to read an old folder.

This module and the rest of ``bench_lib.results`` never import torch.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 5
STATUSES = ("ok", "oom", "unsupported", "skipped", "timeout", "error")
CALIBRATION_FILE = "calibration.json"
"""A run folder's calibrations, one entry per workload: written by
``prediction.calibration_file``, reused by a gate's later rounds (``gate.rounds``)."""


class ResultsError(ValueError):
    """A run folder that cannot be read (missing files, another schema version)."""


@dataclass(frozen=True)
class Column:
    """One CSV column: its name (the unit is part of it) and what it means."""

    name: str
    meaning: str
    numeric: bool = False
    """True when the column holds a number or nothing (checked on reading)."""
    added: bool = False
    """True for a column added within this schema version: a run folder written before
    it lacks the column, readers fill it empty, and a resumed one goes on without it."""


def _cols(*specs: tuple[str, str] | tuple[str, str, bool] | tuple[str, str, bool, bool]
          ) -> tuple[Column, ...]:
    return tuple(Column(*s) for s in specs)


N = True  # marks numeric columns below

CASES = _cols(
    ("run_id", "the run folder's name: <UTC time>_<host>_<git sha7>_run-<profile> "
               "(_merge-<profile> for merged shards)"),
    ("case_id", "strategy, model, image size, batch, split and options, e.g. "
                "ddp_resnet50_img128_b32_s-_fp32"),
    ("strategy", "registry name of the strategy"),
    ("model", "workload model name (bench_lib.workloads.MODELS): resnet18/50/101/152, "
              "resnet-tiny, mlp, toy"),
    ("rig", "rig label, e.g. cpu:2x1t or cuda:2; cuda:8@2nodes in a multi-node run (8 GPUs "
            "on each of 2 nodes; world_size says how many a case used)"),
    ("world_size", "devices the case uses", N),
    ("threads_per_worker", "intra-op threads of each CPU worker (empty on GPUs)", N),
    ("image_size", "square input size in pixels; a model that takes no image size runs "
                   "once, whatever the sweep's sizes, at its own: mlp 28 (28x28 digits), toy 0 "
                   "(its input is 10 features, not an image)", N),
    ("batch_size", "global images per training step", N),
    ("split_size", "images per micro-batch (empty where no split applies)", N),
    ("num_microbatches", "micro-batches per step (empty where no split applies)", N),
    ("precision", "fp32 or bf16 (autocast)"),
    ("loss", "ce or mse-onehot (classifiers), or mse on real-valued targets (toy, "
             "whatever the sweep's loss)"),
    ("status", "ok, oom, unsupported, skipped, timeout or error (an oom whose reason starts "
               "'predicted:' was never launched: its predicted peak exceeded a device's "
               "memory)"),
    ("reason", "why a case did not end ok"),
    ("warmup_steps", "discarded warm-up steps actually run before timing, the most of any "
                     "launch: at least the profile's warmup_steps, then more while step "
                     "times still fell (the latest more than 2% faster than every earlier "
                     "one; the slowest rank's times, all ranks alike), at most 8 more; empty "
                     "for a case not timed", N),
    ("launches", "fresh process launches the case was measured in (the profile's launches; "
                 "interleaved in rounds with the other cases of its workload)", N),
    ("provisional", "empty in a final row; in a row written while its workload was still "
                    "running, how far it got, e.g. 'after round 1 of 3': made by the same code "
                    "as the final row, from the launches so far (after round 1 one per case, "
                    "so no interval), replaced by the next round's rows and by the final ones "
                    "(rows.workload_rows); a run stopped mid-workload keeps them, and "
                    "--resume drops them and runs that workload again", False, True),
    ("steps_per_launch", "timed steps of each launch, in round order, e.g. 8;8;7"),
    ("launch_medians_s", "each launch's median step time (the slowest rank's per step), in "
                         "round order, seconds, e.g. 0.451;0.447;0.462"),
    ("timed_steps", "steps timed, all launches (the slowest rank's per step)", N),
    ("step_time_s_median", "the case's median step time: the geometric mean of the launches' "
                           "medians (with 1 launch, its median), seconds", N),
    ("step_time_s_mean", "mean step time, all launches' steps, seconds", N),
    ("step_time_s_stdev", "standard deviation of step times, all launches' steps, seconds",
     N),
    ("step_time_s_p10", "10th percentile of step times, all launches' steps, seconds", N),
    ("step_time_s_p90", "90th percentile of step times, all launches' steps, seconds", N),
    ("step_time_s_iqr", "interquartile range of step times, all launches' steps, seconds",
     N),
    ("step_time_s_ci_low", "95% confidence interval of the median step time, low end, "
                           "seconds: the Student t interval (launches - 1 degrees of freedom) "
                           "of the mean log launch median, so it holds the step-to-step noise "
                           "(correlated or not) and the launch-to-launch spread both "
                           "(coverage checked in tests/test_ci_coverage.py); empty with 1 "
                           "launch (reason in step_time_ci_note)", N),
    ("step_time_s_ci_high", "the same interval's high end, seconds", N),
    ("step_time_ci_method", "how the interval was had: 't over N launches', or empty"),
    ("step_time_ci_note", "why the median has no interval (1 launch)"),
    ("step_time_lag1_autocorr", "lag-1 autocorrelation of consecutive step times within "
                                "launches (the slowest rank's per step; each launch about its "
                                "own mean, pooled): 0 for independent steps, toward 1 when "
                                "slow steps follow slow ones; empty under 10 steps in all "
                                "(standard error about 1/sqrt(steps) when independent)", N),
    # Launch-to-launch differences (bench_lib.analysis.launch_spread): each launch's steps in
    # batches long enough to be nearly independent, their medians' one-way ANOVA by launch.
    ("launches_differ", "1 where the launches' medians differ by more than their own steps' "
                        "spread explains (p under 0.01: each launch's log steps in batches "
                        "of at least 3 steps and 3 correlation lengths, the batch medians' "
                        "one-way analysis of variance by launch), else 0; empty with 1 launch "
                        "or too few steps for 2 batches a launch", N, True),
    ("launch_spread_ratio", "the spread of the launches' levels over what their batches' "
                            "spread predicts for it (sqrt of the analysis of variance's F): "
                            "about 1 for launches alike", N, True),
    ("launch_spread_p", "the chance of a ratio at least launch_spread_ratio were the "
                        "launches alike (the F distribution's tail)", N, True),
    ("launch_note", "where launches_differ is 1, their medians and the test's figures; why "
                    "there is no test (too few steps); on cuda rigs whether the launches ran "
                    "the same CUDA kernels (one profiled step after the timed ones per "
                    "launch; cuDNN's benchmark mode picks algorithms per process): 'launches "
                    "ran the same kernels (N)' or 'launch 2 ran N kernels launch 1 did not, "
                    "launch 1 M it did not (e.g. <name>)'", False, True),
    ("throughput_img_s", "global batch over the median step time, images per second", N),
    ("peak_mem_mib_max", "largest per-device peak memory over the timed steps (gross), MiB",
     N),
    ("peak_mem_mib_by_device", "peak memory per device over the timed steps, runtime "
                               "included (gross), device:MiB;... (CUDA allocator peak since "
                               "its reset after warm-up per GPU; peak resident memory of each "
                               "worker process on CPU, one figure under '0+1' for a process "
                               "that drives both)"),
    ("peak_mem_net_mib_max", "largest per-device peak memory net of the runtime, MiB", N),
    ("peak_mem_net_mib_by_device", "what the case adds: peak memory per device after "
                                   "warm-up, net of each process's footprint before the "
                                   "model was built (torch, libraries, process group), "
                                   "device:MiB;... (CPU: gross minus that resident memory; "
                                   "CUDA: the allocator holds only the case's, so = gross)"),
    ("peak_mem_mib_predicted_max", "largest per-device predicted peak memory, MiB (beside "
                                   "peak_mem_net_mib_max)", N, True),
    ("peak_mem_mib_predicted_by_device", "peak memory per device predicted before the case "
                                         "ran, net of the runtime as peak_mem_net_mib_by_device "
                                         "and with its device labels, device:MiB;...: one "
                                         "training step of each process replayed on fake "
                                         "tensors, its live tensors counted "
                                         "(bench_lib.prediction.memory: what is counted, "
                                         "assumed and calibrated); on a cuda rig the allocator's "
                                         "peak, the count run through its blocks with cuBLAS's "
                                         "and cuDNN's workspaces "
                                         "(bench_lib.prediction.cuda_memory); "
                                         "empty for a case not run (skipped, unsupported) or not "
                                         "predicted (why in note)", False, True),
    ("peak_mem_source", "how peaks were read: cuda-allocator, vmhwm (/proc VmHWM reset "
                        "after warm-up through clear_refs) or ru_maxrss (the process's "
                        "lifetime peak, build and warm-up included, where it could not "
                        "be reset)"),
    ("case_wall_time_s", "the case's wall time, its launches summed, each from start to its "
                         "last rank reaped, seconds", N),
    # Contention over each launch, start to the last rank reaped (measure.contention): the
    # machine's CPU times (/proc/stat) at its start and end; the busiest launch's figures.
    ("cpu_steal_pct", "steal over the case (CPU time the hypervisor gave to other guests), % "
                      "of the machine's CPU capacity (every logical CPU x the case's wall "
                      "time)", N),
    ("other_cpu_pct", "busy CPU over the case (user+nice+system+irq+softirq) not used by the "
                      "case's processes (its ranks and their reaped children) nor the "
                      "runner, % of the machine's CPU capacity (every logical CPU x the "
                      "case's wall time); on a machine much larger than the rig a co-runner "
                      "on the case's own cores reads diluted", N),
    ("contention", "empty when none was seen, else why the case was measured under "
                   "contention: other_cpu_pct or cpu_steal_pct over 10% of the machine's "
                   "capacity (enough alone to move a step time by the gate's 10%), or a "
                   "single-process case on a cpu rig whose median CPU time per step was "
                   "under 80% of its pinned cores x wall time (it waited for a core; "
                   "distributed ranks wait on peers by design and are not judged so)"),
    ("throttled", "empty when none was seen (or no GPU said why its clocks were where they "
                  "were: cpu rigs), else why the case was measured with its GPU clocks "
                  "held back: on some GPU, clock event reasons other than gpu_idle and "
                  "applications_clocks_setting (power cap, thermal, sync boost...) held in "
                  "over 10% of its samples in the timed windows, e.g. 'GPU 1 25% "
                  "(sw_power_cap 25%, sync_boost 10%)' (measure.throttling)", False, True),
    ("note", "how to read this strategy's numbers on this rig; for an ok case, why it has "
             "no timeline ('no timeline: rank 1: out of memory in the traced step ...') or "
             "lacks a diagnostic after the timed steps ('diagnostics incomplete: rank 0: the "
             "compute-only steps did not finish ...'; its timed steps are kept)"),
    ("stop_reason", "what ended timing: ci_target, time_cap, step_cap, or min_time (one of "
                    "ci_target or step_cap came first and the minimum timed duration, "
                    "min_time_s, held the launch on until it) (each launch's, in round "
                    "order, e.g. ci_target;time_cap;ci_target, where they differ)"),
    ("util_pct_mean", "mean over devices of util_pct_mean_by_device, %; empty (reason in "
                      "sampler_note) for a timed window under 1 s or a device with under 3 "
                      "samples in it", N),
    ("util_pct_mean_by_device", "mean utilisation per device over the timed window, 0-100 of "
                                "what the device holds, device:%;... (GPUs: GPM SM activity "
                                "where the GPU has it, Hopper and later, else NVML "
                                "kernel-active time; cpu workers: the process's CPU time over "
                                "its threads' cores, 100 = all of them busy; a process driving "
                                "several devices (mp, pipeline: '0+1') over the one worker's "
                                "cores it holds); util_source names which"),
    ("util_source", "the counter utilisation was read from (analysis.utilisation): "
                    "gpm-sm-activity (the share of SM time with work resident), "
                    "nvml-kernel-active (the share of time any kernel ran: NCCL kernels "
                    "waiting for a peer count as busy) or cpu-time; device:source;... where "
                    "the devices differ", False, True),
    ("util_timeline_pct", "the share of the median step one device's own compute takes, "
                          "mean over devices, %: ddp its compute-only (no_sync) steps, fsdp "
                          "a ddp case's of the same local batch, pipelines and mp the traced "
                          "step's passes per device plus its optimizer share (as the "
                          "waterfall's S); empty for single and dp (no such measure) and for "
                          "one cpu worker driving several devices", N, True),
    ("util_check", "empty when util_pct_mean and util_timeline_pct are within 20 points (or "
                   "either is missing), else both and why the counter reads above (what it "
                   "counts beside compute: NCCL kernels waiting, the collectives' CPU work) or "
                   "below (the device waited inside the compute passes): read neither as the "
                   "devices' compute share", False, True),
    ("power_w_mean", "mean power of the energy counters over the timed window (gross), watts",
     N),
    ("energy_j_per_img", "energy per image over the timed window, gross: everything the "
                         "counters saw (RAPL: the whole packages holding the rig's cores, "
                         "idle cores and other processes included; NVML: the case's GPUs), "
                         "joules; not comparable across strategies", N),
    ("energy_j_per_img_net", "energy_j_per_img net of the run's idle power of the same "
                             "counters (env.json idle_power): what the case added, joules; "
                             "comparable across strategies", N),
    ("energy_source", "rapl-rig-packages (RAPL of the CPU packages holding the rig's cores) "
                      "or nvml-gpus (the case's GPUs)"),
    ("sampler_note", "why utilisation, power or energy are empty: a timed window under 1 s "
                     "(NVML averages over up to 1 s), under 3 samples of a device or counter "
                     "in it, no readable energy counter, no idle power for the net figure, "
                     "a validation run's slots sharing a GPU (each sampled it)"),
    ("peak_mem_reserved_mib_max", "largest CUDA caching-allocator reservation after warm-up, "
                                  "MiB", N),
    ("peak_mem_reserved_mib_by_device", "CUDA caching-allocator peak per device after warm-up, "
                                        "device:MiB;..."),
    ("peak_mem_reserved_mib_predicted_max", "largest per-device predicted reservation of the "
                                            "CUDA caching allocator, MiB (beside "
                                            "peak_mem_reserved_mib_max; cuda rigs only)", N,
     True),
    ("peak_mem_reserved_mib_predicted_by_device", "the CUDA caching allocator's reservation "
                                                  "per device predicted before the case ran "
                                                  "(its segments, the predicted allocations "
                                                  "replayed through them: bench_lib.prediction."
                                                  "allocator), device:MiB;...: what admission "
                                                  "compares with each GPU's memory; empty "
                                                  "where peak_mem_mib_predicted_by_device is "
                                                  "and on cpu rigs", False, True),
    ("mem_imbalance_ratio", "max over min net peak memory across the devices used", N),
    ("flops_per_img", "training FLOPs (forward + backward) per image (per sample for toy)",
     N),
    ("achieved_tflop_s", "flops_per_img x throughput, TFLOP/s", N),
    ("mfu_pct", "achieved over the measured attainable peak of the devices whose compute "
                "the case holds (a cpu rig's mp/pipeline: one worker's), %; the peak is the "
                "best of a GEMM and a conv probe per device (env.json attainable_peak)", N),
    ("mfu_note", "why mfu_pct is empty (no peak; a validation run, whose slots shared each "
                 "GPU while its peak was probed), or a flag where it is over 100%: the case "
                 "beat the measured peak, so that probe is not the attainable peak here and "
                 "the figure is not an efficiency"),
    ("speedup_vs_single", "throughput over the single case of the same workload and run: the "
                          "geometric mean over rounds of single's launch median over this "
                          "case's launch median of the same round", N),
    ("speedup_ci_low", "95% confidence interval of speedup_vs_single, low end: the t "
                       "interval of the rounds' mean log ratio (pairing by round cancels "
                       "drift that slows both alike); empty with 1 round", N),
    ("speedup_ci_high", "the same interval's high end", N),
    ("speedup_ci_note", "why the speedup has no interval (1 round)"),
    ("scaling_efficiency", "speedup_vs_single over world_size", N),
    ("scaling", "strong: batch_size is the workload's, split over the devices; weak: each of "
                "the world_size devices gets the workload's batch (batch_size = it x "
                "world_size, through micro-batches of the same split_size), and "
                "speedup_vs_single is this case's throughput over single's at the "
                "workload's batch (empty in a run before it: strong)", False, True),
    ("optimizer_step_s", "single: the optimizer step alone (median of 3 after the timed "
                         "steps, in the launch that traces), seconds: the share of a step "
                         "that does not shrink with the batch", N, True),
    # single's batch curve (bench_lib.sweep.batch_curve): how a device's per-image
    # speed changes with the images it computes at once.
    ("device_batch_size", "images one device computes at once: a data-parallel rank's share "
                          "of batch_size (ddp, fsdp, dp), a pipelining or accumulating "
                          "case's split_size, else batch_size", N, True),
    ("batch_curve_of", "in a single row that is a point of the batch curve: the batch_size "
                       "of the workload whose curve it measures (this row's batch is one "
                       "its cases compute per device; measured in that workload's rounds); "
                       "empty in the sweep's own cases", N, True),
    ("per_image_efficiency", "in a batch-curve row: its throughput over that workload's "
                             "single throughput at the full batch (1 = a device loses nothing "
                             "with fewer images at once): batch_size / batch_curve_of x the "
                             "geometric mean over rounds of single's launch median over this "
                             "row's of the same round", N, True),
    ("per_image_efficiency_ci_low", "95% confidence interval of per_image_efficiency, low "
                                    "end (the t interval over rounds, as speedup_ci_low)",
     N, True),
    ("per_image_efficiency_ci_high", "the same interval's high end", N, True),
    # The waterfall (bench_lib.rows.waterfall): the step's parts (one list, defined
    # once: bench_lib.analysis.step_parts) measured, from the ideal N-fold step up to the
    # measured step; seconds and % of the measured step (step_time_s_median).
    ("waterfall_ideal_s", "single's step at the workload's batch x batch_size / (that batch "
                          "x world_size): the step of an N-fold speedup (weak scaling: "
                          "single's step at the workload's batch), seconds", N, True),
    ("waterfall_ideal_pct", "waterfall_ideal_s as % of step_time_s_median (100 / it = the "
                            "measured speedup's share of the ideal)", N, True),
    ("waterfall_batch_s", "what the devices lose computing device_batch_size images at once "
                          "rather than the workload's batch, optimizer step aside, from "
                          "single's batch curve, seconds", N, True),
    ("waterfall_batch_pct", "waterfall_batch_s as % of step_time_s_median", N, True),
    ("waterfall_optimizer_s", "a device's optimizer step beyond its share of the ideal's "
                              "(single's optimizer step alone x the share of the model the "
                              "device updates, less 1 / world_size of it), seconds", N, True),
    ("waterfall_optimizer_pct", "waterfall_optimizer_s as % of step_time_s_median", N, True),
    ("waterfall_corun_s", "what computing beside the other devices costs one device: its "
                          "compute in the case with every device busy and no communication "
                          "(ddp's no_sync steps, 3 after each launch's timed steps, the "
                          "median over launches; fsdp: a ddp case's of the same local batch; "
                          "pipelining schedules: the traced step's passes) minus the batch "
                          "curve's, seconds (0 where not measured or one device computes at "
                          "a time)", N, True),
    ("waterfall_corun_pct", "waterfall_corun_s as % of step_time_s_median", N, True),
    ("waterfall_imbalance_s", "the busiest device's passes in the traced step over the "
                              "devices' mean, scaled to the median step, seconds (0 without "
                              "a timeline)", N, True),
    ("waterfall_imbalance_pct", "waterfall_imbalance_s as % of step_time_s_median", N, True),
    ("waterfall_bubble_s", "the idle time the schedule forces on the busiest device "
                           "(bound_bubble_s: torch's action lists replayed with the traced "
                           "passes); serial cases (one process runs every stage: mp, "
                           "pipeline on a cpu rig): the other devices' passes and optimizer "
                           "shares, seconds", N, True),
    ("waterfall_bubble_pct", "waterfall_bubble_s as % of step_time_s_median", N, True),
    ("waterfall_comm_s", "what the collectives or transfers add at the run's measured "
                         "bandwidths, not hidden behind compute (bound_comm_s), seconds",
     N, True),
    ("waterfall_comm_pct", "waterfall_comm_s as % of step_time_s_median", N, True),
    ("waterfall_own_s", "the strategy's own work (waterfall_note says which): FSDP2's "
                        "copies at the calibrated copy rate, DDP's from a ddp-1 case over "
                        "single, a schedule's between its traced passes, a serial pipeline's "
                        "passes beyond single's curve, seconds", N, True),
    ("waterfall_own_pct", "waterfall_own_s as % of step_time_s_median", N, True),
    ("waterfall_remainder_s", "step_time_s_median less every waterfall part above: what "
                              "no part explains, seconds (negative: the parts overstate)",
     N, True),
    ("waterfall_remainder_pct", "waterfall_remainder_s as % of step_time_s_median", N, True),
    ("waterfall_note", "the bubble in theory, what the own part is (or why it is not "
                       "measured), a remainder over 10% of the step, or why the case has "
                       "no waterfall", False, True),
    ("partition", "stage cut used, method:block indices (strategies that cut the model); "
                  "a balanced cut is profiled in the case's first launch and reused by its "
                  "later ones, so all launches measure the same cut"),
    ("channels_last", "1 when model and inputs were channels-last", N),
    ("compile", "1 when modules were torch.compiled", N),
    ("sync_bn", "1 when BatchNorm was synchronised across ranks", N),
    # DistributedDataParallel's knobs (bench_lib.strategies.ddp_knobs.DdpKnobs), in the rows of the
    # strategies that wrap the model in it (ddp, ddp-1); empty in the others.
    ("ddp_bucket_cap_mb", "DDP bucket cap in MiB, or 'default' (torch's: 25 MiB after a "
                          "first bucket of 1 MiB)", False, True),
    ("ddp_gradient_as_bucket_view", "1 when DDP's gradients were views into its buckets "
                                    "(zeroed in place each step)", N, True),
    ("ddp_static_graph", "1 when DDP was told the graph is static", N, True),
    ("ddp_comm_hook", "DDP communication hook: none, fp16, bf16 (gradients compressed to that "
                      "format for the all-reduce) or powersgd-r<rank> (rank-r PowerSGD); all "
                      "but none change the gradients, as the note says", False, True),
    # The pipeline bubble per device and per schedule (bench_lib.analysis.bubble), for the
    # pipelined strategies (mp, pipeline, gpipe, 1f1b, interleaved-1f1b, interleaved-zb, zbv);
    # the measured ones from the traced step after the timed ones, empty without a timeline.
    ("bubble_measured_pct", "idle share of the traced step's span per device (1 - its busy "
                            "time, any stage or phase, over the span), mean over devices, %",
     N),
    ("bubble_theory_pct", "the schedule's idle share of the span with equal forward, input- "
                          "and weight-gradient times: (p-1)/(m+p-1) gpipe/1f1b/pipeline, "
                          "(p-1)/p mp, (p-1)/(v*m+p-1) interleaved-1f1b, (p-1)/(3*v*m+p-1) "
                          "interleaved-zb and zbv (p devices, v stages each, m micro-batches), "
                          "%", N),
    ("timeline_span_s", "the traced step's timeline, first start to last end over all "
                        "devices (no optimizer step), seconds", N),
    ("traced_step_s", "wall time of the traced step, timed like a timed step (the slowest "
                      "rank's), seconds", N),
    ("traced_vs_median_pct", "traced_step_s over step_time_s_median, minus 1, % (+ = the "
                             "traced step was slower)", N),
    # The bound of each case from its own parts (bench_lib.analysis.bound states each formula
    # and its sources): pipelines, mp, ddp, fsdp; empty for the others.
    ("step_time_s_bound", "the step time the case's own measured parts allow, seconds: a "
                          "pipeline's schedule run with its traced per-stage pass times and "
                          "the measured p2p time, plus the traced step outside the passes "
                          "(all scaled to the median step where the traced one was slower); "
                          "mp: every pass in turn plus, on two GPUs, each cut's activation "
                          "forward and back at the device copy's fit (env.json "
                          "collectives.device_copy, else an assumed PCIe copy the note "
                          "names); ddp/fsdp: single's step x "
                          "local/global batch overlapped with the gradient collectives at the "
                          "run's measured bandwidth (env.json collectives)", N, True),
    ("step_time_s_bound_no_overlap", "ddp/fsdp: the same bound with nothing overlapped, "
                                     "compute + collectives, seconds", N, True),
    ("efficiency_vs_bound_pct", "100 x step_time_s_bound / step_time_s_median: 100 = as fast "
                                "as the parts allow", N, True),
    ("bound_compute_s", "the bound's compute part: the busiest device's passes (ddp/fsdp: "
                        "the local batch's compute), seconds", N, True),
    ("bound_bubble_s", "the bound's idle time the schedule forces on the busiest device "
                       "with free transfers, seconds", N, True),
    ("bound_comm_s", "what transfers or collectives add to the bound (ddp/fsdp: what "
                     "overlap leaves exposed), seconds", N, True),
    ("bound_other_s", "the traced step outside the scheduled passes (optimizer step, loss, "
                      "input split) in the bound, seconds", N, True),
    ("bound_note", "which bound and its parts, e.g. '1f1b: compute 0.41 s + bubble 0.12 s + "
                   "p2p 0.02 s + other 0.03 s', or why the case has none; '(copy fit "
                   "assumed: ...)' where mp's or pipeline's GPU-to-GPU copy was priced "
                   "without a measured one", False, True),
    # The step time predicted before the case ran, from its workload's calibration
    # (profile key predict_time; bench_lib.prediction.step_time states each formula).
    ("step_time_s_predicted", "the step time predicted before the case's first launch from "
                              "its workload's calibration (calibration.json: steps timed "
                              "alone and with every device computing, block passes, the "
                              "optimizer step) and the run's collectives, seconds", N, True),
    ("speedup_predicted", "the predicted speedup over single: the predicted throughput over "
                          "single's predicted at the workload's batch", N, True),
    ("prediction_error_pct", "step_time_s_predicted over step_time_s_median, minus 1, % "
                             "(+ = predicted slower than measured)", N, True),
    ("prediction_note", "the prediction's formula and parts, e.g. 'ddp: compute 0.35 s + "
                        "comm 0.06 s', or why the case has none", False, True),
    *((f"predicted_{part}_s", f"the predicted step's {part} part (the waterfall_{part}_s "
                              "of the prediction: the same definition fed with the "
                              "calibration), seconds", N, True)
      for part in ("ideal", "batch", "optimizer", "corun", "imbalance", "bubble", "comm",
                   "own")),
)
STEPS = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"),
    ("launch", "the launch (round) index from 0", N), ("rank", "process rank", N),
    ("step", "timed step index from 0 within the launch", N),
    ("step_time_s", "this rank's step time, seconds", N),
    ("cpu_time_s", "this rank's process CPU time in the step (time.process_time: every "
                   "thread), seconds. On a cpu rig a rank pinned to T cores reads up to "
                   "T x step_time_s; well under it, the rank waited (for a peer, or for a "
                   "core another process held). On GPUs the host side only (Python, "
                   "kernel launches, any spinning in synchronize), not device work", N),
    ("probe_s", "the machine's speed control (measure.speed_probe: a fixed few matrix "
                "products, env.json speed_probe) timed by this rank just before the step, "
                "seconds; a step over its probe loses most of what the machine's speed did "
                "(gate: cases one process times). Empty on GPUs and in folders written "
                "before it", N),
)
OPTIONAL_STEP_COLUMNS = ("probe_s",)
"""steps.csv columns a reader does not require: folders of this schema written before them
lack them."""
# What the sampler reads per device; a metric a source cannot read is left empty.
SAMPLE_METRICS = _cols(
    ("cpu_pct", "worker process's CPU time since the last sample with a value over its "
                "threads' cores, % (100 = every core the worker holds busy: threads_per_worker "
                "cores); empty within 5 clock ticks (50 ms) of that sample", N),
    ("rss_mib", "worker resident memory, MiB", N),
    ("util_gpu_pct", "NVML utilization.gpu, kernel-active time: the share of time any kernel "
                     "ran (NCCL's waiting for a peer too), %; not read for a MIG instance "
                     "(its card's)", N),
    ("util_mem_pct", "NVML memory-controller utilisation, %", N),
    ("mem_used_mib", "NVML memory used on the GPU, MiB", N),
    ("power_w", "NVML power draw, watts (the card's: not read for a MIG instance)", N),
    ("sm_clock_mhz", "NVML SM clock, MHz", N),
    ("gpu_temp_c", "NVML GPU temperature, degrees Celsius", N, True),
    ("clock_event_reasons", "why NVML says the GPU's clocks are where they are, '+'-joined "
                            "(nvml.CLOCK_EVENT_REASONS): gpu_idle, "
                            "applications_clocks_setting, sw_power_cap, hw_slowdown, "
                            "sync_boost, sw_thermal_slowdown, hw_thermal_slowdown, "
                            "hw_power_brake_slowdown, ...; none when no reason held; empty "
                            "where unread (cpu rigs, an NVML without it)", False, True),
    ("energy_j", "energy counter since the sampler started (NVML) or RAPL total, joules", N),
    ("sm_util_pct", "GPM SM activity: the share of SM time with work resident, % (Hopper "
                    "and later; a MIG instance's own)", N),
    ("tensor_active_pct", "GPM tensor-core activity, % (Hopper and later)", N),
)
SAMPLES = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"),
    ("time_unix_s", "wall-clock time of the reading, unix seconds", N),
    ("device", "device label (as in peak_mem_mib_by_device), or host"),
) + SAMPLE_METRICS
TIMELINE = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the case"), ("rank", "process rank", N),
    ("stage", "global stage index", N),
    ("device", "the device that ran it: cuda:N on GPUs, the rig's worker slot cpu:N on CPUs; "
               "in a multi-node run prefixed with the node's rendezvous rank, n1/cuda:0"),
    ("microbatch", "micro-batch index", N),
    ("phase", "fwd, bwd (input gradient, or the whole backward where it is not split) or "
              "wgt (weight gradient: zero-bubble schedules)"),
    ("start_s", "start on the case's aligned clock, seconds", N),
    ("end_s", "end on the case's aligned clock, seconds", N),
)

# tune.csv: ``python -m bench_lib tune`` (bench_lib.tune), one row per launch, as it ends.
TUNE = _cols(
    ("run_id", "the run folder's name"), ("case_id", "the candidate (a case id)"),
    ("rung", "the race's rung from 0 (each rung is a round: its candidates launched once, in "
             "a seeded shuffled order); every launch is short (tune.space.RACE_*)", N),
    ("launch", "the launch's index in the whole race, from 0", N),
    ("status", "ok, oom, timeout or error (a candidate whose launch failed is not launched "
               "again)"),
    ("reason", "why the launch did not end ok"),
    ("launch_median_s", "median of the launch's timed step times (slowest rank per step), "
                        "seconds", N),
    ("timed_steps", "timed steps behind the median", N),
    ("warmup_steps", "warm-up steps the launch ran", N),
    ("wall_time_s", "the launch from start to end as tune saw it, seconds (the budget counts "
                    "these)", N),
)

# parity.csv and parity_verdicts.csv: ``python -m bench_lib parity`` (bench_lib.parity).
PARITY = _cols(
    ("run_id", "the run folder's name"),
    ("model", "workload model name"),
    ("strategy", "registry name of the strategy"),
    ("precision", "fp32, or fp64 for single's float64 reference run"),
    ("seed", "seed of the run's initial weights and shuffles: the run's --seed, or one of "
             "single's further seeds on a BatchNorm model (the split keeps --seed)", N),
    ("world_size", "processes of the run (1 where one process drives its devices)", N),
    ("epoch", "epoch index from 0", N),
    ("train_loss", "mean of the epoch's global-batch training losses", N),
    ("test_loss", "loss over the whole test set after the epoch, evaluated on one unsplit "
                  "copy of the trained model", N),
    ("test_accuracy", "share of test images classified right (empty for toy's regression)",
     N),
    ("test_loss_sd", "standard deviation of the loss over the test images (its standard "
                     "error is test_loss_sd / sqrt(test images))", N),
    ("epoch_time_s", "wall time of the epoch's training steps on rank 0, seconds (no "
                     "benchmark: on a cpu rig one-process runs train side by side)", N),
)
PARITY_VERDICTS = _cols(
    ("run_id", "the run folder's name"),
    ("model", "workload model name"),
    ("strategy", "registry name of the strategy"),
    ("verdict", "reference (single), match, diverged, unsupported, skipped or error"),
    ("reason", "why a strategy did not run, or failed"),
    ("world_size", "processes of the run", N),
    ("bn_statistics", "what BatchNorm normalises over in training: whole batch, per "
                      "micro-batch, per rank or per device chunk (dp) (empty: no "
                      "BatchNorm)"),
    ("test_loss", "final epoch's test loss", N),
    ("test_accuracy", "final epoch's test accuracy (empty for a regression)", N),
    ("compared_with", "the strategy whose final figures it is judged against: single, or "
                      "the first strategy with the same BatchNorm statistics"),
    ("test_loss_diff", "absolute difference from compared_with's final test loss", N),
    ("test_accuracy_diff", "absolute difference from compared_with's final test accuracy",
     N),
    ("tolerance_kind", "rounding (single's float32 against float64) or seeds (single's "
                       "spread over seeds; BatchNorm statistics differ)"),
    ("loss_tolerance", "the largest test_loss_diff that matches (bench_lib.parity.verdict)",
     N),
    ("accuracy_tolerance", "the largest test_accuracy_diff that matches", N),
    ("tolerance_note", "how the tolerance was derived, with its numbers"),
)

# distance.csv: ``python -m bench_lib distance`` (bench_lib.distance). Columns named as in
# cases.csv mean the same there.
DISTANCE = _cols(
    ("run_id", "the run folder's name"),
    ("case_id", "method, layer and precision, e.g. split_8192x128x1x1_fp32"),
    ("method", "loop (the question's double Python loop), blocked (torch.cdist on blocks of "
               "rows, one device) or split (the rows over the rig's devices: a gloo rank per "
               "cpu worker, or one process driving every GPU)"),
    ("layer", "conv weight shape OUTxINxKHxKW"),
    ("kernels", "kernels compared: the layer's output channels", N),
    ("kernel_numel", "numbers per kernel: in x kh x kw", N),
    ("dtype", "fp32 or fp64: the weight's and the computation's precision"),
    ("block_rows", "rows per torch.cdist block (empty for loop)", N),
    ("rig", "rig label, e.g. cpu:2x1t or cuda:2"),
    ("world_size", "devices the case computes on", N),
    ("threads_per_worker", "intra-op threads of each CPU worker (empty on GPUs)", N),
    ("max_memory_per_device_mib", "the memory cap per device the case ran under, MiB "
                                  "(empty: none)", N),
    ("status", "ok, oom, skipped (loop above --loop-max-kernels), unsupported (split on one "
               "device), timeout or error"),
    ("reason", "why a case did not end ok"),
    ("launches", "fresh process launches the case was measured in", N),
    ("steps_per_launch", "timed steps of each launch, in round order, e.g. 8;8;7"),
    ("launch_medians_s", "each launch's median step time (the slowest rank's per step), in "
                         "round order, seconds"),
    ("timed_steps", "steps timed, all launches", N),
    ("warmup_steps", "discarded warm-up steps, the most of any launch", N),
    ("step_time_s_median", "one step (forward and backward of the scalar, and on ranks the "
                           "gradient's all-reduce): the geometric mean of the launches' "
                           "medians, seconds", N),
    ("step_time_s_ci_low", "95% t interval across launches of the median step time, low "
                           "end, seconds (empty with 1 launch)", N),
    ("step_time_s_ci_high", "the same interval's high end, seconds", N),
    ("step_time_ci_method", "how the interval was had: 't over N launches', or empty"),
    ("step_time_ci_note", "why the median has no interval (1 launch)"),
    ("speedup_vs_blocked", "blocked's step time over this case's, the geometric mean over "
                           "rounds of the same round's launch medians", N),
    ("speedup_ci_low", "95% t interval of speedup_vs_blocked over rounds, low end", N),
    ("speedup_ci_high", "the same interval's high end", N),
    ("peak_mem_mib_max", "largest per-device peak memory over the timed steps, runtime "
                         "included (gross), MiB", N),
    ("peak_mem_net_mib_max", "largest per-device peak memory over the timed steps net of the "
                             "runtime (as in cases.csv), MiB", N),
    ("peak_mem_net_mib_by_device", "the same per device, device:MiB;... (a cpu rank per "
                                   "worker; GPUs by index)"),
    ("peak_mem_source", "how peaks were read: cuda-allocator, vmhwm or ru_maxrss"),
    ("value", "the scalar D = sum over p, q of ||X_p - X_q|| (both orders, diagonal 0) the "
              "case computed in its last step", N),
    ("value_ref", "D in float64 from the same weight, closed form without autograd "
                  "(bench_lib.distance.methods.reference)", N),
    ("value_abs_diff", "|value - value_ref|", N),
    ("value_rel_diff", "value_abs_diff over |value_ref|", N),
    ("grad_max_abs_diff", "largest absolute difference of the case's dD/dW from the float64 "
                          "reference gradient", N),
    ("grad_rel_diff", "grad_max_abs_diff over the reference gradient's largest magnitude", N),
    ("agree_rtol", "the precision's tolerance for value_rel_diff and grad_rel_diff", N),
    ("agrees", "1 when value_rel_diff and grad_rel_diff are within agree_rtol, else 0 "
               "(empty for a case not ok)", N),
    ("case_wall_time_s", "the case's wall time, its launches summed, seconds", N),
)


def launch_medians(text: object) -> list[float]:
    """cases.csv's ``launch_medians_s`` (``0.451;0.447;0.462``, round order) as numbers; []
    when empty; a ValueError where a part is not a number."""
    if not isinstance(text, str) or not text.strip():
        return []
    return [float(v) for v in text.split(";")]


def names(columns: tuple[Column, ...]) -> list[str]:
    """The column names, in file order."""
    return [c.name for c in columns]


CASE_COLUMNS = names(CASES)
STEP_COLUMNS = names(STEPS)
SAMPLE_METRIC_NAMES = tuple(names(SAMPLE_METRICS))
SAMPLE_COLUMNS = names(SAMPLES)
ADDED_SAMPLE_COLUMNS = [c.name for c in SAMPLES if c.added]
TIMELINE_COLUMNS = names(TIMELINE)
PARITY_COLUMNS = names(PARITY)
PARITY_VERDICT_COLUMNS = names(PARITY_VERDICTS)
DISTANCE_COLUMNS = names(DISTANCE)
NUMERIC_CASE_COLUMNS = [c.name for c in CASES if c.numeric]
ADDED_CASE_COLUMNS = [c.name for c in CASES if c.added]
