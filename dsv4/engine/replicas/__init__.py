"""Engine replicas behind one daemon (--data-parallel-size): the pool, its router, a replica's process."""
