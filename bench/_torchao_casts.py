"""torchao's own amax and scale of every FP8 cast, for checking fp8guard's torchao source
against them (bench/gpu_torchao.py); torchao's code is wrapped, never copied."""

from __future__ import annotations

from typing import Any


class TorchaoCasts:
    """Records torchao's own casts while active: per cast the module (by its linear_mm_config),
    the GEMM role, the amax from torchao's ``tensor_to_amax`` and the ``_scale`` of the
    ``Float8TrainingTensor`` it returned. Wraps module-level functions that torchao 0.17 and
    0.18 look up at call time (``float8_linear.hp_tensor_to_float8_dynamic``,
    ``float8_utils.tensor_to_amax``)."""

    def __init__(self, model: Any) -> None:
        import torchao.float8.float8_linear as fl
        import torchao.float8.float8_utils as fu

        self._fl, self._fu = fl, fu
        self.names = {id(m.linear_mm_config): n for n, m in model.named_modules() if hasattr(m, "linear_mm_config")}
        self.records: list[dict[str, Any]] = []
        self._open: list[dict[str, Any]] = []
        self._orig_cast, self._orig_amax = fl.hp_tensor_to_float8_dynamic, fu.tensor_to_amax

    def __enter__(self) -> TorchaoCasts:
        orig_cast, orig_amax, names = self._orig_cast, self._orig_amax, self.names

        def cast(hp: Any, dtype: Any, mm_config: Any, *args: Any, **kwargs: Any) -> Any:
            rec = {"module": names.get(id(mm_config)), "role": str(kwargs.get("gemm_input_role")).split(".")[-1],
                   "amax": None}
            self._open.append(rec)
            try:
                res = orig_cast(hp, dtype, mm_config, *args, **kwargs)
            finally:
                self._open.pop()
            rec["scale"] = res._scale.detach().float().clone()
            self.records.append(rec)
            return res

        def amax(*args: Any, **kwargs: Any) -> Any:
            value = orig_amax(*args, **kwargs)
            if self._open:
                self._open[-1]["amax"] = value.detach().clone()
            return value

        self._fl.hp_tensor_to_float8_dynamic, self._fu.tensor_to_amax = cast, amax
        return self

    def __exit__(self, *exc: object) -> None:
        self._fl.hp_tensor_to_float8_dynamic, self._fu.tensor_to_amax = self._orig_cast, self._orig_amax

    def take(self) -> list[dict[str, Any]]:
        out, self.records = self.records, []
        return out
