"""Reading saved plans: explain, why-not, diff, the CI report and the layout drawing."""
