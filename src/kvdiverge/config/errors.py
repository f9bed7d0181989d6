"""The one error of the configuration: :class:`ConfigError`, whose message is one line naming
the field (``config.<key>``) or the file, and what was expected."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """The configuration is unusable; the message is one line naming the field or file."""
