"""The door: every check klrl makes on a command's inputs before it starts anything heavy
(the tiny model build, Ray, DeepSpeed, vLLM, a cluster job) or writes anything, one check per
kind of input, shared by every command that reads that input. A refusal is a ConfigError of
one or two lines naming the input and the fix; the command exits 2 and leaves nothing behind.

Where each kind of input is checked (`preflight.py` runs them for `klrl train`, `klrl demo` and
each run of a local `klrl sweep`; `commands.py` for `klrl eval`, `klrl report` and `klrl
submit`). Every check a command makes before it starts anything lives in this folder, which
imports nothing of cluster/train/ but the run directory's owners (run_log.py, checkpoint.py)
and is imported by the rest:
- config files and overrides (types, bounds, unknown keys, an empty file, duplicate keys,
  cross-field rules, task options and splits): at load time (cluster/config/loader.py,
  train_config.py, rewards/config.py);
- run and sweep names: `cluster.config.names` (one directory name under output_dir), and every
  deletion inside a run directory: `cluster.train.checkpoint.remove_tree`;
- relative paths (model, data, output, shm): made absolute once, in the driver, before
  anything is sent to Ray (`paths.resolve_paths`), so every process reads the same files;
- model directories and hub names (the path's shape, the directory's files, the hub):
  `models.py`;
- tasks, each built once per command (`tasks.task_builder`): plug-ins (task.reward's signature,
  plug-in tasks' options and splits), data.epochs / data.shuffle against a generated split,
  local dataset files (there, rows in schema, malformed rows within
  task.max_malformed_fraction): `tasks.py`, through `rewards.config`;
- environment variables that override config and credentials: WANDB_MODE and the wandb key
  (`wandb.py`), RAY_ADDRESS (`preflight.check_ray_address`);
- vLLM engine arguments and LoRA against the model: `preflight.check_engine_kwargs`,
  `preflight.check_lora`;
- resources against the machine, or the Ray cluster's nodes once joined: `resources.py`;
- `--resume` targets and checkpoint integrity: `resume.py`.
"""
