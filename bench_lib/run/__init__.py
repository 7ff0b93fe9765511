"""THE `run` COMMAND'S BODY: rounds of launches into a run folder (``runner``), one launch of
a case (``case_launch``; ``agent_launch``, ``follower_run`` where several nodes share a sweep),
where the run's time went (``duty``), its progress, and a sweep cut into shards and joined
back (``shard``, ``merge``)."""
