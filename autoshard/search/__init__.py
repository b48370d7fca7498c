"""Search for a plan: candidates, their costs and the CP-SAT ILP, and hand-written baselines."""
