"""Transformer Engine source: the model's TE modules as monitor columns (TE itself is imported by ``te_access``).

Usage (TE creates its FP8 state lazily, at a module's first FP8 forward, so run one training
step before attaching)::

    with te.autocast(enabled=True, recipe=recipe):
        loss = loss_fn(model(batch))
    loss.backward(); opt.step(); opt.zero_grad()          # warm-up step: FP8 state now exists
    monitor = Monitor(MonitorConfig(sources=["te"])).attach(model, opt)

Attaching before any FP8 forward raises :class:`ConfigError`. Modules found: ``te.Linear``,
``te.LayerNormLinear``, ``te.LayerNormMLP``, ``te.GroupedLinear`` (also inside
``te.TransformerLayer``) and ``te.ops.BasicLinear``. FP8 attention (``DotProductAttention``
with ``fp8_dpa``) is not monitored.

Columns (one :class:`TensorSpec` per FP8 GEMM operand):

* ``module`` is the qualified name in the model; for multi-GEMM modules a suffix names the
  GEMM: ``<name>.fc1`` / ``<name>.fc2`` for ``LayerNormMLP`` (TE's own ``QuantizerRole.name``
  convention), ``<name>.gemm<i>`` for ``GroupedLinear``.
* ``role`` is one of ``fwd_input``, ``fwd_weight``, ``fwd_output``, ``bwd_grad_output``,
  ``bwd_grad_input``: TE's slot layout (forward ``[input, weight, output]`` and backward
  ``[grad_output, grad_input]`` per GEMM), checked against ``get_quantizer_roles()``.
* formats and maxima come from the recipe (HYBRID: E4M3/448 forward, E5M2/57344 backward).

Recipes (one module per family, shared layout code in ``te_layout``, TE access in ``te_access``):

* ``DelayedScaling``: read from TE's own per-module state (:mod:`te_delayed`): AMAX the latest
  completed amax, SCALE the scale in use when it was measured, HISTORY_MAX the history's
  maximum. The output / grad_input slots are used only with ``fp8_output`` / ``fp8_grad``; with
  ``boundary_slots="auto"`` they are included when their history is nonzero at attach time.
* ``Float8CurrentScaling`` and ``Float8BlockScaling``: nothing persists in TE, so module hooks
  measure the operands they can reach with TE's own amax kernel (:mod:`te_hooks`,
  :mod:`te_current`); SCALE is TE's current-scaling formula of that amax.
* MXFP8, NVFP4 and CustomRecipe raise :class:`ConfigError` (see docs/gpu-te-source.md).

Exact counts (``arm_counts``): for the hook-reachable operands, ``count_overflow_underflow``
with the scale the cast uses (delayed: TE's live ``scale`` slot; current: the formula above);
other columns stay 0 (see :attr:`TESource.counted`). Not for Float8BlockScaling.

Nothing on the per-step path syncs with the host; hooks observe only FP8 forwards with grad
enabled (not eval passes, not BF16-fallback regions, not TE activation-recompute passes).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from fp8guard.agent.errors import ConfigError
from fp8guard.agent.fp8 import Fp8Format
from fp8guard.agent.sources.base import Source, TensorSpec
from fp8guard.agent.sources.te_access import inspect_importable, load_te
from fp8guard.agent.sources.te_current import HOOK_RECIPES, CurrentReader, current_columns, te_current_scale
from fp8guard.agent.sources.te_delayed import DelayedReader, Entry, delayed_columns
from fp8guard.agent.sources.te_hooks import HookObserver
from fp8guard.agent.sources.te_layout import Column, kind_of, recipe_family, state_of
from fp8guard.agent.sources.te_stale import FP8Sentinel

__all__ = ["BoundarySlots", "ExactCounts", "TESource", "discover", "te_current_scale"]

log = logging.getLogger("fp8guard.agent")

BoundarySlots = Literal["auto", "all", "none"]
"""Output / grad_input slots: ``auto`` keeps those whose history is nonzero at attach."""
ExactCounts = Literal["auto", "inspect", "hooks"]
"""How exact counts are taken; ``auto``: ``inspect`` where TE's debug tools import, else ``hooks``."""

_WARMUP_HINT = ("run one FP8 forward (inside te.autocast), ideally a whole training step, "
                "before Monitor.attach")


