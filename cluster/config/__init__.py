"""Configuration: the YAML loader (`loader.py`: file + `key=value` overrides -> a validated
pydantic model) and `TrainConfig` (`train_config.py`), which composes the sub-configs that
live with the code reading them (kl/, actors/, learner/, rewards/)."""
