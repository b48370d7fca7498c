"""The IOPDDL contest's problems: the format (`format`), posed as our search problem (`pose`),
and solved by the planner's solver, memory rows added as solutions go over them (`solve`)."""
