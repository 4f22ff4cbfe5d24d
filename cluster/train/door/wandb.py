"""The environment variables and credentials of wandb, before a run starts: WANDB_MODE, when it
sets the run's mode, must be one the config takes, and an online run needs an API key (wandb
would otherwise fail once the run directory exists and every actor has started). Which mode a
run uses is the run log's rule (`cluster.train.run_log.wandb_mode`); whether it can start is
checked here.
"""
from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import get_args
from urllib.parse import urlsplit

from cluster.config.loader import ConfigError
from cluster.config.sections import LoggingConfig
from cluster.train.run_log import wandb_mode


def wandb_modes() -> tuple[str, ...]:
    """The modes logging.wandb_mode takes (its Literal: the one list)."""
    annotation = LoggingConfig.model_fields["wandb_mode"].annotation
    return next(get_args(a) for a in get_args(annotation) if get_args(a))


def check_wandb(cfg) -> None:
    """WANDB_MODE, when it sets the mode (logging.wandb_mode null), must be one of the modes
    the config field takes; and an online wandb run needs an API key: without one wandb fails
    once the run directory exists and every actor has started. ConfigError naming the
    setting and the fixes."""
    if why := wandb_mode_env_problem(cfg, os.environ, "the environment"):
        raise ConfigError(why)
    if wandb_mode(cfg) != "online" or _wandb_key_available():
        return
    where = ("logging.wandb_mode=online" if cfg.logging.wandb_mode
             else "WANDB_MODE=online (logging.wandb_mode is null)")
    raise ConfigError(f"{where} needs a wandb API key and none is set: set WANDB_API_KEY or "
                      "run `wandb login`, or use logging.wandb_mode=offline (no account "
                      "needed; `wandb sync` uploads later)")


def wandb_mode_env_problem(cfg, environ, where: str) -> str | None:
    """Why `environ`'s WANDB_MODE cannot set the run's wandb mode (logging.wandb_mode null, a
    value the field would refuse), naming `where` it comes from; None when it can."""
    env = environ.get("WANDB_MODE")
    if cfg.logging.wandb_mode is not None or not env or env in wandb_modes():
        return None
    return (f"WANDB_MODE={env} (from {where}; logging.wandb_mode is null, so it sets the mode) "
            f"is not one of {', '.join(wandb_modes())}: unset it, or set logging.wandb_mode, "
            "which takes precedence")


def _wandb_key_available() -> bool:
    """WANDB_API_KEY (or an identity token file), or a netrc entry for the wandb host (what
    `wandb login` writes). An unreadable netrc counts as available: wandb decides."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = os.environ.get("NETRC") or next(
        (p for p in ("~/.netrc", "~/_netrc") if Path(p).expanduser().exists()), "~/.netrc")
    try:
        return netrc.netrc(Path(path).expanduser()).authenticators(host) is not None
    except FileNotFoundError:
        return False
    except (netrc.NetrcParseError, OSError):
        return True
