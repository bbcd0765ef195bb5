"""The SIMULATED engine: an OpenAI-compatible server with a cost model, for tests and benchmarks."""
