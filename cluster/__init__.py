"""The Ray driver side of klrl, by job: `cli/` (the `klrl` command line), `config/` (YAML
loading and `TrainConfig`), `train/` (one training run), `launchers/` (where runs start),
`sweeps/` (running many runs), `analysis/` (reading them against a pre-registration: the
report), `publish/` (figures, wandb dashboards), `slurm/`, `bench/` (`klrl bench`) and `tiny/`
(the embedded tiny model). docs/layout.md."""
