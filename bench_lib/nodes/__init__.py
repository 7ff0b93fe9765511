"""SEVERAL NODES, ONE SWEEP: what each node says of itself and the cases they share
(``multinode``), and the protocol they keep over node 0's store (``coordination``)."""
