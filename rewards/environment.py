"""Multi-turn environments: what a researcher subclasses to make the policy's episode
interactive (a tool, a game, a sandbox), and the one registry that names them
(`task.environment.name`, as `task.reward` names a scorer).

    class Echo(rewards.environment.Environment):
        stop = ("?",)                          # a policy turn also ends at "?"

        def reset(self, problem):              # once per sample, before its first turn
            self.problem = problem

        def step(self, turn):                  # after each policy turn
            if turn.text.endswith("?"):
                return EnvStep(reply="!")      # answered, the policy writes again
            return EnvStep(done=True, reward=float(turn.text.strip() == self.problem.answer))

The episode: the rollout worker renders the prompt, the policy writes a turn (until EOS, one of
`stop`, or the per-turn budget), the environment's `step` reads it (`Turn`: its text, its
token ids exactly as sampled, the turn's index and the episode so far) and answers with an
`EnvStep`: a reply (text, tokenised once by the policy's tokenizer, or token ids given as
they are), whether the episode is over, and its reward when it is. The reply's ids are
appended to the token prefix and the policy's next turn is generated from that prefix (token
in, token out: nothing is ever re-rendered from text, docs/multi-turn.md).

Contract (checked by `check_reply`, a broken one costs the sample, never the run):
- `reset(problem)` and `step(turn)` may raise; the sample is then dropped and counted with the
  reason (`EnvFailure`), as is a step that takes longer than `task.environment.turn_timeout_s`
  or returns anything but an `EnvStep` with a finite reward (when done) and valid token ids.
- `reward` is read when the episode ends: done=True, or a limit cut it (turns, tokens), in
  which case the last step's reward is used if it gave one, else 0.
- An instance serves one sample at a time; a new one is made for every sample (`options` are
  its keyword arguments), so instance state is the episode's.

Pure: no Ray or vLLM (the rollout worker drives it, actors/multi_turn.py).
"""
from __future__ import annotations

import abc
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rewards.plugin import check_spec, import_spec, is_plugin
from rewards.records import Problem

# name -> "module:class": the environments shipped in rewards/. A plug-in environment is named
# by its spec "package.module:EnvironmentClass".
ENVIRONMENTS = {
    "calculator": "rewards.calculator:CalculatorEnvironment",
}
PLUGIN_FORM = "package.module:EnvironmentClass"


@dataclass(frozen=True)
class Turn:
    """One policy turn as the environment sees it: its text (decoded from its ids), its token
    ids exactly as sampled, its index (0: the first), why it ended ("stop": EOS or a stop
    string; "length": the per-turn or total budget), and the episode so far (every id after
    the prompt, the environment's replies included)."""

    text: str
    token_ids: tuple[int, ...]
    index: int
    finish_reason: str
    episode_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a turn. reply: text appended after the turn (tokenised once
    with the policy's tokenizer, no special tokens added); reply_ids: token ids appended as
    they are (give one or neither). done: the episode is over; reward: its worth (read when
    the episode ends). info: free-form numbers logged as env/<key> means (e.g. a tool's
    result being correct)."""

    reply: str | None = None
    reply_ids: tuple[int, ...] | list[int] | None = None
    done: bool = False
    reward: float | None = None
    info: dict[str, float] = field(default_factory=dict)


class Environment(abc.ABC):
    """Subclass it, implement `reset` and `step`; name it in `task.environment.name`
    ("package.module:Class" for your own, or a name of `ENVIRONMENTS`)."""

    # Strings that end a policy turn besides EOS (e.g. a tool call's closing marker): the
    # engine stops the turn there, the string included, and `step` sees it.
    stop: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def reset(self, problem: Problem) -> None:
        """Start an episode for `problem` (the prompt record the policy sees)."""

    @abc.abstractmethod
    def step(self, turn: Turn) -> EnvStep:
        """Answer the policy's `turn`."""


class EnvFailure(Exception):
    """The environment broke the contract on a sample: the sample is dropped, with `reason`
    (one of FAILURE_REASONS) and `detail`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# actor_lost: the environment's actor (task.environment.pool) died or was replaced.
FAILURE_REASONS = ("exception", "timeout", "invalid_reply", "actor_lost")


def check_reply(out: Any, vocab_size: int) -> EnvStep:
    """`out` if it is a valid EnvStep for a policy of `vocab_size` tokens, else EnvFailure
    ("invalid_reply") saying what is wrong."""
    def bad(why: str) -> EnvFailure:
        return EnvFailure("invalid_reply", why)

    if not isinstance(out, EnvStep):
        raise bad(f"step returned a {type(out).__name__}, not an EnvStep")
    if out.reply is not None and out.reply_ids is not None:
        raise bad("step gave both reply and reply_ids")
    if out.reply is not None and not isinstance(out.reply, str):
        raise bad(f"reply is a {type(out.reply).__name__}, not a str")
    if out.reply_ids is not None:
        ids = out.reply_ids
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size
                for i in ids):
            raise bad(f"reply_ids must be a list of token ids in [0, {vocab_size})")
    if not isinstance(out.done, bool):
        raise bad(f"done is a {type(out.done).__name__}, not a bool")
    if out.reward is not None:
        if isinstance(out.reward, bool) or not isinstance(out.reward, (int, float)) or \
                not math.isfinite(out.reward):
            raise bad(f"reward {out.reward!r} is not a finite number")
    elif out.done:
        raise bad("done without a reward")
    if not isinstance(out.info, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) for k, v in out.info.items()):
        raise bad("info must map names to numbers")
    return out


def check_environment_name(name: str) -> None:
    """ValueError unless `name` is one of ENVIRONMENTS or has the plug-in form; imports
    nothing (config validation calls it)."""
    if is_plugin(name):
        check_spec(name, "environment", PLUGIN_FORM)
    elif name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(ENVIRONMENTS)}, or "
                         f"a plug-in {PLUGIN_FORM!r} (a rewards.environment.Environment "
                         "subclass in your own package)")


def environment_class(name: str) -> type[Environment]:
    """The class `name` names, imported; ValueError naming it when it cannot be imported, is
    not an Environment subclass or leaves `reset` / `step` unimplemented."""
    check_environment_name(name)
    if is_plugin(name):
        cls = import_spec(name, "environment", PLUGIN_FORM)
    else:
        module_name, class_name = ENVIRONMENTS[name].split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment {name!r} is not a subclass of "
                         "rewards.environment.Environment (subclass it and implement reset "
                         "and step)")
    if missing := sorted(getattr(cls, "__abstractmethods__", ())):
        raise ValueError(f"environment {name!r} does not implement {', '.join(missing)}")
    if not all(isinstance(s, str) and s for s in cls.stop):
        raise ValueError(f"environment {name!r}: stop must be a tuple of non-empty strings")
    return cls


def make_environment(name: str, options: dict[str, Any]) -> Environment:
    """A new instance of environment `name` built with `options`; ValueError naming the option
    it does not take."""
    cls = environment_class(name)
    try:
        return cls(**options)
    except TypeError as e:
        raise ValueError(f"environment {name!r} cannot be built with options "
                         f"{sorted(options)}: {e}") from None
