"""Plug-in environments for the multi-turn tests (named "env_plugins:Class" in a config; tests/
is on the path of every process the tests start, tests/conftest.py). A random tiny model writes
random characters, so these answer whatever it writes."""
from __future__ import annotations

import os
import time

from rewards.environment import Environment, EnvStep

REPLY = "<ok>\n"


class Chatter(Environment):
    """Replies REPLY to each of the policy's first two turns and ends the episode after the
    third, with reward = the last turn's length (a reward with spread)."""

    stop = ("\n",)

    def reset(self, problem):
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        if self.turns < 3:
            return EnvStep(reply=REPLY, info={"tool_call": 1.0})
        return EnvStep(done=True, reward=float(len(turn.token_ids)))


class ChatterIds(Chatter):
    """Chatter, replying token ids (5, 6, 7) instead of text."""

    def step(self, turn):
        out = super().step(turn)
        return out if out.done else EnvStep(reply_ids=[5, 6, 7], info=out.info)


class Faulty(Chatter):
    """Chatter on most problems; on a problem whose uid ends in a key of `faults` it breaks
    that way: "raises", "hangs" (past any timeout), "garbage" (not an EnvStep) or "exits" (its
    process ends: an environment actor's death, task.environment.pool)."""

    def __init__(self, faults: dict[str, str] | None = None):
        self.faults = faults or {"/0": "raises"}

    def reset(self, problem):
        super().reset(problem)
        self.fault = next((f for end, f in self.faults.items() if problem.uid.endswith(end)),
                          None)

    def step(self, turn):
        if self.fault is None:
            return super().step(turn)
        if self.fault == "raises":
            raise RuntimeError("the tool crashed")
        if self.fault == "hangs":
            time.sleep(30)
        if self.fault == "exits":
            os._exit(1)
        return {"reply": "not an EnvStep"}


class NoStep(Environment):
    """Lacks step: refused at the door."""

    def reset(self, problem):
        pass


class NotAnEnvironment:
    """Not a subclass: refused at the door."""


class TemplateChatter(Chatter):
    """Chatter whose replies are tool turns of tests/test_chat_template.py's chat template
    (`<|role|>content` lines), handing the floor back to the assistant."""

    def step(self, turn):
        out = super().step(turn)
        return out if out.done else EnvStep(reply="\n<|tool|><ok>\n<|assistant|>", info=out.info)
