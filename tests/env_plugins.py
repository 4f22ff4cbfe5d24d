"""Plug-in environments for the multi-turn tests (named "env_plugins:Class" in a config; tests/
is on the path of every process the tests start, tests/conftest.py). A random tiny model writes
random characters, so these answer whatever it writes."""
from __future__ import annotations

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
    """Chatter on most problems; on the problem whose uid ends in `uid_end` it
    raises, hangs past any timeout or returns garbage."""

    def __init__(self, fault: str = "raises", uid_end: str = "/0"):
        self.fault, self.uid_end = fault, uid_end

    def reset(self, problem):
        super().reset(problem)
        self.broken = problem.uid.endswith(self.uid_end)

    def step(self, turn):
        if not self.broken:
            return super().step(turn)
        if self.fault == "raises":
            raise RuntimeError("the tool crashed")
        if self.fault == "hangs":
            time.sleep(30)
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
