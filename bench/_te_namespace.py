"""Transformer Engine's routing through nvdlfw-inspect, on a machine without TE.

TE cannot be imported without CUDA, and its debug path reaches fp8guard's feature through
nvdlfw-inspect (pure Python, real here). What TE adds is its namespace API (the defaults, the
routing condition, which call arguments key the routing cache) and the calls its debug quantizers
make on a debug iteration. Both are copied here from TE 2.20.2 so that nvdlfw-inspect's routing
runs as it runs under TE:

* :class:`TENamespace`: ``transformer_engine/debug/features/api.py`` (``TransformerEngineAPI``,
  lines 400-520; ``TEDefaultFeatures``' answers; ``required_kwargs``, line 89), and the features
  TE registers from its features folder (:data:`TE_FEATURES`, never configured here);
* :func:`module_calls`: the routed calls one TE module's debug quantizers make when a debug
  iteration builds them (``transformer_engine/debug/pytorch/debug_quantization.py``, lines
  110-255: for the activation, weight and gradient quantizers ``inspect_tensor_enabled``, two
  ``inspect_tensor_postquantize_enabled``, two ``modify_tensor_enabled``, two
  ``fp8_gemm_enabled`` and two log messages; for output, dgrad and wgrad ``inspect_tensor_enabled``
  and ``modify_tensor_enabled``), 6 quantizers a Linear or LayerNormLinear, 12 a LayerNormMLP.

Used by ``bench/te_routing.py`` and ``tests/agent/test_te_routing.py``. On the GPU host TE's own
classes run instead (``bench/gpu_counts.py time`` and the TE source's tests).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

REQUIRED_KWARGS = {
    "fp8_gemm_enabled": ["gemm"],
    "modify_tensor_enabled": ["tensor_name", "gemm"],
    "modify_tensor": ["tensor_name", "gemm"],
    "inspect_tensor": ["tensor_name"],
    "inspect_tensor_postquantize": ["tensor_name"],
    "inspect_tensor_enabled": ["tensor_name"],
    "inspect_tensor_postquantize_enabled": ["tensor_name"],
    "default": ["tensor_name", "gemm"],
}
"""TE 2.20.2's ``required_kwargs`` (api.py:89)."""

CACHE_KEYS = {
    "fp8_gemm": ["gemm"],
    "modify_tensor": ["tensor_name", "gemm"],
    "inspect_tensor": ["tensor_name"],
    "inspect_tensor_postquantize": ["tensor_name"],
    "inspect_tensor_enabled": ["tensor_name", "iteration"],
    "inspect_tensor_postquantize_enabled": ["tensor_name", "iteration"],
    "modify_tensor_enabled": ["tensor_name"],
}
"""TE 2.20.2's ``_cacheable_api_kwargs_map`` (api.py:410)."""

QUANTIZERS = (("activation", "fprop", "wgrad"), ("weight", "fprop", "dgrad"), ("gradient", "dgrad", "wgrad"),
              ("output", "fprop", None), ("dgrad", "dgrad", None), ("wgrad", "wgrad", None))
"""One GEMM's debug quantizers: (tensor, rowwise GEMM, columnwise GEMM; None for an output)."""


def _defaults() -> Any:
    class TEDefaultFeatures:
        """TE's answers where no feature is configured for a layer and tensor."""

        def fp8_gemm_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, iteration: int) -> Any:
            return True, None

        def modify_tensor_enabled(self, config: dict[str, Any], layer_name: str, gemm: str, tensor_name: str,
                                  iteration: int) -> Any:
            return False, None

        def inspect_tensor_enabled(self, config: dict[str, Any], layer_name: str, tensor_name: str,
                                   iteration: int) -> Any:
            return False, None

        def inspect_tensor_postquantize_enabled(self, config: dict[str, Any], layer_name: str, gemm: str,
                                                tensor_name: str, iteration: int) -> Any:
            return False, None

        def inspect_tensor(self, config: dict[str, Any], layer_name: str, **kwargs: Any) -> None:
            return None

    return TEDefaultFeatures()


@functools.cache
def _logs() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="fp8guard-nvdlfw-")


