"""Passes over a sharded program, each a pure function named with a verb."""
