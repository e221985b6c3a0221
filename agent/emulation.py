"""CPU (and any-device) emulation of Transformer Engine's DelayedScaling FP8 recipe for ``nn.Linear``.

Usage::

    emu = emulate_fp8(model, EmulationConfig(amax_history_len=16))
    for batch in data:
        loss = loss_fn(model(batch))
        loss.backward()
        emu.update()          # once per forward/backward pair, see Fp8Emulation.update
        opt.step(); opt.zero_grad()

Under a :class:`~fp8guard.agent.Monitor` the ``emu.update()`` line is not needed: ``monitor.step``
closes the step itself when the loop has not (no FP8 forward since the last update), as TE does
at the end of its autocast and backward. Call it before ``monitor.step`` or not at all.

Numerics per emulated linear (same slot layout as TE):

* forward slots ``[input, weight, output]``, backward slots ``[grad_output, grad_input]``.
* forward: amax(input), amax(weight) are max-accumulated into history row 0, input and weight are
  cast to FP8 (E4M3) with the *current* scale, the GEMM runs on the dequantized values in float32
  and the bias is added in float32 (TE's GEMM accumulates in fp32 and adds bias in the epilogue).
* backward: amax(grad_output) is recorded, grad_output is cast (E5M2 for "hybrid", E4M3 for
  "e4m3"), dgrad/wgrad use the FP8 operands, the bias gradient uses the unquantized grad_output.
* the output and grad_input slots stay unused (TE without FP8 outputs): their history stays zero
  and their scale stays 1.

Nothing on the per-step path syncs with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .fp8 import (
    AmaxComputeAlgo,
    Fp8Format,
    compute_scale,
    count_overflow_underflow,
    dequantize,
    nan_ignoring_amax,
    quantize,
    update_amax_history,
)

__all__ = [
    "BWD_SLOTS",
    "FWD_SLOTS",
    "EmulationConfig",
    "Fp8EmulatedLinear",
    "Fp8Emulation",
    "emulate_fp8",
    "update_fp8_state",
]

FWD_SLOTS: tuple[str, ...] = ("input", "weight", "output")
"""Forward slot names, in buffer order (TE: GEMM1_INPUT, GEMM1_WEIGHT, GEMM1_OUTPUT)."""
BWD_SLOTS: tuple[str, ...] = ("grad_output", "grad_input")
"""Backward slot names, in buffer order (TE: GRAD_OUTPUT1, GRAD_INPUT1)."""

_FP8_BUFFERS = ("fp8_scale_fwd", "fp8_amax_history_fwd", "fp8_scale_bwd", "fp8_amax_history_bwd")
_FP8_FORMATS = ("hybrid", "e4m3")


@dataclass(kw_only=True, slots=True)
class EmulationConfig:
    """Knobs of the emulated DelayedScaling recipe (names and defaults follow TE)."""

    margin: int = 0
    """Scale is ``fp8_max / amax / 2**margin``; a larger margin leaves more headroom."""
    amax_history_len: int = 1024
    """Rows of amax history kept per slot (TE default 1024)."""
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    """How the history reduces to one amax: max over all rows, or the most recent step only."""
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    """"hybrid": E4M3 forward, E5M2 backward (TE's HYBRID); "e4m3": E4M3 everywhere."""
    module_filter: Callable[[str, nn.Linear], bool] | None = None
    """Called with (qualified name, module); return False to leave that Linear in high precision."""

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise ValueError(f"margin must be an int (power-of-two headroom), got {self.margin!r}")
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"amax_history_len must be an int >= 1 (TE's default is 1024), got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if self.fp8_format not in _FP8_FORMATS:
            given: object = self.fp8_format
            hint = " (TE does not support E5M2 in the forward pass)" if given == "e5m2" else ""
            raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {given!r}{hint}")
        if self.module_filter is not None and not callable(self.module_filter):
            raise ValueError("module_filter must be a callable (name, module) -> bool, or None")

    @property
    def fwd_format(self) -> Fp8Format:
        """FP8 format of the forward casts (always E4M3)."""
        return Fp8Format.E4M3

    @property
    def bwd_format(self) -> Fp8Format:
        """FP8 format of the backward casts (E5M2 for "hybrid")."""
        return Fp8Format.E5M2 if self.fp8_format == "hybrid" else Fp8Format.E4M3


class _Fp8LinearFn(torch.autograd.Function):
    """Emulated FP8 GEMMs of one linear; the module carries the FP8 metadata buffers."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Fp8EmulatedLinear,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        fmt = module.fwd_format
        # Copies, not views: the backward must dequantize with the scales used here even if
        # update() runs in between (TE saves scale_inv with the FP8 tensors for the same reason).
        s_x = module.fp8_scale_fwd[0].clone()
        s_w = module.fp8_scale_fwd[1].clone()
        with torch.no_grad():
            row0 = module.fp8_amax_history_fwd[0, :2]
            amax = torch.stack((nan_ignoring_amax(x), nan_ignoring_amax(weight)))
            # Max-accumulate like TE's atomicMax, so repeated forwards within a step (gradient
            # checkpointing, several micro-batches) keep the largest value.
            row0.copy_(torch.maximum(row0, amax))
            if module.collect_counts:
                counts = torch.stack(
                    (count_overflow_underflow(x, s_x, fmt), count_overflow_underflow(weight, s_w, fmt))
                )
                module.fp8_counts_fwd[:2].add_(counts)
            xq = quantize(x, s_x, fmt)
            wq = quantize(weight, s_w, fmt)
        with torch.autocast(x.device.type, enabled=False):
            out = F.linear(dequantize(xq, s_x), dequantize(wq, s_w))
            if bias is not None:
                out = out + bias.to(torch.float32)
        # Keep the FP8 operands (1 byte/elem) like TE, not the dequantized float32 copies.
        ctx.save_for_backward(xq, wq, s_x, s_w)
        ctx.module = module
        ctx.x_dtype = x.dtype
        ctx.has_bias = bias is not None
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xq, wq, s_x, s_w = ctx.saved_tensors
        module: Fp8EmulatedLinear = ctx.module
        fmt = module.bwd_format
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.no_grad(), torch.autocast(grad_out.device.type, enabled=False):
            s_g = module.fp8_scale_bwd[0].clone()
            slot = module.fp8_amax_history_bwd[0, :1]
            slot.copy_(torch.maximum(slot, nan_ignoring_amax(grad_out).reshape(1)))
            if module.collect_counts:
                module.fp8_counts_bwd[0].add_(count_overflow_underflow(grad_out, s_g, fmt))
            g = dequantize(quantize(grad_out, s_g, fmt), s_g)
            grad_x = grad_w = grad_b = None
            if need_x:
                grad_x = (g @ dequantize(wq, s_w)).to(ctx.x_dtype)
            if need_w:
                g2 = g.reshape(-1, g.shape[-1])
                x2 = dequantize(xq, s_x).reshape(-1, xq.shape[-1])
                grad_w = (g2.t() @ x2).to(module.weight.dtype)
            if need_b and ctx.has_bias:
                # TE computes the bias gradient from the high-precision grad_output.
                gb = grad_out.to(torch.float32).reshape(-1, grad_out.shape[-1]).sum(0)
                grad_b = gb.to(cast(torch.Tensor, module.bias).dtype)
        return grad_x, grad_w, grad_b, None, None


class Fp8EmulatedLinear(nn.Module):
    """Drop-in replacement for an ``nn.Linear`` that emulates TE's DelayedScaling FP8 GEMMs.

    The wrapped linear's ``weight``/``bias`` Parameter objects are reused, so optimizers built
    before the swap keep working and ``state_dict`` keeps the keys ``weight`` and ``bias``, plus the
    FP8 metadata buffers ``fp8_scale_fwd`` [3], ``fp8_amax_history_fwd`` [L, 3], ``fp8_scale_bwd``
    [2], ``fp8_amax_history_bwd`` [L, 2]. Loading a state_dict without the FP8 buffers (e.g. a
    plain nn.Linear checkpoint) leaves the current FP8 state untouched instead of failing.

    Attributes ``fp8_enabled`` (False: plain high-precision ``F.linear``, no casts, no amax) and
    ``collect_counts`` (True: accumulate exact overflow/underflow counts per slot into the
    non-persistent int64 buffers ``fp8_counts_fwd`` [3, 2] and ``fp8_counts_bwd`` [2, 2], columns
    ``[overflow, underflow]``) are plain Python bools, read without touching the device.
    """

    fp8_scale_fwd: torch.Tensor
    fp8_amax_history_fwd: torch.Tensor
    fp8_scale_bwd: torch.Tensor
    fp8_amax_history_bwd: torch.Tensor
    fp8_counts_fwd: torch.Tensor
    fp8_counts_bwd: torch.Tensor
    _fp8_last_amax_fwd: torch.Tensor
    _fp8_last_amax_bwd: torch.Tensor
    bias: nn.Parameter | None

    def __init__(
        self,
        linear: nn.Linear,
        *,
        amax_history_len: int = 1024,
        fwd_format: Fp8Format = Fp8Format.E4M3,
        bwd_format: Fp8Format = Fp8Format.E5M2,
        margin: int = 0,
        amax_compute_algo: AmaxComputeAlgo = "max",
    ) -> None:
        super().__init__()
        if amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {amax_history_len}")
        self.margin = margin
        self.amax_compute_algo: AmaxComputeAlgo = amax_compute_algo
        self.fp8_forwards = 0
        """Training forwards in FP8 since the last scale update (a host counter, no device work):
        nonzero means this step is still open (:func:`update_fp8_state` closes it)."""
        self.fp8_forwards_total = 0
        """Training forwards in FP8 since construction (telemetry's "does it run at all" check)."""
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # Same Parameter objects, not copies: optimizer param groups and tied weights stay valid.
        self.weight = linear.weight
        self.bias = linear.bias
        self.fwd_format = Fp8Format(fwd_format)
        self.bwd_format = Fp8Format(bwd_format)
        self.fp8_enabled = True
        self.collect_counts = False
        kw: dict[str, Any] = {"device": linear.weight.device, "dtype": torch.float32}
        nf, nb = len(FWD_SLOTS), len(BWD_SLOTS)
        self.register_buffer("fp8_scale_fwd", torch.ones(nf, **kw))
        self.register_buffer("fp8_amax_history_fwd", torch.zeros(amax_history_len, nf, **kw))
        self.register_buffer("fp8_scale_bwd", torch.ones(nb, **kw))
        self.register_buffer("fp8_amax_history_bwd", torch.zeros(amax_history_len, nb, **kw))
        ckw: dict[str, Any] = {"device": linear.weight.device, "dtype": torch.int64}
        # Telemetry accumulators and the L == 1 last-amax copy are not model state: non-persistent.
        self.register_buffer("fp8_counts_fwd", torch.zeros(nf, 2, **ckw), persistent=False)
        self.register_buffer("fp8_counts_bwd", torch.zeros(nb, 2, **ckw), persistent=False)
        self.register_buffer("_fp8_last_amax_fwd", torch.zeros(nf, **kw), persistent=False)
        self.register_buffer("_fp8_last_amax_bwd", torch.zeros(nb, **kw), persistent=False)

    # -- accessors used by telemetry -------------------------------------------------------------
    @property
    def amax_history_fwd(self) -> torch.Tensor:
        """Forward amax history buffer [L, 3]; row 0 is this step's staging row."""
        return self.fp8_amax_history_fwd

    @property
    def amax_history_bwd(self) -> torch.Tensor:
        """Backward amax history buffer [L, 2]; row 0 is this step's staging row."""
        return self.fp8_amax_history_bwd

    @property
    def scale_fwd(self) -> torch.Tensor:
        """Forward scales [3] (input, weight, output)."""
        return self.fp8_scale_fwd

    @property
    def scale_bwd(self) -> torch.Tensor:
        """Backward scales [2] (grad_output, grad_input)."""
        return self.fp8_scale_bwd

    @property
    def last_amax_fwd(self) -> torch.Tensor:
        """Amax of the latest completed step [3]: history row -1 after the roll."""
        # With L == 1 the roll zeroes the only row, so update() keeps a copy aside.
        h = self.fp8_amax_history_fwd
        return h[-1] if h.shape[0] > 1 else self._fp8_last_amax_fwd

    @property
    def last_amax_bwd(self) -> torch.Tensor:
        """Amax of the latest completed step [2]: history row -1 after the roll."""
        h = self.fp8_amax_history_bwd
        return h[-1] if h.shape[0] > 1 else self._fp8_last_amax_bwd

    # -- state management ------------------------------------------------------------------------
    @torch.no_grad()
    def reset_fp8_state(self) -> None:
        """Zero the amax histories and set all scales to 1 (TE's initial state)."""
        self.fp8_amax_history_fwd.zero_()
        self.fp8_amax_history_bwd.zero_()
        self.fp8_scale_fwd.fill_(1.0)
        self.fp8_scale_bwd.fill_(1.0)
        self._fp8_last_amax_fwd.zero_()
        self._fp8_last_amax_bwd.zero_()

    @torch.no_grad()
    def reset_counts(self) -> None:
        """Zero the overflow/underflow accumulators."""
        self.fp8_counts_fwd.zero_()
        self.fp8_counts_bwd.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled():  # a training forward (not a no-grad probe or evaluation)
            self.fp8_forwards += 1
            self.fp8_forwards_total += 1
        out_dtype = x.dtype
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            # Mirror nn.Linear under autocast: the activation runs in the autocast dtype.
            out_dtype = torch.get_autocast_dtype(dev)
            x = x.to(out_dtype)
        out = _Fp8LinearFn.apply(x, self.weight, self.bias, self, out_dtype)  # type: ignore[no-untyped-call]
        return cast(torch.Tensor, out)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8EmulatedLinear:
        # model.to(torch.bfloat16) / .half() would also cast the FP8 metadata; TE keeps it in float32
        # whatever the parameter dtype. Keep the exact float32 values and only follow device moves.
        keep = {n: b for n, b in self._buffers.items() if b is not None and b.dtype == torch.float32}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for name, old in keep.items():
            new = self._buffers[name]
            if new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A checkpoint of the un-emulated model has no FP8 metadata; keep ours rather than fail.
        absent = {prefix + name for name in _FP8_BUFFERS} - state_dict.keys()
        missing_keys[:] = [k for k in missing_keys if k not in absent]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fwd={self.fwd_format.value}, bwd={self.bwd_format.value}, "
            f"history={self.fp8_amax_history_fwd.shape[0]}, fp8_enabled={self.fp8_enabled}"
        )


def _is_plain_linear(m: nn.Module) -> bool:
    # Only modules whose forward *is* nn.Linear.forward: a subclass overriding forward (LoRA, ...)
    # would lose its behaviour. MultiheadAttention's out_proj never has its forward called (MHA
    # reads .weight directly), so swapping it would silently emulate nothing.
    return (
        isinstance(m, nn.Linear)
        and not isinstance(m, NonDynamicallyQuantizableLinear)
        and type(m).forward is nn.Linear.forward
    )


class Fp8Emulation:
    """Handle on a model whose Linear layers were swapped for ``Fp8EmulatedLinear``.

    Build it with :meth:`apply` (or :func:`emulate_fp8`); call :meth:`update` once per step.
    """

    def __init__(self, config: EmulationConfig, modules: list[tuple[str, Fp8EmulatedLinear]]) -> None:
        """Internal: use :meth:`apply`."""
        self._config = config
        self._modules = modules
        self._by_name = dict(modules)

    @classmethod
    def apply(cls, model: nn.Module, config: EmulationConfig | None = None) -> Fp8Emulation:
        """Swap every matching ``nn.Linear`` inside ``model`` (in place) and return the handle.

        The module objects are replaced in their parents (every parent, if one Linear is shared);
        weight/bias Parameters are reused. Hooks registered on the original Linear modules are not
        carried over. Raises ValueError if nothing matched.
        """
        cfg = config if config is not None else EmulationConfig()
        if isinstance(model, Fp8EmulatedLinear) or _is_plain_linear(model):
            raise ValueError(
                "model is itself a Linear and cannot be replaced in place; wrap it in a container "
                "(e.g. nn.Sequential(linear)) before calling emulate_fp8"
            )
        wrappers: dict[int, Fp8EmulatedLinear] = {}
        named: list[tuple[str, Fp8EmulatedLinear]] = []
        for name, mod in model.named_modules():
            if not _is_plain_linear(mod):
                continue
            lin = cast(nn.Linear, mod)
            if cfg.module_filter is not None and not cfg.module_filter(name, lin):
                continue
            wrapper = Fp8EmulatedLinear(
                lin,
                amax_history_len=cfg.amax_history_len,
                fwd_format=cfg.fwd_format,
                bwd_format=cfg.bwd_format,
                margin=cfg.margin,
                amax_compute_algo=cfg.amax_compute_algo,
            )
            wrapper.train(lin.training)
            wrappers[id(lin)] = wrapper
            named.append((name, wrapper))
        if not named:
            n_lin = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
            why = "module_filter rejected all of them" if n_lin else "the model has none"
            raise ValueError(
                f"no nn.Linear was converted ({n_lin} found; {why}); pass a model with nn.Linear "
                "layers or relax EmulationConfig.module_filter"
            )
        # remove_duplicate=False visits every parent of a shared Linear, so all references move.
        for _, parent in model.named_modules(remove_duplicate=False):
            for child_name, child in list(parent.named_children()):
                if id(child) in wrappers:
                    setattr(parent, child_name, wrappers[id(child)])
        return cls(cfg, named)

    @property
    def config(self) -> EmulationConfig:
        """The configuration the model was converted with."""
        return self._config

    def modules(self) -> list[tuple[str, Fp8EmulatedLinear]]:
        """(qualified name, module) of every emulated linear, in ``named_modules`` order."""
        return list(self._modules)

    def _select(self, names: Iterable[str] | None) -> Iterator[Fp8EmulatedLinear]:
        if names is None:
            yield from (m for _, m in self._modules)
            return
        if isinstance(names, str):
            raise ValueError(f"names must be an iterable of module names, not a single string {names!r}")
        wanted = list(names)
        unknown = [n for n in wanted if n not in self._by_name]
        if unknown:
            known = ", ".join(sorted(self._by_name)[:10])
            raise ValueError(f"unknown emulated module(s) {unknown}; known names include: {known}")
        yield from (self._by_name[n] for n in wanted)

    def set_fp8(self, names: Iterable[str] | None, enabled: bool) -> None:
        """Switch FP8 emulation on/off per module (``names=None``: all). Off means plain F.linear.

        Turning a module back on keeps its (possibly stale) scales; call :meth:`reset_fp8_state`
        on re-promotion.
        """
        for m in list(self._select(names)):
            m.fp8_enabled = bool(enabled)

    def reset_fp8_state(self, names: Iterable[str] | None = None) -> None:
        """Zero amax histories and reset scales to 1 for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.reset_fp8_state()

    def set_collect_counts(self, enabled: bool, names: Iterable[str] | None = None) -> None:
        """Turn exact overflow/underflow counting on/off for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.collect_counts = bool(enabled)

    def reset_counts(self, names: Iterable[str] | None = None) -> None:
        """Zero the overflow/underflow accumulators for ``names`` (None: all)."""
        for m in list(self._select(names)):
            m.reset_counts()

    @torch.no_grad()
    def update(self) -> None:
        """Close the step: reduce each amax history, recompute scales, roll the histories.

        Call once after every backward (per micro-batch, to match TE, which updates at each
        ``fp8_autocast`` exit and at the end of each backward). Placement relative to
        ``optimizer.step()`` does not matter: only FP8 metadata changes. TE updates the forward
        state at autocast exit and the backward state at the end of backward; doing both here is
        equivalent because the backward dequantizes with scales saved in the forward. Modules with
        ``fp8_enabled=False`` are skipped (their state is frozen until re-promotion).

        All modules on a device are updated in one batched pass over concatenated buffers.
        """
        update_fp8_state(m for _, m in self._modules)


@torch.no_grad()
def update_fp8_state(modules: Iterable[Fp8EmulatedLinear]) -> None:
    """:meth:`Fp8Emulation.update` for any emulated linears (each with its own formats, margin
    and amax algorithm): reduce histories, recompute scales, roll; modules in high precision are
    skipped. Resets each module's ``fp8_forwards``. Device work only, batched per group."""
    groups: dict[tuple[Any, ...], list[Fp8EmulatedLinear]] = {}
    for m in modules:
        if not m.fp8_enabled:
            continue
        m.fp8_forwards = 0
        key = (m.fp8_scale_fwd.device, m.fp8_amax_history_fwd.shape[0], m.fwd_format, m.bwd_format,
               m.amax_compute_algo, m.margin)
        groups.setdefault(key, []).append(m)
    for mods in groups.values():
        first = mods[0]
        _update_group(mods, "fwd", first.fwd_format.fp8_max, first.amax_compute_algo, first.margin)
        _update_group(mods, "bwd", first.bwd_format.fp8_max, first.amax_compute_algo, first.margin)


def _update_group(mods: list[Fp8EmulatedLinear], direction: str, fp8_max: float, algo: AmaxComputeAlgo,
                  margin: int) -> None:
    hists = [cast(torch.Tensor, getattr(m, f"fp8_amax_history_{direction}")) for m in mods]
    scales = [cast(torch.Tensor, getattr(m, f"fp8_scale_{direction}")) for m in mods]
    # One [L, sum(slots)] history for the whole group: a handful of kernels instead of a handful
    # per module; the results are scattered back with one copy per buffer.
    history = torch.cat(hists, dim=1)
    amax = update_amax_history(history, algo)
    new_scale = compute_scale(amax, torch.cat(scales), fp8_max, margin)
    widths = [s.numel() for s in scales]
    single_row = history.shape[0] == 1
    for m, h, s, h_new, s_new, a in zip(
        mods,
        hists,
        scales,
        torch.split(history, widths, dim=1),
        torch.split(new_scale, widths),
        torch.split(amax, widths),
        strict=True,
    ):
        h.copy_(h_new)
        s.copy_(s_new)
        if single_row:
            # With one row the roll zeroes it; "max" and "most_recent" both equal that row.
            cast(torch.Tensor, getattr(m, f"_fp8_last_amax_{direction}")).copy_(a)


def emulate_fp8(model: nn.Module, config: EmulationConfig | None = None) -> Fp8Emulation:
    """Convert ``model``'s Linear layers to emulated FP8 in place; see :meth:`Fp8Emulation.apply`."""
    return Fp8Emulation.apply(model, config)
