"""The count kernel's candidate settings (``counts.ROW_BY_ROW``, ``counts.TILES_AHEAD``) and every
variant the GPU benches time, against the torch path under Triton's CPU interpreter (each check in
a fresh interpreter: see tests/agent/interpreted.py). The GPU times them (docs/gpu.md)."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("torch")

from tests.agent.interpreted import run_interpreted

_ROW_BY_ROW = textwrap.dedent("""
    import json, torch
    from fp8guard.agent.fp8 import Fp8Format, quantize
    from fp8guard.agent.kernels import counts
    from tests.agent.test_kernels import _tensor, counted
    # The word test's candidate settings: flagged tiles read row by row (counts.ROW_BY_ROW) and
    # two tiles' words loading while one is tested (counts.TILES_AHEAD). Tiles with one or two
    # flagged rows (at a tile's first and last row, in the tail), tiles where every row is flagged
    # (the whole-tile path past the limit), a program with one tile, and the random tensors with
    # edge values of the other checks.
    def cases(fmt):
        for dtype, n in ((torch.bfloat16, 5 * 4096 + 77), (torch.float16, 5 * 4096 + 68), (torch.float32, 5 * 4096 + 3)):
            x = torch.full((n,), 0.75, dtype=dtype)
            scale = torch.tensor([fmt.fp8_max / 4.0 if fmt is Fp8Format.E4M3 else 1.0])
            big = 100.0 if fmt is Fp8Format.E4M3 else 60000.0
            for at in (0, 63, 2048 - 1, 4096 + 64 * 5 + 7, n - 1):
                x[at] = big
            for at in (64 * 31, 4096 + 64 * 5 + 9, 3 * 4096 + 11, n - 2):
                x[at] = 1e-6
            x[2 * 4096:2 * 4096 + 2048:61] = 1e-6  # every row of a tile flagged
            x[2 * 4096 + 2048:2 * 4096 + 2048 + 64 * 12:64] = big  # twelve rows of the next
            yield x, scale
        yield _tensor(torch.bfloat16, fmt, n=3 * 4096 + 123, seed=1)
        yield _tensor(torch.float16, fmt, n=2000, seed=2)  # one tile a program
    out = []
    for limit, ahead in ((1, 1), (8, 1), (32, 1), (0, 2), (8, 2)):
        counts.ROW_BY_ROW, counts.TILES_AHEAD = limit, ahead
        for fmt in (Fp8Format.E4M3, Fp8Format.E5M2):
            for x, scale in cases(fmt):
                q = quantize(x, scale[0], fmt)
                assert q.view(torch.uint8).data_ptr() % 4 == 0  # the word test
                out.append([[limit, ahead], counted(x, scale, fmt, q, "triton"), counted(x, scale, fmt, q, "torch")])
    # 64-row tiles, flagged rows up to the last (bit 63 of the row bits): limit 64 reads them one by one
    counts.COUNT_SHAPES["bytes"] = (64, 64, 32, 2)
    counts.ROW_BY_ROW, counts.TILES_AHEAD = 64, 1
    x = torch.full((3 * 4096 + 100,), 0.75)
    scale = torch.tensor([Fp8Format.E4M3.fp8_max / 4.0])
    for at in (63 * 64 + 5, 62 * 64, 4096 + 63 * 64 + 63, 2 * 4096 + 31 * 64):
        x[at] = 100.0
    x[4096 + 63 * 64] = 1e-6
    q = quantize(x, scale[0], Fp8Format.E4M3)
    out.append([[64, 1], counted(x, scale, Fp8Format.E4M3, q, "triton"), counted(x, scale, Fp8Format.E4M3, q, "torch")])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_word_test_candidates_count_what_the_torch_path_counts() -> None:
    """``ROW_BY_ROW``: a flagged tile with few flagged rows reads only those rows again; one with
    more takes the whole-tile path. ``TILES_AHEAD`` 2: the tile after next loads too. Every
    setting counts what the torch path counts."""
    rows = run_interpreted(_ROW_BY_ROW, timeout=600)
    assert len({tuple(r[0]) for r in rows}) == 6 and len(rows) == 5 * 2 * 5 + 1
    for setting, triton_counts, torch_counts in rows:
        assert triton_counts == torch_counts, (setting, triton_counts, torch_counts)
        assert triton_counts[0] > 0 and triton_counts[1] > 0


_PROBE_VARIANTS = textwrap.dedent("""
    import json, torch
    from bench import _count_probe as probe
    from fp8guard.agent.kernels import counts
    ops = probe.synthetic_operands(layers=1, hidden=64, tokens=96, device="cpu")
    out = {}
    for variant in probe.VARIANTS:
        dst = torch.zeros(len(ops), 2, dtype=torch.int64)
        probe._run(ops, dst, variant)
        out[variant] = dst.tolist()
    print(json.dumps({"counts": out, "restored": [counts.BYTES_IN_WORDS, counts.ROW_BY_ROW, counts.TILES_AHEAD]}))
""")


@pytest.mark.slow
def test_every_variant_the_gpu_benches_time_counts_the_same_under_the_interpreter() -> None:
    """bench/_count_probe.py's variants (the sweep, the timing and the A/B's candidates run them
    on the GPU): each counts what the FP8-bytes variant counts on the model's layout, and the
    count module's settings are put back after each."""
    got = run_interpreted(_PROBE_VARIANTS, timeout=600)
    from bench._count_probe import SETTINGS

    assert set(got["counts"]) == {"hp", "bytes", *SETTINGS}
    assert all(counts == got["counts"]["bytes"] for counts in got["counts"].values()), got
    assert sum(row[0] + row[1] for row in got["counts"]["bytes"]) > 0
    assert got["restored"] == [True, 0, 1]
