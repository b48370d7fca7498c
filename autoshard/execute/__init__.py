"""Running a partitioned program: segments and steps, the collectives simulated on one
process, verification against onnxruntime, the partition files, torch ops and fidelity."""
