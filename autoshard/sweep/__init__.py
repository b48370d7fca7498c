"""`autoshard sweep`: plan one model over a grid of cluster shapes, budgets and batches, and
find the Pareto front of step time against devices and cost.

`grid` expands the flags into points, `points` plans one point as `autoshard plan` does (the
pipeline's `plan_request`) and turns its plan into a row, `executors` runs points on a local
process pool or Ray, `results` keeps the finished rows (a sweep resumes from them), `front`
finds the Pareto fronts and `page` draws them.
"""
