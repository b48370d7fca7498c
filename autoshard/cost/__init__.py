"""The cost model: devices and clusters, compute and memory of a program, its price."""
