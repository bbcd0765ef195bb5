"""Inference engines behind kvgate: the OpenAI protocol, KV event publishing, and a simulated engine."""
