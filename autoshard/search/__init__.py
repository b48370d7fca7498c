"""Search for a plan: hand-written baselines now; candidates, cost and the CP-SAT ILP later."""
