"""Tensor and pipeline parallelism: process groups, sharded layers, pipeline stages, worker processes."""
