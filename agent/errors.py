"""The agent's exceptions. Only configuration errors are ever raised at the user; after
``attach`` monitoring is best effort and never interrupts training.

* AgentError
  + ConfigError(ValueError)           bad configuration, raised by MonitorConfig/attach
  + SourceUnavailable(ImportError)    a requested source's library is not installed
"""

from __future__ import annotations

__all__ = ["AgentError", "ConfigError", "SourceUnavailable"]


class AgentError(Exception):
    """Base of fp8guard.agent's errors."""


class ConfigError(AgentError, ValueError):
    """The configuration cannot work; the message says what to change."""


class SourceUnavailable(AgentError, ImportError):
    """A source was requested explicitly but its library is missing; names the extra to install."""
