"""Loss curves of a ``bench/gpu_heal.py`` result as a PNG (needs matplotlib, not a dependency of
fp8guard: ``pip install matplotlib``).

    python bench/plot_heal.py docs/gpu-results/gpu_heal_1e6.json docs/gpu-results/heal_1e6.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(Path(src).read_text())
    cfg = r["config"]

    def smooth(c: list[float], k: int = 10) -> list[float]:
        return [sum(c[max(0, i - k + 1):i + 1]) / len(c[max(0, i - k + 1):i + 1]) for i in range(len(c))]

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    start, end = cfg["incident"], cfg["incident"] + cfg["incident_batches"]
    ax.axvspan(start, end, color="0.9", label=f"outlier window (up to {cfg['outlier']:g}x)")
    styles = {"bf16": ("BF16", "tab:blue"), "fp8_unguarded": ("FP8 unguarded", "tab:red"),
              "fp8_guarded": ("FP8 guarded (fp8guard)", "tab:green")}
    for mode, (label, color) in styles.items():
        run = r["runs"][mode]
        ax.plot(smooth(run["losses"]), label=f"{label}: held-out loss {run['val_loss']:.3f}", color=color, lw=1.4)
    detected = r["first_finding_step"]["fp8_guarded"]
    if detected is not None:
        ax.axvline(detected, color="tab:green", ls="--", lw=1, label=f"first finding, step {detected}")
    for e in r["runs"]["fp8_guarded"]["agent_events"]:
        marker = {"fallback_applied": "v", "promotion_applied": "^", "rollback_applied": "x"}.get(e["kind"], "o")
        ax.plot([e["step"]], [ax.get_ylim()[0]], marker=marker, color="tab:green", ms=8, clip_on=False)
    spike = r["unguarded_loss_leaves_bf16_at"]
    if spike is not None:
        ax.axvline(spike, color="tab:red", ls=":", lw=1, label=f"unguarded leaves BF16, step {spike}")
    ax.set_xlabel("step (v fallback, ^ re-promotion applied)")
    ax.set_ylabel("training loss, 10-step mean")
    ax.set_title(f"{r['device']}: TE DelayedScaling, dormant unit lit up to {cfg['outlier']:g}x")
    ax.set_ylim(bottom=1.0)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
