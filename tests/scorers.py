"""Plug-in scorers for system tests (loaded by name in rollout workers via task.reward).

A random tiny model never solves arithmetic, so its task reward would be constant 0 and the
policy gradient zero; these give a reward with variance inside each group."""


def short_answers(completion: str, problem) -> float:
    """1 for a completion of at most two characters (before a newline), else 0."""
    return 1.0 if len(completion.split("\n")[0].strip()) <= 2 else 0.0


def short_answers_hanging_on_some(completion: str, problem) -> float:
    """`short_answers`, but hangs forever on completions of exactly three characters: the
    scoring pool must time these out, score them 0 and count them, and the run go on."""
    if len(completion.split("\n")[0].strip()) == 3:
        import time

        while True:
            time.sleep(0.05)
    return short_answers(completion, problem)


def short_answers_slowly(completion: str, problem) -> float:
    """`short_answers` after 0.1 s: a generate call of 16 completions then takes over 1.6 s,
    longer than the sync.timeout_s the async fault test gives a weight load."""
    import time

    time.sleep(0.1)
    return short_answers(completion, problem)


def short_answers_slow_once(completion: str, problem) -> float:
    """`short_answers`; but the one call that finds the file named by $KLRL_TEST_SLOW_ONCE
    takes it away and first sleeps as many seconds as it holds: one generate call, made slower
    on purpose (while the worker stays live), at the moment the test chooses."""
    import os
    import time

    marker = os.environ.get("KLRL_TEST_SLOW_ONCE")
    if marker:
        try:
            with open(marker) as f:
                seconds = float(f.read())
            os.remove(marker)  # one caller wins: the others find no file
        except (FileNotFoundError, ValueError):
            seconds = 0.0
        time.sleep(seconds)
    return short_answers(completion, problem)
