"""Errors fedlight raises for bad input, before any training starts."""


class ConfigError(ValueError):
    """A setting is invalid. The message names the setting and how to fix it.

    The CLI turns it into one readable line and exit status 2, without a traceback.
    """


class DataNotFoundError(ConfigError, FileNotFoundError):
    """Dataset files are missing; the message says where fedlight looked and how to get them."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)
