"""The one error a model directory can raise; its message names the file and what is wrong with it."""


class ModelLoadError(Exception):
    """A model directory that cannot be loaded: missing files, unsupported config, bad or missing weights."""