def log_dir() -> str:
    """One folder a process for nvdlfw-inspect's log files, removed when the process ends."""
    return _logs().name


def install() -> None:
    """Register the copy of TE's namespace API with nvdlfw-inspect (before ``initialize``)."""
    from nvdlfw_inspect.base import BaseNamespaceAPI
    from nvdlfw_inspect.logging import initialize_logger
    from nvdlfw_inspect.registry import Registry

    class TENamespace(BaseNamespaceAPI):  # type: ignore[misc]
        """``TransformerEngineAPI`` of TE 2.20.2, less its tensor-type checks."""

        def __init__(self) -> None:
            BaseNamespaceAPI.__init__(self)
            self._default_api_impl = _defaults()
            self._cacheable_api_kwargs_map = {k: list(v) for k, v in CACHE_KEYS.items()}

        def is_multiple_feature_invocation_allowed(self, api_name: str) -> bool:
            return api_name in {"fp8_gemm_enabled", "inspect_tensor", "inspect_tensor_postquantize",
                                "inspect_tensor_enabled", "inspect_tensor_postquantize_enabled"}

        def input_assertions_hook(self, api_name: str, **kwargs: Any) -> None:
            for kwarg in REQUIRED_KWARGS.get(api_name, REQUIRED_KWARGS["default"]):
                assert kwarg in kwargs, f"Cannot route API, too ambiguous. Provide {kwarg} in {api_name}."

        def routing_condition(self, api_name: str, config: dict[str, Any], _: str, feature_obj: Any,
                              **kwargs: Any) -> Any:
            tensor_parsing = "tensor_name" in REQUIRED_KWARGS[api_name]
            gemm_parsing = "gemm" in REQUIRED_KWARGS[api_name]
            return feature_obj.parse_config_and_api(config, gemm_parsing=gemm_parsing,
                                                    tensor_parsing=tensor_parsing, **kwargs)

        def output_assertions_hook(self, api_name: str, ret: Any, **kwargs: Any) -> None:
            if "enabled" in api_name or api_name == "fp8_gemm":
                assert isinstance(ret, (bool, tuple))
            if api_name in ["inspect_tensor", "inspect_tensor_postquantize"]:
                assert ret is None

        def call_feature(self, call: Callable[..., Any], feat_config: dict[str, Any], layer_name: str,
                         **kwargs: Any) -> Any:
            if call.__name__ == "inspect_tensor":
                kwargs = dict(kwargs)
                for k in ["quantizer", "columnwise_quantized_tensor", "rowwise_quantized_tensor", "tp_size"]:
                    if k not in call.__code__.co_varnames:
                        kwargs.pop(k, None)
            return call(feat_config, layer_name, **kwargs)

    initialize_logger(log_dir())
    Registry.register_namespace_api(namespace="transformer_engine")(TENamespace)
    for feature in _te_features():
        Registry.register_feature(namespace="transformer_engine")(feature)


TE_FEATURES = {
    "TestDummyFeature": ("inspect_tensor_enabled", "inspect_tensor"),
    "DisableQuantizationGEMM": ("fp8_gemm_enabled",), "DisableQuantizationLayer": ("fp8_gemm_enabled",),
    "DisableFP8GEMM": ("fp8_gemm_enabled",), "DisableFP8Layer": ("fp8_gemm_enabled",),
    "DumpTensors": ("inspect_tensor_enabled", "inspect_tensor"),
    "FakeQuant": ("fp8_gemm_enabled", "modify_tensor_enabled", "modify_tensor"),
    "LogFp8TensorStats": ("inspect_tensor_enabled", "inspect_tensor"),
    "LogNvfp4TensorStats": ("inspect_tensor_enabled", "inspect_tensor"),
    "LogTensorStats": ("inspect_tensor_enabled", "inspect_tensor"),
    "PerTensorScaling": ("fp8_gemm", "modify_tensor_enabled", "modify_tensor"),
}
"""The features TE 2.20.2 registers from its features folder (transformer_engine/debug/features/),
with the APIs each implements. A session configures none of them here, but nvdlfw-inspect's
routing of a call that misses its cache looks each one implementing the call up in the layer's
config, so they are registered (under their names, with those APIs) for the misses to cost what
they cost under TE."""


