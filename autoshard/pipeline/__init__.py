"""The order of the stages, in one place:

    import -> decide (propagate annotations | read a saved plan | search)
           -> lower (materialize, then the CCL passes) -> partition

The faces (CLI, REST service) and the benchmarks call these functions and never chain stages
themselves; each stage stays a pure function of its own module (`stages`: each stage, and
what annotations or a saved plan decide; `request`: `autoshard plan`, the search deciding).
After materialize, ccl and partition the program can be printed as MLIR (`--dump-after
STAGE`): `after` is told each stage and what it left. A `Tracker` is told each stage as it
begins (`PipelineStage`: what the progress bar, its plain lines and the service's job
progress name).
"""

from autoshard.pipeline.request import (
    GraphCache,
    PlanRequest,
    RequestedPlan,
    _step_graphs,
    plan_inputs,
    plan_request,
)
from autoshard.pipeline.stages import (
    AfterStage,
    Built,
    Lowered,
    PipelineStage,
    Setup,
    build,
    build_setup,
    dump_after,
    load_graph,
    load_graphs,
    lower_document,
    print_spmd,
    propagated,
)

__all__ = [
    "AfterStage", "Built", "GraphCache", "Lowered", "PipelineStage", "PlanRequest",
    "RequestedPlan", "Setup", "_step_graphs", "build", "build_setup", "dump_after", "load_graph",
    "load_graphs", "lower_document", "plan_inputs", "plan_request", "print_spmd", "propagated",
]  # fmt: skip
