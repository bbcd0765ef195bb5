"""The one error a kernel call raises for inputs it cannot take (wrong shape, dtype, device or layout)."""


class KernelInputError(ValueError):
    """A kernel was handed tensors it cannot work on; the message names the argument and what is wrong."""
