"""How a task's prompts are put to the model: the one place prompt text becomes token ids.

Training (`RolloutWorker.generate`) and evaluation (`actors.evaluate`, also through
`RolloutWorker.evaluate`) both render problems with a `PromptRenderer` and hand vLLM token
ids (`{"prompt_token_ids": ...}`), never text: the tokenization is ours, done once per
prompt, and identical in both paths (vLLM would otherwise tokenize text itself, and a chat
template applied in one path only would evaluate a different prompt than was trained on).

- chat_template "none": the raw prompt, tokenized as vLLM tokenizes a text prompt (with the
  tokenizer's special tokens, e.g. BOS).
- "auto": when the tokenizer has a chat template (Instruct models), the prompt becomes a user
  message, after an optional system message, rendered by `apply_chat_template` with the
  generation prompt; otherwise the raw prompt, as "none" (the embedded tiny model has none).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from rewards import Problem
from rewards.config import TaskConfig


class PromptRenderer:
    """Renders problems to token-id prompts and carries the task's stop strings.

    tokenizer: a Hugging Face tokenizer (the engine's: `llm.get_tokenizer()`).
    """

    def __init__(self, tokenizer: Any, *, chat_template: Literal["auto", "none"] = "auto",
                 system_prompt: str | None = None, stop: Sequence[str] = ()):
        if chat_template not in ("auto", "none"):
            raise ValueError(f"chat_template must be 'auto' or 'none', got {chat_template!r}")
        self.tokenizer = tokenizer
        self.use_chat_template = chat_template == "auto" and bool(
            getattr(tokenizer, "chat_template", None))
        if system_prompt is not None and not self.use_chat_template:
            # A system prompt pasted into raw text would be a guess at the model's format.
            raise ValueError("a system prompt needs a chat template, and "
                             + ("chat_template is 'none'" if chat_template == "none"
                                else "the tokenizer has none"))
        self.system_prompt = system_prompt
        self.stop = tuple(stop)

    @classmethod
    def for_task(cls, tokenizer: Any, task: TaskConfig) -> PromptRenderer:
        """The renderer of a training task's `chat_template`, `system_prompt` and `stop`."""
        return cls(tokenizer, chat_template=task.chat_template,
                   system_prompt=task.system_prompt, stop=task.stop)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> PromptRenderer:
        """A renderer with the tokenizer of a model directory (as the engine loads it)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), **kwargs)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The chat messages a prompt becomes under the chat template."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt}]

    def token_ids(self, prompt: str) -> list[int]:
        """The token ids given to the model for `prompt`."""
        if not self.use_chat_template:
            return list(self.tokenizer(prompt)["input_ids"])
        # tokenize=True tokenizes the rendered text without adding special tokens again (the
        # template writes its own BOS, if any). transformers >= 5 returns a BatchEncoding.
        out = self.tokenizer.apply_chat_template(self.messages(prompt), add_generation_prompt=True,
                                                 tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def prompts(self, problems: Sequence[Problem]) -> list[dict[str, list[int]]]:
        """vLLM token prompts (TokensPrompt dicts) for `problems`, in order."""
        return [{"prompt_token_ids": self.token_ids(p.prompt)} for p in problems]
