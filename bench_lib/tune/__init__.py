"""``tune``: search one workload's configurations by racing instead of sweeping them all:
``space`` (the candidates), ``race`` (successive halving, pure logic), ``plan`` (what the
flags ask of the race: ``TunePlan``), ``search`` (the command: ``run_tune``), ``output``
(the plan as printed before it launches, the run folder's files, the recommendation),
``versus`` (tune against the exhaustive sweep)."""
