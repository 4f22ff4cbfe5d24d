"""The DeepSpeed policy learner, the frozen reference model and model loading."""
