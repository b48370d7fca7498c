"""The solver of a search problem: CP-SAT, exact elimination and the Lagrangian relaxation."""
