"""Plug-in scorers for system tests (loaded by name in rollout workers via task.reward).

A random tiny model never solves arithmetic, so its task reward would be constant 0 and the
policy gradient zero; these give a reward with variance inside each group."""


def short_answers(completion: str, problem) -> float:
    """1 for a completion of at most two characters (before a newline), else 0."""
    return 1.0 if len(completion.split("\n")[0].strip()) <= 2 else 0.0