def _te_features() -> list[type]:
    from nvdlfw_inspect.registry import api_method

    features = []
    for name, apis in TE_FEATURES.items():  # (never configured here, so never called)
        methods = {api: api_method(lambda self, config, *a, **k: (False, None)) for api in apis}

        def parse_config_and_api(self: Any, config: dict[str, Any], **kwargs: Any) -> tuple[bool, None]:
            return bool(config.get("enabled", False)), None

        features.append(type(name, (), {**methods, "parse_config_and_api": parse_config_and_api}))
    return features


SITES: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    # One line each: nvdlfw-inspect keys its routing cache on the caller's file and line too, and
    # TE's debug quantizers ask from these nine places (debug_quantization.py:119-224).
    "output_inspect": lambda api, kw: api.transformer_engine.inspect_tensor_enabled(**kw),
    "output_modify": lambda api, kw: api.transformer_engine.modify_tensor_enabled(**kw),
    "inspect": lambda api, kw: api.transformer_engine.inspect_tensor_enabled(**kw),
    "postquantize_row": lambda api, kw: api.transformer_engine.inspect_tensor_postquantize_enabled(**kw),
    "postquantize_col": lambda api, kw: api.transformer_engine.inspect_tensor_postquantize_enabled(**kw),
    "modify_row": lambda api, kw: api.transformer_engine.modify_tensor_enabled(**kw),
    "fp8_gemm_row": lambda api, kw: api.transformer_engine.fp8_gemm_enabled(**kw),
    "modify_col": lambda api, kw: api.transformer_engine.modify_tensor_enabled(**kw),
    "fp8_gemm_col": lambda api, kw: api.transformer_engine.fp8_gemm_enabled(**kw),
    "log": lambda api, kw: api.log_message(**kw),
}
"""How each of TE's call sites reaches nvdlfw-inspect (``log``: its plan messages)."""


def module_calls(layer_name: str, iteration: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """The calls (call site of :data:`SITES`, arguments) of one TE GEMM's debug quantizers on a
    debug iteration, in TE's order: per quantizer of the activation, weight and gradient 7 routed
    calls and 2 log messages, per output quantizer (output, dgrad, wgrad) 2 routed calls."""
    for tensor, row_gemm, col_gemm in QUANTIZERS:
        asked = {"layer_name": layer_name, "tensor_name": tensor, "iteration": iteration}
        if col_gemm is None:  # an output: its plan (debug_quantization.py:110-134)
            yield "output_inspect", asked
            yield "output_modify", {**asked, "gemm": row_gemm}
            continue
        yield "inspect", asked
        yield "postquantize_row", {**asked, "gemm": row_gemm}
        yield "postquantize_col", {**asked, "gemm": col_gemm}
        for side, gemm in (("row", row_gemm), ("col", col_gemm)):
            yield f"modify_{side}", {**asked, "gemm": gemm}
            yield f"fp8_gemm_{side}", {"layer_name": layer_name, "gemm": gemm, "iteration": iteration}
        for gemm in (row_gemm, col_gemm):
            yield "log", {"msg": f"Tensor: {tensor}, gemm {gemm} - FP8 Quantize", "layer_name": layer_name,
                          "extra_cachable_args": (gemm, tensor)}


def layer_names(layers: int) -> list[str]:
    """TE's layer names for the GEMMs of a TransformerLayer stack (LayerNormMLP's two: fc1, fc2)."""
    return [f"layers.{i}.{m}" for i in range(layers)
            for m in ("self_attention.layernorm_qkv", "self_attention.proj", "layernorm_mlp.fc1", "layernorm_mlp.fc2")]


def run_iteration(debug_api: Any, names: list[str], iteration: int) -> list[Any]:
    """Every call of one debug iteration for ``names``, through ``debug_api``; the routed calls'
    answers."""
    out = []
    for name in names:
        for site, kwargs in module_calls(name, iteration):
            answer = SITES[site](debug_api, kwargs)
            if site != "log":
                out.append(answer)
    return out
