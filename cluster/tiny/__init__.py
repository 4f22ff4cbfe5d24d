"""The embedded tiny model: a character tokenizer (`char_tokenizer.py`) and a tiny Qwen2,
built, warm-started and cached by `model.py` (`klrl init-model`)."""
