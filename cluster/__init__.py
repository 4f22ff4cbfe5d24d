"""The controller, Ray start-up, job submission and the `klrl` command line."""
