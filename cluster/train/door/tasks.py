"""Task inputs: the training task and every evaluation set's task, each built once per command
(`task_builder`), and checked on that one object: a plug-in scorer (task.reward), plug-in
tasks' options and splits (validation checks those of rewards/'s own tasks), data.epochs and
data.shuffle against a generated split, and the local dataset files the run reads (there, rows
in schema, malformed rows within task.max_malformed_fraction; `rewards.config`).
"""
from __future__ import annotations

import json

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from rewards.config import Build, build_named
from rewards.records import Task


def task_builder() -> Build:
    """`rewards.config.build_named`, memoised by (task name, options): the command's one
    builder, so that every check of one task reads the same object, built once."""
    built: dict[tuple[str, str], Task] = {}

    def build(name_field: str, name: str, options_field: str, options: dict) -> Task:
        key = (name, json.dumps(options, sort_keys=True, default=repr))
        if key not in built:
            built[key] = build_named(name_field, name, options_field, options)
        return built[key]

    return build


def check_plugins_of(cfg: TrainConfig, build: Build | None = None) -> None:
    """The config's plug-ins, imported as the rollout workers will: task.reward (callable as a
    scorer), task.environment (importable, an Environment with reset and step, built with its
    options) and plug-in tasks (their options and splits, and data.epochs / data.shuffle against
    their training split). A failed import's message says how to make it importable
    (rewards/plugin.py). build: the command's builder (`task_builder`)."""
    from rewards import load_scorer
    from rewards.config import check_plugins
    from rewards.registry import is_plugin

    build = build or task_builder()
    if cfg.task.reward:
        try:
            load_scorer(cfg.task.reward)
        except ValueError as exc:
            raise ConfigError(f"task.reward: {exc}") from None
    if cfg.task.environment.enabled:  # imported and built as each sample's instance will be
        from rewards.environment import make_environment

        try:
            make_environment(cfg.task.environment.name, cfg.task.environment.options)
        except ValueError as exc:
            raise ConfigError(f"task.environment: {exc}") from None
    try:
        check_plugins(cfg.task, cfg.eval, build)  # plug-in tasks; each message names its field
        if is_plugin(cfg.task.name):  # a plug-in's epochs/order: not checked at load time
            cfg.data.check_task(cfg.task, build("task.name", cfg.task.name, "task.options",
                                                cfg.task.options))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_tasks(cfg: TrainConfig) -> list[str]:
    """Every task check a training run makes before it starts (module docstring), each task
    built once. Returns the lines worth saying that are no refusal (malformed rows within the
    allowed share)."""
    from rewards.config import check_local_datasets

    build = task_builder()
    check_plugins_of(cfg, build)
    try:
        return check_local_datasets(cfg.task, cfg.eval, build)  # there, not empty, in schema
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
