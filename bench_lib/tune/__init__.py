"""``tune``: search one workload's configurations by racing instead of sweeping them all:
``space`` (the candidates), ``race`` (successive halving, pure logic), ``run`` (the
command), ``output`` (plan, files, recommendation)."""
