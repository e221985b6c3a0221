"""``Tripwire``: a device-side check of every step's telemetry that tells the host, one step
later and without a sync, that something is wrong right now.

Per step it enqueues a few scalar ops on the device: a non-finite loss or gradient norm, a loss
or gradient norm far above its running baseline (exponential averages kept on the device), or a
saturation ratio far above the FP8 maximum. The verdict is copied non-blocking into pinned host
memory and an event is recorded; at the next step the host looks with ``event.query()`` (no
wait) and, if it fired, the monitor flushes at once and listens for the service's decision, so a
command can apply two steps after the anomaly instead of after the next flush.

The tripwire decides nothing: the service's rules do. It only makes the agent hurry.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["Tripwire"]

_EMA = 0.05


class Tripwire:
    """Checks written into device buffers; ``fired()`` reads the previous check on the host."""

    def __init__(self, device: torch.device, *, loss_factor: float, grad_factor: float, saturation: float,
                 warmup_steps: int, use_loss: bool = True) -> None:
        self.device = device
        self.loss_factor = float(loss_factor)
        self.grad_factor = float(grad_factor)
        self.saturation = float(saturation)
        self.warmup_steps = int(warmup_steps)
        self.use_loss = use_loss
        """Under torch.distributed only all-reduced quantities count (the gradient norm, TE's
        reduced amaxes): every rank then sees the tripwire fire at the same step."""
        self._baseline = torch.zeros(2, device=device)  # loss, grad norm averages
        self._seen = torch.zeros(2, device=device)
        cuda = device.type == "cuda"
        self._host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        # The verdict is read straight from this host word (no tensor call, so nothing that could
        # sync; the event says when the copy has landed).
        self._word = ctypes.c_int32.from_address(self._host.data_ptr())
        self._event: torch.cuda.Event | None = None
        self._pending: int | None = None
        self.fired_steps = 0

    def check(self, step: int, *, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
              saturation: torch.Tensor | None) -> None:
        """Enqueue the check of ``step`` (device tensors, any of them missing)."""
        trip = torch.zeros((), dtype=torch.bool, device=self.device)
        for k, value, factor in ((0, loss if self.use_loss else None, self.loss_factor),
                                 (1, grad_norm, self.grad_factor)):
            if value is None:
                continue
            x = value.detach().reshape(()).float()
            finite = torch.isfinite(x)
            warm = self._seen[k] >= self.warmup_steps
            jump = warm & (x > factor * self._baseline[k])
            trip = trip | ~finite | jump
            ok = finite & ~jump
            first = self._seen[k] == 0
            new = torch.where(first, x, self._baseline[k] + _EMA * (x - self._baseline[k]))
            self._baseline[k] = torch.where(ok, new, self._baseline[k])
            self._seen[k] = self._seen[k] + ok.float()
        if saturation is not None and saturation.numel():
            trip = trip | (torch.nan_to_num(saturation, nan=0.0) > self.saturation).any()
        # sync point (deferred): a non-blocking copy read one step later, once its event completed
        self._host.copy_(trip.int().reshape(1), non_blocking=True)
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        self._pending = step

    def fired(self) -> int | None:
        """The step whose check fired, if that check has completed; never waits."""
        if self._pending is None:
            return None
        if self._event is not None and not self._event.query():  # type: ignore[no-untyped-call]
            return None
        step, self._pending = self._pending, None
        if self._word.value != 0:
            self.fired_steps += 1
            return step
        return None
