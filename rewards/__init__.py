"""Tasks (a prompt source plus a verifiable scorer) and fault-tolerant scoring. Pure: no Ray/vLLM/DeepSpeed."""
