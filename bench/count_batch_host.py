"""Host microseconds per operand of ``CountBatch.add`` and its flushes, the launch itself stubbed:
the Python that the batched count path spends per operand, on any machine (no GPU).

    TRITON_INTERPRET=1 python3 bench/count_batch_host.py

On the CPU the batch takes operands only under Triton's interpreter (``TRITON_INTERPRET=1``), whose
device check costs time per operand that a CUDA tensor skips (``x.is_cuda``): compare
figures from one machine and one setting. The GPU host's own figure, with real launches, is
``bench/gpu_counts.py kernels --parts launch_floor`` (``count_batch``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(operands: int = 144, passes: int = 30) -> dict[str, object]:
    import torch

    from fp8guard.agent.fp8 import Fp8Format
    from fp8guard.agent.kernels import count_batch

    launched = [0]

    def stub(*args: object, **kwargs: object) -> None:
        launched[0] += 1

    count_batch._LAUNCH = stub  # type: ignore[assignment]  # the launch itself is not what is measured
    xs = [torch.randn(4096 * 16, dtype=torch.bfloat16) for _ in range(operands)]
    qs = [torch.zeros(4096 * 16, dtype=torch.uint8) for _ in range(operands)]
    rows = list(torch.zeros(operands, 2, dtype=torch.int64).unbind(0))
    scale_inv = torch.ones(1)
    per_operand: list[float] = []
    batch = count_batch.CountBatch(count_batch.BATCH_SLOTS)
    batch.add(rows[0], xs[0], scale=scale_inv, scale_inv=scale_inv, fmt=Fp8Format.E4M3, fp8_bytes=qs[0])
    if batch.alone:
        return {"bench": "count_batch_host", "skipped": "the batch takes no CPU tensor outside Triton's "
                "interpreter: run with TRITON_INTERPRET=1"}
    batch.flush()
    launched[0] = 0
    for _ in range(passes):
        t0 = time.perf_counter()
        for i in range(operands):
            batch.add(rows[i], xs[i], scale=scale_inv, scale_inv=scale_inv, fmt=Fp8Format.E4M3, fp8_bytes=qs[i])
        batch.flush()
        per_operand.append((time.perf_counter() - t0) / operands * 1e6)
    per_operand = per_operand[3:] if len(per_operand) > 3 else per_operand  # the first passes warm caches
    return {"bench": "count_batch_host", "operands": operands, "passes": len(per_operand),
            "batched": batch.alone == 0, "launches_per_pass": launched[0] // passes,
            "host_us_per_operand_median": round(statistics.median(per_operand), 3),
            "host_us_per_operand_min": round(min(per_operand), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--operands", type=int, default=144)
    p.add_argument("--passes", type=int, default=30)
    a = p.parse_args()
    if a.operands < 1 or a.passes < 1:
        p.error("--operands and --passes must be at least 1")
    print(json.dumps(measure(a.operands, a.passes)))


if __name__ == "__main__":
    main()
