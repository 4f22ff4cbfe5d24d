"""The Ray driver side of klrl, by job: `cli/` (the `klrl` command line), `config/` (YAML
loading and `TrainConfig`), `train/` (one training run), `experiments/` (sweeps and reports),
`bench/` (`klrl bench`) and `tiny/` (the embedded tiny model). docs/layout.md."""
