"""Errors shared by the workloads. Messages name the field and the fix."""


class ConfigError(ValueError):
    """A configuration value cannot run; the message names the field path and how to fix it."""
