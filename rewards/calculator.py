"""The embedded tool task: a sum of several multi-digit numbers, which the tiny model cannot
add in its head, with a calculator it may call.

Prompt: f"{a}+{b}+{c}=", e.g. "312+45+908="; the answer is the sum, "1265". The policy may
call the calculator by writing an expression between brackets, "[312+45+908]": the turn ends
at "]" (`CalculatorEnvironment.stop`), the environment replies with the value and a newline,
"1265\n", and the policy writes again. A turn that does not end in a call is the answer: its
first line, stripped, must be the sum (reward 1, else 0). A trajectory the task teaches:

    312+45+908=[312+45+908]1265\n1265<eos>
    ^ prompt    ^ policy    ^ env  ^ policy

A call whose expression is not digits joined by + or - gets "?\n" (no answer). The expression
is evaluated here, never by eval.

Splits: "train" (drawn with replacement) and "in_domain", both `terms` numbers of 1 to `digits`
digits (defaults 3 and 3); in_domain is drawn from a seed stream of its own (the space is
large: 10^9 for the defaults, so the two hardly overlap). Options: terms (2-6), digits (1-6).
"""
from __future__ import annotations

import random
import re

from rewards.environment import Environment, EnvStep, Turn
from rewards.records import Problem, Task

CALL_OPEN, CALL_CLOSE = "[", "]"
_CALL = re.compile(r"\[([^\[\]]{0,200})\]$")
_TERMS = re.compile(r"[+-]?[0-9]{1,30}")
_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")


def evaluate(expression: str) -> int | None:
    """The value of digits joined by + or - ("312+45-8"), or None for anything else."""
    if not re.fullmatch(r"[0-9]{1,30}([+-][0-9]{1,30}){0,20}", expression):
        return None
    return sum(int(t) for t in _TERMS.findall(expression))


def final_answer(text: str) -> str:
    """The answer a turn gives: its first line, stripped."""
    return text.split("\n", 1)[0].strip()


def score_calculator(completion: str, problem: Problem) -> float:
    """1.0 if the text after the last calculator reply (the whole completion when there is
    none) starts with a line equal to the sum. The scorer of a completion without the
    environment (a single-turn evaluation); in training the environment scores."""
    tail = completion.rsplit("\n", 1)[-1] if CALL_CLOSE in completion else completion
    answer = final_answer(tail)
    return 1.0 if _INTEGER.fullmatch(answer) and int(answer) == int(problem.answer) else 0.0


def make_problem(numbers: list[int], split: str) -> Problem:
    text = "+".join(str(n) for n in numbers)
    return Problem(uid=f"calculator/{split}/{text}", task="calculator", split=split,
                   prompt=f"{text}=", answer=str(sum(numbers)),
                   metadata={"numbers": list(numbers)})


class CalculatorTask(Task):
    """Sums of `terms` numbers of 1 to `digits` digits (module docstring); train its
    environment with `task.environment.name: calculator`."""

    name = "calculator"
    splits = ("train", "in_domain")
    scorer = staticmethod(score_calculator)
    max_new_tokens = 48

    def __init__(self, terms: int = 3, digits: int = 3):
        if not 2 <= terms <= 6:
            raise ValueError(f"terms must be in [2, 6], got {terms}")
        if not 1 <= digits <= 6:
            raise ValueError(f"digits must be in [1, 6], got {digits}")
        self.terms, self.digits = terms, digits

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        n = 500 if n is None else n
        top = 10 ** self.digits - 1
        return [make_problem([rng.randint(0, top) for _ in range(self.terms)], split)
                for _ in range(n)]


class CalculatorEnvironment(Environment):
    """Answers a bracketed call with its value and a newline; ends the episode at the first
    turn that is not a call, with reward 1 if its first line is the sum. info: tool_call (1 on
    a call), tool_call_valid (1 on a call it could evaluate)."""

    stop = (CALL_CLOSE,)

    def reset(self, problem: Problem) -> None:
        self.answer = int(problem.answer)

    def step(self, turn: Turn) -> EnvStep:
        call = _CALL.search(turn.text) if turn.finish_reason == "stop" else None
        if call is not None:
            value = evaluate(call.group(1))
            reply = "?\n" if value is None else f"{value}\n"
            return EnvStep(reply=reply, info={"tool_call": 1.0,
                                               "tool_call_valid": float(value is not None)})
        answer = final_answer(turn.text)
        correct = bool(_INTEGER.fullmatch(answer)) and int(answer) == self.answer
        return EnvStep(done=True, reward=float(correct))
