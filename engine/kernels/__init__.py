"""GPU kernels for the engine: Triton on CUDA, each beside the torch reference it must match.

Call them through ``engine.kernels.ops``, which picks Triton or torch for the tensors at hand.
"""
