"""Measuring the machine the cost model prices: `autoshard calibrate` and its kernel probes."""
