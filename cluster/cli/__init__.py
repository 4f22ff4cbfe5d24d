"""The `klrl` command line: argument parsing and printing only (`main.py` and one `cmd_*`
module per group of commands); the work is done by the other cluster subpackages.
`python -m cluster.cli ARGS` is `klrl ARGS`."""
