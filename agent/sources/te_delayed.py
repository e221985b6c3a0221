"""Transformer Engine's ``DelayedScaling``: read from TE's own per-module state.

TE keeps ``fp8_meta["scaling_fwd"|"scaling_bwd"]`` per module: ``amax_history`` ``[L, slots]``
and ``scale`` ``[slots]``, updated in place after the forward (autocast exit) and after the
backward. Per step, after backward: AMAX = row -1 of the history (the latest completed amax);
with ``amax_history_len == 1`` TE zeroes that row at once, so AMAX = ``fp8_max / (scale *
2**margin)`` from the new scale; SCALE = the scale seen at the previous read (the one in use when
that amax was measured); HISTORY_MAX = max over the stored history.

Host work per read does not grow with the model. TE updates these tensors in place (the amax
reduction copies back into them, ``fused_amax_and_scale_update_after_reduction`` rolls the
history and writes the scale in place, ``reset_fp8_meta_tensors`` and, when the recipe state
matches, ``set_extra_state`` on checkpoint load copy into them), so the reader keeps them from
attach. Where Triton runs (CUDA; the CPU under ``TRITON_INTERPRET=1``) one launch over a device
table of their addresses writes every column (:class:`~fp8guard.agent.kernels.HistoryGather`);
elsewhere a fixed handful of device ops (one concatenation of the scales, one of the histories
per history length, two index selects).

TE does reallocate them on a recipe change, on ``adjust_amax_history_length`` (a new history
length; TE's own docstring warns "this changes the underlying amax memory location") and, in
older TE releases, on every checkpoint load (``set_extra_state`` re-initialised the state). So the
reader checks that TE still holds the same tensors: after any ``load_state_dict`` of a monitored
module (a post-hook sets a flag), after the source's own BF16 switches and probes, and otherwise
``_VERIFY_PER_READ`` entries per read in rotation, a fixed cost instead of a walk over every
module each step. A reallocation inside a forward (recipe or history length changed mid-run) is
thus seen within ``ceil(entries / _VERIFY_PER_READ)`` reads (18 reads for a 96-layer
``TransformerLayer`` stack, a few steps for smaller models); until then the read reports the
tensors TE left, which the reader still holds, so the memory it reads stays valid. Once seen it
re-points the table (or re-plans), or stops with an error when the state is gone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from typing import Any, cast

import torch
from torch import nn

from fp8guard.agent.kernels import HistoryGather, triton_available
from fp8guard.agent.sources.base import AMAX, HISTORY_MAX, SCALE, TensorSpec
from fp8guard.agent.sources.te_layout import (
    BOUNDARY,
    OPERANDS,
    SIDES,
    Column,
    Side,
    check_role,
    format_of,
    gemm_suffix,
    hook_operands,
    num_gemms,
    slot_of,
    state_of,
    te_roles,
)

__all__ = ["DelayedReader", "Entry", "delayed_columns"]

log = logging.getLogger("fp8guard.agent")

Entry = tuple[str, nn.Module, str, Side]
"""(module name, module, kind, side): one RecipeState of TE."""

_VERIFY_PER_READ = 32
"""Entries whose tensors a read checks, in rotation (see the module docstring): 32 keeps the check
a few microseconds while a 12-layer stack (72 entries) is covered every 3 reads."""
_FLOAT32_BYTES = 4


def delayed_columns(ready: list[tuple[str, nn.Module, str]], boundary_slots: str) -> tuple[list[Entry], list[Column]]:
    """The state entries and the columns of the modules' delayed-scaling state."""
    entries: list[Entry] = []
    columns: list[Column] = []
    candidates: list[Column] = []
    boundary: list[tuple[Column, torch.Tensor]] = []
    hook_ops = {(name, g, side, pos) for name, m, kind in ready
                for g, side, pos in hook_operands(kind, num_gemms(m, kind))}
    for name, m, kind in ready:
        states = {side: state_of(m, kind, side) for side in SIDES}
        if any(s is None or not hasattr(s, "amax_history") for s in states.values()):
            log.warning("fp8guard: te source skips %s: incomplete delayed-scaling state", name)
            continue
        slots = {side: int(states[side].scale.numel()) for side in SIDES}
        gemms = num_gemms(m, kind)
        expected = (2, 1) if kind == "ops_linear" else (3 * gemms, 2 * gemms)
        if (slots["fwd"], slots["bwd"]) != expected:
            log.warning("fp8guard: te source skips %s: %s slots, expected %s", name,
                        (slots["fwd"], slots["bwd"]), expected)
            continue
        entry: dict[str, int] = {}
        for side in SIDES:
            entry[side] = len(entries)
            entries.append((name, m, kind, side))
        roles = {side: te_roles(m, kind, side, slots[side]) for side in SIDES}
        recipe = states["fwd"].recipe
        margin = float(getattr(recipe, "margin", 0))
        for g in range(gemms):
            for side, pos in OPERANDS:
                slot = slot_of(kind, side, g, pos)
                if slot is None:
                    continue
                check_role(name, roles[side], slot, pos)
                fmt, fp8_max = format_of(recipe, side)
                spec = TensorSpec(module=name + gemm_suffix(kind, g), role=f"{side}_{pos}",
                                  fp8_format=str(fmt), fp8_max=fp8_max)
                col = Column(spec=spec, module=m, kind=kind, side=side, slot=slot, entry=entry[side],
                             fmt=fmt, margin=margin, hooked=(name, g, side, pos) in hook_ops)
                candidates.append(col)
                if pos in BOUNDARY and boundary_slots == "auto":
                    boundary.append((col, states[side].amax_history[:, slot].amax()))
    used: set[int] = set()
    if boundary:
        # One host read at attach (never per step): which output/grad_input slots TE used so far.
        flags = torch.stack([a for _, a in boundary]).gt(0).tolist()
        used = {id(c) for (c, _), f in zip(boundary, flags, strict=True) if f}
    for col in candidates:
        pos = col.spec.role.split("_", 1)[1]
        if pos in BOUNDARY and (boundary_slots == "none" or (boundary_slots == "auto" and id(col) not in used)):
            continue
        columns.append(col)
    return entries, columns


