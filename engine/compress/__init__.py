"""Lossless weight compression: ``.kvgate`` checkpoints (rANS-coded exponents, raw sign/mantissa bytes) for
distribution and loading, and a fixed-width palette form that keeps weights compressed in device memory."""
