"""Rollout workers: Ray actors that own a vLLM engine and return typed Rollout records."""
