"""The program's memory as the search sees it: liveness walked once per value and choice (`build`),
recorded at slots (`slots`, `record`) and assembled into the rows the solver bounds (`rows`)."""
