"""Length shaping of a task reward (DAPO, Yu et al. 2025, "soft overlong punishment"): a
response that runs into the last `buffer` tokens of the generation budget L loses reward in
proportion to how far it got, up to `penalty` at the budget itself (where a truncated response
ends):

    shaped = reward - penalty x clip((|y| - (L - buffer)) / buffer, 0, 1)

so that the policy learns to finish before the budget instead of being cut mid-answer, with a
slope rather than a cliff. What a truncated response does to the task term and to the KL
terms is the trainer's (cluster/train/batching.py, docs/long-responses.md). Pure:
no Ray, vLLM or DeepSpeed.
"""
from __future__ import annotations


def overlong_penalty(length: int, budget: int, buffer: int, penalty: float) -> float:
    """The (non-positive) reward a response of `length` tokens gets added under a generation
    budget of `budget` tokens whose last `buffer` are penalised; 0 with no buffer."""
    if buffer <= 0 or length <= budget - buffer:
        return 0.0
    return -penalty * min(1.0, (length - (budget - buffer)) / buffer)
