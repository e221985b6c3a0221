"""FP8 library adapters. Each optional library is imported by its own module only."""

from __future__ import annotations

import sys
from collections.abc import Collection, Sequence

from torch import nn

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.sources.base import STATS, Source, SwitchableSource, TensorSpec
from fp8guard.agent.sources.emulation import EmulationSource

__all__ = ["STATS", "EmulationSource", "Source", "SwitchableSource", "TensorSpec", "discover_sources",
           "discover_switches"]

_LIBRARY = {"te": "transformer_engine", "torchao": "torchao"}


def discover_sources(model: nn.Module, wanted: Sequence[str] | None) -> list[Source]:
    """Every source that finds FP8 modules on ``model``; a source named in ``wanted`` must."""
    found: list[Source] = []
    names = list(wanted) if wanted is not None else ["te", "torchao", "emulation"]
    for name in names:
        source: Source | None
        if wanted is None and _LIBRARY.get(name, "") not in sys.modules and name != "emulation":
            # A model using TE or torchao has imported it already; never import a heavy
            # optional library (seconds, noisy) just to find out it is unused.
            continue
        if name == "emulation":
            source = EmulationSource.discover(model)
        elif name == "te":
            from fp8guard.agent.sources import te

            source = te.discover(model, required=wanted is not None)
        elif name == "torchao":
            from fp8guard.agent.sources import torchao

            source = torchao.discover(model, required=wanted is not None)
        else:  # pragma: no cover - MonitorConfig validates names
            raise ConfigError(f"unknown source {name!r}")
        if source is None and wanted is not None:
            raise ConfigError(f"source {name!r} was requested but the model has no {name} FP8 modules")
        if source is not None:
            found.append(source)
    return found


def discover_switches(model: nn.Module, skip: Collection[str] = ()) -> list[SwitchableSource]:
    """Hook-free switches for the FP8 modules of ``model`` (kinds in ``skip`` left out), for a
    remediator that was given no sources: nothing is measured, nothing hooked, and no library
    is imported that the model has not imported. TE modules need the monitor's source."""
    found: list[SwitchableSource] = []
    if "emulation" not in skip:
        emulation = EmulationSource.discover(model)  # hook-free, cheap
        if emulation is not None:
            found.append(emulation)
    if "torchao" not in skip and _LIBRARY["torchao"] in sys.modules:
        from fp8guard.agent.sources import torchao

        switch = torchao.switch(model)
        if switch is not None:
            found.append(switch)
    return found
