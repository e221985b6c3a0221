"""Run a script with TE's ``Linear`` GEMM describing its operands when cuBLAS refuses them.

    CUBLASLT_LOG_LEVEL=1 python3 bench/te_gemm_diag.py bench/gpu_heal.py --runs fp8_guarded --out $OUT

Each operand's type, dtype, shape, strides and address alignment are printed before the error
propagates; with ``CUBLASLT_LOG_LEVEL=1`` cuBLASLt prints its own reason. This is how the guarded
heal run's crash of 2026-12-02 (docs/gpu.md, fifth session) was traced to TE's debug path.
"""
import runpy
import sys

import transformer_engine.pytorch.module.linear as linear

_orig = linear.general_gemm


def _describe(x):  # type: ignore[no-untyped-def]
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    out = type(x).__name__
    for attr in ("dtype", "shape", "_fp8_dtype", "_data", "_transpose", "_rowwise_data", "_columnwise_data",
                 "_scale_inv", "_quantizer"):
        if hasattr(x, attr):
            v = getattr(x, attr)
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                out += f" {attr}=({v.dtype},{tuple(v.shape)},{v.stride() if hasattr(v, 'stride') else ''},{v.data_ptr() % 256})"
            else:
                out += f" {attr}={type(v).__name__ if attr == '_quantizer' else v}"
    if hasattr(x, "stride") and hasattr(x, "data_ptr"):
        try:
            out += f" stride={x.stride()} ptr%256={x.data_ptr() % 256} contig={x.is_contiguous()}"
        except Exception as exc:
            out += f" ({exc})"
    return out


def general_gemm(*args, **kwargs):  # type: ignore[no-untyped-def]
    try:
        return _orig(*args, **kwargs)
    except RuntimeError:
        print("GEMMDIAG args", [_describe(a) for a in args], flush=True)
        print("GEMMDIAG kwargs", {k: _describe(v) for k, v in kwargs.items()}, flush=True)
        raise


linear.general_gemm = general_gemm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
