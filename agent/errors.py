"""The agent's exceptions. Only configuration and checkpoint errors are ever raised at the user;
after ``attach`` monitoring is best effort and never interrupts training.

* AgentError
  + ConfigError(ValueError)               bad configuration, raised by MonitorConfig/attach/HealConfig
  + SourceUnavailable(ImportError)        a requested source's library is not installed
  + IntegrationUnavailable(ImportError)   an integration's framework (Lightning, transformers,
                                          accelerate) is not installed; names what to install
  + CheckpointError                       a checkpoint cannot be found, read, validated or restored;
                                          the message names the file and the reason
"""

from __future__ import annotations

__all__ = ["AgentError", "CheckpointError", "ConfigError", "IntegrationUnavailable", "SourceUnavailable"]


class AgentError(Exception):
    """Base of fp8guard.agent's errors."""


class ConfigError(AgentError, ValueError):
    """The configuration cannot work; the message says what to change."""


class SourceUnavailable(AgentError, ImportError):
    """A source was requested explicitly but its library is missing; names the extra to install."""


class IntegrationUnavailable(AgentError, ImportError):
    """An integration was used but its framework is not installed; names the package to install."""


class CheckpointError(AgentError):
    """A checkpoint is missing, unreadable, of another format, or does not fit the model; the
    message names the file (or step and folder) and what is wrong. Never a bare
    FileNotFoundError or an error from inside ``torch.load``."""
