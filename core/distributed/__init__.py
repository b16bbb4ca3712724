"""Running one model across several processes: the tensor-parallel group and its collectives."""