class TESource:
    """FP8 telemetry of a model's Transformer Engine modules. See the module docstring."""

    kind = "te"

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], *,
                 boundary_slots: BoundarySlots = "auto", exact_counts: ExactCounts = "auto") -> None:
        te = load_te(required=True)
        assert te is not None
        self._te = te
        if boundary_slots not in ("auto", "all", "none"):
            raise ConfigError(f"boundary_slots must be 'auto', 'all' or 'none', got {boundary_slots!r}")
        if exact_counts not in ("auto", "inspect", "hooks"):
            raise ConfigError(f"exact_counts must be 'auto', 'inspect' or 'hooks', got {exact_counts!r}")
        found = [(name, m, kind) for name, m in modules if (kind := kind_of(m, te)) is not None]
        if not found:
            raise ConfigError("te source: no Transformer Engine GEMM modules given")
        self._switchable = [(n, m) for n, m, _ in found]
        ready = [(n, m, k) for n, m, k in found if state_of(m, k, "fwd") is not None]
        if not ready:
            names = ", ".join(n or "<model>" for n, _, _ in found[:3])
            raise ConfigError(f"te source: the TE modules ({names}{', ...' if len(found) > 3 else ''}) have no "
                              f"FP8 state yet; {_WARMUP_HINT}")
        if len(ready) < len(found):
            log.warning("fp8guard: te source skips %d TE module(s) that never ran in FP8: %s",
                        len(found) - len(ready), ", ".join(n for n, m, k in found if state_of(m, k, "fwd") is None))
        families = {recipe_family(state_of(m, k, "fwd")) for _, m, k in ready}
        if len(families) > 1:
            raise ConfigError(f"te source: the modules use different recipes ({sorted(families)}); "
                              "one Monitor supports one recipe family")
        family = families.pop()
        recipe = state_of(ready[0][1], ready[0][2], "fwd").recipe
        self.recipe_name: str = type(recipe).__name__
        """The TE recipe class the source was built for, e.g. ``DelayedScaling``."""
        if family != "delayed" and family not in HOOK_RECIPES:
            raise ConfigError(
                f"te source: recipe {self.recipe_name} is not supported yet (supported: DelayedScaling, "
                "Float8CurrentScaling, Float8BlockScaling); see docs/gpu-te-source.md")
        self._block = family == "float8_block_scaling"
        entries: list[Entry] = []
        if family == "delayed":
            entries, self._columns = delayed_columns(ready, boundary_slots)
        else:
            self._columns = current_columns(ready, te, self.recipe_name)
        if not self._columns:
            raise ConfigError(f"te source: no FP8 operand of the TE modules can be observed under {self.recipe_name}")
        for i, c in enumerate(self._columns):
            c.index = i
        self._specs = [c.spec for c in self._columns]
        device = _device(entries, self._columns)
        self._delayed = DelayedReader(entries, self._columns, device) if family == "delayed" else None
        self._hooks = HookObserver(te, self._columns, device, measure=self._delayed is None,
                                   scale_of=self._count_scale)
        self._current = CurrentReader(self._columns, self._hooks, device) if self._delayed is None else None
        self._counts = self._hooks.counts
        self.exact_counts: Literal["inspect", "hooks"] = (
            "inspect" if exact_counts == "inspect" or (exact_counts == "auto" and not self._block
                                                       and inspect_importable(te))
            else "hooks")
        """How exact counts are taken: ``inspect`` (every operand, TE's tensor-inspection API and
        fp8guard's fused kernel) or ``hooks`` (module hooks: the operands they can reach)."""
        self._inspect: Any = None
        self._inspect_open = False
        self._inspect_layers: dict[str, nn.Module] = {}
        """TE debug layer name -> the module it belongs to (exact counts through inspection)."""
        if self.exact_counts == "inspect":
            from fp8guard.agent.sources import te_counts, te_inspect

            self._inspect = te_counts.InspectCounts(self._inspect_targets(te_inspect.TENSOR_NAMES), self._counts)
            order: dict[int, int] = {}
            self._inspect.module_of = {layer: order.setdefault(id(m), len(order))
                                       for layer, m in self._inspect_layers.items()}
            self._inspect.modules = list({id(m): m for m in self._inspect_layers.values()}.values())
            from fp8guard.agent.kernels import count_batch

            if count_batch.OPERANDS_PER_LAUNCH > 1:
                self._inspect.use_batch(count_batch.CountBatch(min(count_batch.OPERANDS_PER_LAUNCH,
                                                                   count_batch.BATCH_SLOTS)))
        self._hooks.sync()  # current/block scaling: the hooks are the measurement
        self._sentinel = FP8Sentinel(self._hooks, [m for _, m in self._switchable])
        """Armed by the Monitor's first ``prepare_step``: did any TE module run in FP8 since?"""

    def _count_scale(self, col: Column, amax: torch.Tensor | None) -> torch.Tensor:
        """The scale of a cast being counted: TE's live slot (delayed), the formula (current)."""
        if self._delayed is not None:
            return self._delayed.live_scale(col)
        assert amax is not None
        return te_current_scale(amax, col.spec.fp8_max, col.pow2, col.eps)

    def _live_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """TE's delayed-scaling histories and scales (empty lists under hook-measured recipes)."""
        return self._delayed.live_state() if self._delayed is not None else ([], [])

    # -- Source protocol ---------------------------------------------------------------------------

    def tensors(self) -> Sequence[TensorSpec]:
        return self._specs

    @property
    def counted(self) -> tuple[bool, ...]:
        """Per column: whether exact counts are measured (False: the count stays 0)."""
        if self._inspect is not None:
            indexes = {t.index for t in self._inspect.targets.values()}
            return tuple(c.index in indexes for c in self._columns)
        return tuple(c.hooked and not self._block for c in self._columns)

    def _inspect_targets(self, names: dict[str, str]) -> dict[tuple[str, str], tuple[int, Fp8Format]]:
        """(TE debug layer name, TE tensor name) -> (column, format) for every countable operand."""
        targets: dict[tuple[str, str], tuple[int, Fp8Format]] = {}
        owners: dict[str, str] = {}
        for c in self._columns:
            tensor_name = names.get(c.spec.role)
            if tensor_name is None or c.kind not in ("linear", "layernorm_linear", "layernorm_mlp"):
                continue  # GroupedLinear splits on the device; te.ops has no debug path
            te_name = getattr(c.module, "name", None)
            if not isinstance(te_name, str) or not te_name:
                raise ConfigError(f"te source: {c.spec.module} has no TE module name; exact counts need one "
                                  "(TE names modules itself unless name=None is forced)")
            qualified = c.spec.module[:-4] if c.kind == "layernorm_mlp" else c.spec.module
            if owners.setdefault(te_name, qualified) != qualified:
                raise ConfigError(f"te source: TE modules {owners[te_name]} and {qualified} share the name "
                                  f"{te_name!r}; exact counts tell operands apart by TE's module names: give "
                                  "them unique name= arguments")
            layer = te_name + (c.spec.module[-4:] if c.kind == "layernorm_mlp" else "")
            targets[(layer, tensor_name)] = (c.index, c.fmt)
            self._inspect_layers[layer] = c.module
        return targets

    def prepare_step(self, step: int, count_every: int, stagger_from: int | None = None) -> None:
        """Called by the Monitor before each step: the step number, the counting cadence (0: this
        rank never counts) and, for staggered counting, the step its schedule started from (a new
        value: the schedule restarted, after a rollback or a cadence change, and counts of an
        unfinished window are dropped). Opens TE's debug session the first time counting is due."""
        self._sentinel.arm()
        counter = self._inspect
        if counter is None:
            return
        if count_every > 0 and not self._inspect_open:
            from fp8guard.agent.sources import te_inspect

            te_inspect.attach(counter)
            self._inspect_open = True
        changed = count_every != counter.every or stagger_from != counter.stagger_from
        if stagger_from != counter.stagger_from and counter.stagger_from is not None:
            counter.drop()  # operands held for a batched launch, of the abandoned window
            self._counts.zero_()  # a window the restart abandoned
        counter.flush()  # what a batch still holds, before TE rewrites a weight's cached FP8 copy
        counter.every = count_every
        counter.stagger_from = stagger_from
        if self._inspect_open and counter.owning:
            from fp8guard.agent.sources import te_inspect

            # A new cadence invalidates the 'next debug iteration' TE cached from the old one.
            te_inspect.set_iteration(step, self._switchable, requery=changed)
        counter.step = step
        counter.sync_hooks()

    def read(self, out: torch.Tensor) -> None:
        with torch.no_grad():  # plain reads of TE's buffers, whatever the caller's grad mode
            if self._delayed is not None:
                self._delayed.read(out)
            else:
                assert self._current is not None
                self._current.read(out)

    @property
    def staggers_counts(self) -> bool:
        """Whether counts can be staggered over an interval (``MonitorConfig.count_stagger``):
        through TE's inspection API in a debug session fp8guard owns (it sets the iterations that
        stagger the modules); a session the training script opened counts every module at once."""
        if self._inspect is None:
            return False
        if self._inspect_open:
            return bool(self._inspect.owning)
        from fp8guard.agent.sources import te_inspect

        return te_inspect.owns_session()

    @property
    def supports_counts(self) -> bool:
        if self._inspect is not None:
            return bool(self._inspect.targets)
        return not self._block and any(c.hooked for c in self._columns)

    def arm_counts(self, enabled: bool) -> None:
        if self._inspect is not None:
            self._inspect.armed = enabled and self._inspect_open and self.supports_counts
            self._inspect.sync_hooks()
            return
        self._hooks.counting = enabled and self.supports_counts
        if self._delayed is not None:
            # Under delayed scaling the hooks only count: present on counted steps alone (and
            # while the sentinel watches), so the other steps' forwards run no per-module code.
            self._hooks.sync()

    def read_counts(self, out: torch.Tensor) -> None:
        if self._inspect is not None:
            self._inspect.flush()  # operands held for a batched launch
        out.copy_(self._counts.t())
        self._counts.zero_()

    def set_fp8(self, modules: Sequence[str] | None, enabled: bool) -> None:
        """BF16 fallback (``enabled=False``) or re-promotion of TE modules (None: all of them).

        Fallback wraps the module's forward in a nested ``te.autocast(enabled=False)`` (TE
        saves and restores the outer autocast state, so nesting is supported). Re-promotion
        removes the wrapper and calls TE's ``reset_fp8_meta_tensors()``: while in BF16 the
        module's history only rolled zeros, so its scale is stale (frozen at the pre-fallback
        window) and must not be reused. A name may also be a GEMM of a module
        (``<module>.fc1``): the whole module switches, as TE switches precision per module.
        """
        wanted = None if modules is None else set(modules)
        for name, module in self._switchable:
            if wanted is not None and not any(w == name or w.startswith(name + ".") for w in wanted):
                continue
            self._switch(module, enabled, reset=True)
        self._update_fp8_mask()
        self._route_counts()
        if self._delayed is not None:
            self._delayed.refresh()  # TE's reset copies in place today; the next read checks every entry anyway

    def _switch(self, module: nn.Module, enabled: bool, *, reset: bool) -> None:
        wrapped = "_fp8guard_forward" in module.__dict__
        if not enabled and not wrapped:
            original = module.forward
            autocast = self._te.autocast

            def forward(*args: Any, _original: Any = original, _autocast: Any = autocast, **kwargs: Any) -> Any:
                with _autocast(enabled=False):
                    return _original(*args, **kwargs)

            module.__dict__["_fp8guard_forward"] = original
            module.__dict__["forward"] = forward
        elif enabled and wrapped:
            del module.__dict__["forward"]
            del module.__dict__["_fp8guard_forward"]
            reset_meta = getattr(module, "reset_fp8_meta_tensors", None)
            if reset and callable(reset_meta):
                reset_meta()

    def stale_reason(self) -> str | None:
        """Why TE's FP8 state has not changed since attach (checked once by the monitor after a
        few steps; host only), naming the fix; None when a TE module ran in FP8 meanwhile."""
        return self._sentinel.stale_reason(any_fp8=any(self.precision().values()))

    def precision(self) -> dict[str, bool]:
        return {name: "_fp8guard_forward" not in m.__dict__ for name, m in self._switchable}

    def settle(self, modules: Collection[str]) -> None:
        """TE updates forward scales itself when the probe forward's autocast exits."""

    @contextmanager
    def probe(self, fp8: Mapping[str, bool]) -> Iterator[None]:
        """Probe forwards run under ``no_grad`` (this source's hooks skip them). Under delayed
        scaling the autocast a probe forward enters updates TE's amax histories and scales when it
        exits: they are cloned before and copied back after (a few device copies, no sync).
        Counting is disarmed meanwhile, and no module's FP8 state is reset by the switching."""
        saved = [(h, h.clone()) for pair in zip(*self._live_state(), strict=True) for h in pair]
        mask, armed = self._fp8_mask, (self._inspect.armed if self._inspect is not None else None)
        before = self.precision()
        if self._inspect is not None:
            self._inspect.flush()
            self._inspect.armed, self._inspect.held = False, True
        try:
            for name, module in self._switchable:
                if name in fp8:
                    # a trial (a module held in BF16, tried in FP8) starts fresh, as a re-promotion would
                    self._switch(module, fp8[name], reset=fp8[name] and not before[name])
            self._route_counts()
            yield
        finally:
            for name, module in self._switchable:
                self._switch(module, before[name], reset=False)
            self._route_counts()
            with torch.no_grad():
                for live, copy in saved:
                    live.copy_(copy)
            self._fp8_mask = mask
            if self._inspect is not None and armed is not None:
                self._inspect.armed, self._inspect.held = armed, False
            if self._delayed is not None:
                self._delayed.refresh()

    @property
    def _fp8_mask(self) -> torch.Tensor | None:
        return self._delayed.fp8_mask if self._delayed is not None else None

    @_fp8_mask.setter
    def _fp8_mask(self, mask: torch.Tensor | None) -> None:
        if self._delayed is not None:
            self._delayed.fp8_mask = mask

    def _update_fp8_mask(self) -> None:
        in_bf16 = {id(m) for _, m in self._switchable if "_fp8guard_forward" in m.__dict__}
        if not in_bf16:
            self._fp8_mask = None
            return
        flags = [0.0 if id(c.module) in in_bf16 else 1.0 for c in self._columns]
        # a host-to-device copy at a fallback or promotion only, never per step
        self._fp8_mask = torch.tensor(flags, dtype=torch.float32, device=self._hooks.amax.device)

    def _route_counts(self) -> None:
        """Keep the modules running in BF16 off TE's debug path (see ``InspectCounts.high_precision``):
        their layers are never counted, and every module asks TE's routing question again at its
        next forward, so a switch made mid-iteration (a probe) takes effect at once."""
        if self._inspect is None:
            return
        self._inspect.high_precision = frozenset(
            layer for layer, m in self._inspect_layers.items() if "_fp8guard_forward" in m.__dict__)
        if self._inspect_open:
            from fp8guard.agent.sources import te_inspect

            te_inspect.requery(self._switchable)

    def stop_counting(self) -> None:
        """Leave TE's debug path for good (monitor closed or switched off): TE is told that no
        counting is ever due again, so its layers stay on the normal fused path."""
        if self._inspect is not None and self._inspect_open:
            from fp8guard.agent.sources import te_inspect

            te_inspect.detach(self._inspect)
            self._inspect_open = False
            if self._inspect.owning:
                te_inspect.bump_iteration(self._switchable)

    def close(self) -> None:
        """Remove the module hooks (the source reads nothing afterwards)."""
        self._hooks.remove()
        if self._inspect is not None:
            self._inspect.use_batch(None)
        self._sentinel.remove()
        if self._delayed is not None:
            self._delayed.close()
        self.stop_counting()


def _device(entries: Sequence[Entry], columns: Sequence[Column]) -> torch.device:
    for _, m, _, _ in entries:
        for p in m.parameters():
            return p.device
    for c in columns:
        for p in c.module.parameters():
            return p.device
    return torch.device("cuda")


def discover(model: nn.Module, *, required: bool, boundary_slots: BoundarySlots = "auto",
             exact_counts: ExactCounts = "auto") -> Source | None:
    """A source over the model's TE modules, or None when the model has none.

    Raises :class:`SourceUnavailable` when ``required`` and TE cannot be imported, and
    :class:`ConfigError` when the model has TE modules but no FP8 state yet (run one FP8 step
    first) or uses a recipe this source does not support.
    """
    te = load_te(required)
    if te is None:
        return None
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if kind_of(m, te) is not None:
            found.append((name, m))
        elif isinstance(m, te.skipped) and "scaling_fwd" in (getattr(m, "fp8_meta", None) or {}):
            log.info("fp8guard: te source does not monitor FP8 attention (%s)", name)
    if not found:
        return None
    return TESource(found, boundary_slots=boundary_slots, exact_counts=exact_counts)
