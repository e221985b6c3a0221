"""The count kernel side by side with another version of it: the same 144 synthetic operands of
the 604M model (``bench/_count_probe.py``), the same counts required, graph-replayed, rounds
alternating in one process. For a kernel change, before it lands or after:

    git show <rev>:agent/kernels/counts.py > /tmp/counts_old.py
    python3 bench/gpu_count_kernel_ab.py --old /tmp/counts_old.py --out DIR

or, without ``--old``, the kernel as it is against its candidate settings alone.

Three ways each: the real bytes (words), the bytes with no tile flagged (every byte mid-range:
the word test alone, which must count nothing), the bytes tested one by one (``BYTES_IN_WORDS``
off); and the new module's candidate settings (``bench/_count_probe.py``'s ``SETTINGS``: a flagged
tile's flagged rows read one by one, two tiles' words loading while one is tested) and the
operands counted eight to a launch (``count_batch.CountBatch``, ``new_batched``), on the real bytes
and on the clean ones. Every way's counts are checked (``same_counts``, ``wrong_counts``)
before it is timed. Needs CUDA and Triton, no Transformer Engine. Prints one JSON line and writes
``gpu_count_kernel_ab.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("fp8guard_counts_other", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--old {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(old_path: str | None, rounds: int = 5, repeats: int = 5) -> dict[str, Any]:
    import torch

    from bench import _count_probe as probe
    from bench._te_model import skip
    from fp8guard.agent.kernels import counts as new
    from fp8guard.agent.kernels import triton_available
    from fp8guard.agent.kernels.count_batch import BATCH_SLOTS, CountBatch

    if not torch.cuda.is_available() or not triton_available(torch.device("cuda")):
        skip("gpu_count_kernel_ab", "needs a CUDA GPU and Triton")
    old = _load(old_path) if old_path else None
    ops = [op for op in probe.synthetic_operands() if op.q is not None]
    clean = [probe.Operand(op.layer, op.tensor, op.recipe, op.x, torch.full_like(op.q, 0x30), op.scale,
                           op.scale_inv, op.fmt) for op in ops]
    dst = torch.zeros(len(ops), 2, dtype=torch.int64, device="cuda")

    def body(module: ModuleType, which: list[Any], **settings: Any) -> Callable[[], None]:
        """Count ``which`` with ``module``, its settings (``BYTES_IN_WORDS``...) changed meanwhile."""
        def run() -> None:
            before = {name: getattr(module, name) for name in settings}
            for name, value in settings.items():
                setattr(module, name, value)
            try:
                for i, op in enumerate(which):
                    # (the FP8-bytes variant reads no scale: scale_inv stands in for it)
                    module.count_cast_into(dst[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt,
                                           fp8_bytes=op.q)
            finally:
                for name, value in before.items():
                    setattr(module, name, value)
        return run

    def batched(which: list[Any]) -> Callable[[], None]:
        """Count ``which`` eight to a launch (``count_batch.CountBatch``), the default settings."""
        def run() -> None:
            batch = CountBatch(BATCH_SLOTS)
            for i, op in enumerate(which):
                batch.add(dst[i], op.x, scale=op.scale_inv, scale_inv=op.scale_inv, fmt=op.fmt, fp8_bytes=op.q)
            batch.flush()
        return run

    got = {}
    for name, module in (("old", old), ("new", new)):
        if module is not None:
            dst.zero_()
            body(module, ops)()
            torch.cuda.synchronize()
            got[name] = dst.clone()
    ways = {"new": body(new, ops), "new_clean": body(new, clean), "new_bytewise": body(new, ops, BYTES_IN_WORDS=False)}
    if old is not None:
        ways.update({"old": body(old, ops), "old_clean": body(old, clean),
                     "old_bytewise": body(old, ops, BYTES_IN_WORDS=False)})
    for name, settings in probe.SETTINGS.items():  # the new module's candidates, real and clean bytes
        if name != "bytes_bytewise":
            ways[f"new_{name.removeprefix('bytes_')}"] = body(new, ops, **settings)
            ways[f"new_{name.removeprefix('bytes_')}_clean"] = body(new, clean, **settings)
    ways.update({"new_batched": batched(ops), "new_batched_clean": batched(clean)})
    wrong = []
    errors: dict[str, str] = {}
    for name, run in list(ways.items()):  # compile outside the graphs; every way counts what it must
        dst.zero_()
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:  # a way that cannot run is reported, the others timed
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            del ways[name]
            continue
        want = torch.zeros_like(dst) if name.endswith("_clean") else got["new"]
        if not torch.equal(dst, want):
            wrong.append(name)
    rows = []
    for r in range(rounds):
        order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
        rows.append({name: round(probe.replay_ms(run, dst, repeats), 3) for name, run in order})
    median = {name: statistics.median(row[name] for row in rows) for name in ways}
    nbytes = sum(op.q.numel() for op in ops)
    return {"bench": "gpu_count_kernel_ab", "device": torch.cuda.get_device_name(), "old": old_path,
            "same_counts": ("old" not in got or bool(torch.equal(got["old"], got["new"]))) and not wrong,
            "wrong_counts": wrong, "errors": errors,
            "rounds": rows, "median_ms": median,
            "GBps": {name: round(nbytes / 1e6 / ms) for name, ms in median.items()}}


def main() -> None:
    from bench._te_model import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=None, help="another version's agent/kernels/counts.py (without it: the "
                                                    "kernel as it is against its candidate settings only)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for gpu_count_kernel_ab.json")
    args = parser.parse_args()
    result = measure(args.old, args.rounds)
    write_result(result, args.out, "gpu_count_kernel_ab.json")


if __name__ == "__main__":
    main()