def _fp8_meta(module: nn.Module) -> dict[str, Any]:
    return cast(dict[str, Any], module.fp8_meta)


@dataclass(slots=True)
class _Plan:
    """How to gather the columns for one layout of history lengths (built once per layout)."""

    groups: list[tuple[int, list[int], int, int, torch.Tensor | None]]
    """(history length, entries, start, end in the concatenation, derive-divisor or None)."""
    order: list[int]
    index: torch.Tensor
    fp8_max: torch.Tensor


@dataclass(slots=True)
class _Gather:
    """TE's tensors in a plan's order: rebuilt only when TE reallocates one."""

    plan: _Plan
    scales: list[torch.Tensor]
    """Scales of every entry, in ``plan.order``."""
    hists: list[list[torch.Tensor]]
    """Histories of each group of ``plan.groups``."""


class DelayedReader:
    """Reads the columns of TE's delayed-scaling state into the monitor's rows. See the module docstring."""

    def __init__(self, entries: list[Entry], columns: list[Column], device: torch.device) -> None:
        self.entries = entries
        self._columns = columns
        self._device = device
        self._plans: dict[tuple[int, ...], _Plan] = {}
        # Fast path: every entry's RecipeState sits in the module's fp8_meta dict (te.ops keeps
        # its own nested dicts, which it may replace: those models take the checked slow path).
        fast = all(kind != "ops_linear" for _, _, kind, _ in entries)
        self._metas: list[dict[str, Any]] | None = [_fp8_meta(m) for _, m, _, _ in entries] if fast else None
        self._keys = [f"scaling_{side}" for _, _, _, side in entries]
        self._hists: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._gather: _Gather | None = None
        self.fp8_mask: torch.Tensor | None = None
        """1 per column in FP8, 0 where the module is in BF16 fallback (None: all in FP8)."""
        self._version = 0
        """Bumped whenever TE's tensors are found reallocated (the table then re-points)."""
        self._dirty = False
        self._cursor = 0
        hists, scales = self.live_state()
        plan = self._plan_for(hists)
        # The scale a completed amax was measured with is the one from before the update that
        # consumed it: the scale seen at the previous read (here: at attach).
        self._scale_in_use = torch.cat([scales[e] for e in plan.order]).index_select(0, plan.index)
        self._table: HistoryGather | None = None
        self._table_version = -1
        if triton_available(device) and columns:
            self._table = HistoryGather([c.spec.fp8_max for c in columns], [2.0 ** c.margin for c in columns], device)
            self._keep = torch.ones(len(columns), dtype=torch.float32, device=device)
        # A checkpoint load may reallocate TE's state (older TE always did): check it at the next read.
        modules = {id(m): m for _, m, _, _ in entries}
        self._load_hooks = [m.register_load_state_dict_post_hook(self._loaded)  # type: ignore[no-untyped-call]
                            for m in modules.values()]

    def _loaded(self, module: nn.Module, incompatible_keys: Any) -> None:
        self._dirty = True

    def refresh(self) -> None:
        """Check every entry's tensors at the next read (the source switched or probed modules)."""
        self._dirty = True

    def close(self) -> None:
        for handle in self._load_hooks:
            handle.remove()
        self._load_hooks = []

    def _state_for_read(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """TE's tensors, checked in full when flagged, else ``_VERIFY_PER_READ`` entries in rotation."""
        metas = self._metas
        if metas is None or self._dirty or not self._hists:
            self._dirty = False
            return self.live_state()
        lo = self._cursor
        hi = lo + _VERIFY_PER_READ
        self._cursor = hi if hi < len(metas) else 0
        try:  # C-level loops over a fixed-size window
            states = list(map(dict.get, metas[lo:hi], self._keys[lo:hi]))
            same = all(map(is_, map(getattr, states, repeat("amax_history")), self._hists[lo:hi])) and \
                all(map(is_, map(getattr, states, repeat("scale")), self._scales[lo:hi]))
        except (AttributeError, TypeError):  # a state is gone: the checked path says which
            same = False
        return (self._hists, self._scales) if same else self.live_state()

    def live_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """TE's amax histories and scales of every entry (raises if TE dropped one)."""
        if self._metas is not None and self._hists:
            try:  # C-level loops: a few tenths of a microsecond per module
                states = list(map(dict.get, self._metas, self._keys))
                same = all(map(is_, map(getattr, states, repeat("amax_history")), self._hists)) and \
                    all(map(is_, map(getattr, states, repeat("scale")), self._scales))
            except (AttributeError, TypeError):  # a state is gone: the checked path below says which
                same = False
            if same:
                return self._hists, self._scales
        hists: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for name, m, kind, side in self.entries:
            st = state_of(m, kind, side)
            hist, scale = getattr(st, "amax_history", None), getattr(st, "scale", None)
            if not isinstance(hist, torch.Tensor) or not isinstance(scale, torch.Tensor):
                raise RuntimeError(f"te source: the delayed-scaling state of {name} is gone (recipe changed or "
                                   "FP8 state reset after attach); attach a new Monitor")
            hists.append(hist)
            scales.append(scale)
        self._hists, self._scales, self._gather = hists, scales, None
        self._version += 1
        return hists, scales

    def live_scale(self, col: Column) -> torch.Tensor:
        """The scale TE's next cast of ``col`` uses (a view of TE's own ``scale`` slot)."""
        scale: torch.Tensor = state_of(col.module, col.kind, col.side).scale
        return scale[col.slot:col.slot + 1]

    def _plan_for(self, hists: list[torch.Tensor]) -> _Plan:
        key = tuple(int(h.shape[0]) for h in hists)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        # Built at attach, and again only if TE reallocates a history with a new length
        # (adjust_amax_history_length): the small host-to-device copies below happen then only.
        by_len: dict[int, list[int]] = {}
        for e, length in enumerate(key):
            by_len.setdefault(length, []).append(e)
        sizes = [int(s.numel()) for s in self._scales]
        groups: list[tuple[int, list[int], int, int, torch.Tensor | None]] = []
        order: list[int] = []
        offset: dict[int, int] = {}
        start = 0
        for length, members in by_len.items():
            end = start
            for e in members:
                offset[e] = end
                end += sizes[e]
                order.append(e)
            groups.append((length, members, start, end, None))
            start = end
        per_pos_max = [1.0] * start
        per_pos_div = [1.0] * start
        for c in self._columns:
            per_pos_max[offset[c.entry] + c.slot] = c.spec.fp8_max
            per_pos_div[offset[c.entry] + c.slot] = 2.0 ** c.margin
        fp8_max = torch.tensor(per_pos_max, dtype=torch.float32, device=self._device)
        div = torch.tensor(per_pos_div, dtype=torch.float32, device=self._device)
        groups = [(length, members, s, e, div[s:e] if length == 1 else None)
                  for length, members, s, e, _ in groups]
        index = torch.tensor([offset[c.entry] + c.slot for c in self._columns], dtype=torch.long,
                             device=self._device)
        plan = _Plan(groups=groups, order=order, index=index, fp8_max=fp8_max)
        self._plans[key] = plan
        return plan

    def _point_table(self, hists: list[torch.Tensor], scales: list[torch.Tensor]) -> bool:
        """Point the gather table at TE's current tensors (once per reallocation); False where
        the table cannot read them (not float32 on the reader's device) or cannot be re-pointed now."""
        table = self._table
        if table is None:
            return False
        if self._table_version == self._version:
            return True
        ok = all(t.dtype == torch.float32 and t.device == self._device for t in (*hists, *scales)) and \
            all(h.dim() == 2 for h in hists) and all(s.dim() == 1 for s in scales)
        if not ok:
            return False
        cols = self._columns
        history_at = [hists[c.entry].data_ptr() + c.slot * hists[c.entry].stride(1) * _FLOAT32_BYTES for c in cols]
        lengths = [int(hists[c.entry].shape[0]) for c in cols]
        strides = [int(hists[c.entry].stride(0)) for c in cols]
        scale_at = [scales[c.entry].data_ptr() + c.slot * scales[c.entry].stride(0) * _FLOAT32_BYTES for c in cols]
        if not table.point(history_at, lengths, strides, scale_at):
            return False
        self._table_version = self._version
        return True

    def read(self, out: torch.Tensor) -> None:
        """Rows AMAX, SCALE and HISTORY_MAX of ``out``: one launch (Triton) or a fixed number of
        device ops, no sync."""
        hists, scales = self._state_for_read()
        if self._point_table(hists, scales):
            assert self._table is not None
            keep = self.fp8_mask if self.fp8_mask is not None else self._keep
            self._table(out, in_use=self._scale_in_use, keep=keep, rows=(AMAX, SCALE, HISTORY_MAX))
            return
        gather = self._gather
        if gather is None:
            plan = self._plan_for(hists)
            gather = self._gather = _Gather(plan=plan, scales=[scales[e] for e in plan.order],
                                            hists=[[hists[e] for e in members] for _, members, *_ in plan.groups])
        plan = gather.plan
        scale_now = torch.cat(gather.scales) if len(gather.scales) > 1 else gather.scales[0]
        latest: list[torch.Tensor] = []
        hmax: list[torch.Tensor] = []
        for (length, _, start, end, div), group in zip(plan.groups, gather.hists, strict=True):
            if length == 1:
                # TE zeroes the only row right after using it: recover the amax from the new scale.
                assert div is not None
                derived = plan.fp8_max[start:end] / (scale_now[start:end] * div)
                latest.append(derived)
                hmax.append(derived)
                continue
            h = torch.cat(group, dim=1) if len(group) > 1 else group[0]
            latest.append(h[-1])
            hmax.append(h.amax(dim=0))
        all_latest = torch.cat(latest) if len(latest) > 1 else latest[0]
        all_hmax = torch.cat(hmax) if len(hmax) > 1 else hmax[0]
        torch.index_select(all_latest, 0, plan.index, out=out[AMAX])
        torch.index_select(all_hmax, 0, plan.index, out=out[HISTORY_MAX])
        out[SCALE].copy_(self._scale_in_use)
        torch.index_select(scale_now, 0, plan.index, out=self._scale_in_use)
        if self.fp8_mask is not None:
            # A module in BF16 measures nothing, but TE keeps its old history rows (the outlier
            # that caused the fallback among them): report no amax rather than a stale one.
            out[AMAX].mul_(self.fp8_mask)
            out[HISTORY_MAX].mul_(self.fp8_mask)
