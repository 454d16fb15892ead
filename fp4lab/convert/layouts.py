"""The two NVFP4 checkpoint layouts engines load: tensor names, dtypes, shapes and configs.

Each layout stores a quantized module ``<m>`` (out x in weights, any leading expert dims) as
three tensors, codes two a byte with the low nibble first, block scales in the plain (linear)
row-major layout, and one FP32 global scale whose meaning differs (docs/checkpoints.md has the
sources, one per fact):

    layout              codes [.., out, in/2] U8   block scales [.., out, in/16] F8_E4M3   global F32
    modelopt            <m>.weight                  <m>.weight_scale                        <m>.weight_scale_2 []
                                                                            (decode: w = code * s_b * g)
    compressed-tensors  <m>.weight_packed           <m>.weight_scale                        <m>.weight_global_scale [1]
                                                                            (encode: w = code * s_b / g)

W4A4 checkpoints add an activation global scale: ModelOpt ``<m>.input_scale`` [] (decode),
compressed-tensors ``<m>.input_global_scale`` [1] (encode). The config that declares the layout
lives in ``config.json`` under ``quantization_config`` (both), and ModelOpt also writes
``hf_quant_config.json``. Modules left in high precision are listed by pattern: ModelOpt's
``exclude_modules`` / ``ignore`` take fnmatch wildcards, compressed-tensors' ``ignore`` and
``targets`` take exact names or ``re:`` regular expressions.

Public: ``Layout``, ``LayoutSpec``, ``SPECS``, ``GROUP_SIZE``, ``FUSED``, ``ROUTERS``,
``quantized_modules``, ``high_precision_modules``, ``module_patterns``, ``matches``,
``quantization_config``, ``hf_quant_config``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ..formats.types import Choice

GROUP_SIZE = 16
PRODUCER = {"name": "fp4lab", "version": "0.1.0"}
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2"}
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
         ("q_a_proj", "kv_a_proj_with_mqa"))  # the last: MLA (DeepSeek-V2/V3), fused when q is low-rank
"""projections engines fuse into one GEMM: they need one weight global scale"""
ROUTERS = frozenset({"router", "gate"})
"""MoE router leaf names: engines load them in high precision"""


class Layout(Choice):
    MODELOPT = "modelopt"
    COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True, kw_only=True)
class LayoutSpec:
    codes: str
    """suffix of the packed E2M1 codes, uint8 [.., out, in/2]"""
    scales: str
    """suffix of the E4M3 block scales, float8_e4m3fn [.., out, in/16]"""
    global_scale: str
    """suffix of the FP32 weight global scale"""
    input_scale: str
    """suffix of the FP32 activation global scale (W4A4 only)"""
    global_shape: tuple[int, ...]
    """the shape the layout's own writer gives a global scale"""
    global_is_encode: bool
    """True: the stored scalar multiplies on encode (1 / S_dec); False: it is S_dec itself"""


SPECS = {
    Layout.MODELOPT: LayoutSpec(codes="weight", scales="weight_scale", global_scale="weight_scale_2",
                                input_scale="input_scale", global_shape=(), global_is_encode=False),
    Layout.COMPRESSED_TENSORS: LayoutSpec(codes="weight_packed", scales="weight_scale",
                                          global_scale="weight_global_scale", input_scale="input_global_scale",
                                          global_shape=(1,), global_is_encode=True),
}


def quantized_modules(headers: dict[str, tuple[str, list[int]]], layout: Layout) -> list[str]:
    """Modules stored as NVFP4 in ``layout``: they have codes, and (ModelOpt's codes share the name
    'weight' with plain weights) block scales or uint8 codes. headers: name -> (dtype, shape)."""
    spec, out = SPECS[layout], set()
    for name, (dtype, _) in headers.items():
        m, _, leaf = name.rpartition(".")
        if leaf == spec.codes and (spec.codes != "weight" or f"{m}.{spec.scales}" in headers or dtype == "U8"):
            out.add(m)
    return sorted(out)


def high_precision_modules(headers: dict[str, tuple[str, list[int]]], quantized: set[str]) -> list[str]:
    """Modules with a floating ``<m>.weight`` of 2+ dims that are not quantized: the linears,
    embeddings, routers and heads an engine must load unquantized. headers: name -> (dtype, shape)."""
    out = set()
    for name, (dtype, shape) in headers.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and dtype in _FLOAT_DTYPES and len(shape) >= 2 and module not in quantized:
            out.add(module)
    return sorted(out)


def matches(name: str, pattern: str) -> bool:
    """Whether a module name matches a pattern: ``re:<regex>`` (compressed-tensors, re.match),
    an fnmatch wildcard (ModelOpt), or an exact name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def module_patterns(names: list[str], others: list[str], syntax: Layout) -> list[str]:
    """Patterns that match every name and none of ``others``: a name's numeric path parts (layer,
    expert indices) are generalized, unless the pattern would also catch one of ``others``, in
    which case the exact names are kept."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        if syntax is Layout.MODELOPT:
            pattern = ".".join("*" if p.isdigit() else p for p in parts)
        else:
            pattern = "re:^" + r"\.".join(r"\d+" if p.isdigit() else re.escape(p) for p in parts) + "$"
        groups.setdefault(pattern if any(p.isdigit() for p in parts) else name, []).append(name)
    out = []
    for pattern, members in groups.items():
        out += members if any(matches(o, pattern) for o in others) else [pattern]
    return sorted(out)


def quantization_config(layout: Layout, quantized: list[str], high_precision: list[str], *,
                        w4a4: bool = False, kv_cache: dict | None = None) -> dict:
    """config.json's ``quantization_config`` for a weight-only (W4A16) NVFP4 checkpoint, or with
    ``w4a4`` one whose activations are NVFP4 too (each module then stores an input global scale).
    ``kv_cache``: a source's KV-cache declarations, carried over (``kv_cache_scheme``)."""
    scheme = (kv_cache or {}).get("kv_cache_scheme")
    if layout is Layout.MODELOPT:
        # the config.json form vLLM's ModelOpt loader reads ("ignore", not "exclude_modules")
        return {"quant_method": "modelopt", "quant_algo": _modelopt_algo(w4a4), "group_size": GROUP_SIZE,
                "kv_cache_scheme": scheme, "ignore": module_patterns(high_precision, quantized, layout),
                "producer": PRODUCER}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_SIZE,
               "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": module_patterns(quantized, high_precision, layout),
                                          "weights": weights,
                                          "input_activations": {**weights, "dynamic": "local"} if w4a4 else None,
                                          "output_activations": None, "format": "nvfp4-pack-quantized"}},
            "ignore": module_patterns(high_precision, quantized, layout), "kv_cache_scheme": scheme,
            "sparsity_config": {}}


def hf_quant_config(quantized: list[str], high_precision: list[str], *, w4a4: bool = False,
                    kv_cache: dict | None = None) -> dict:
    """ModelOpt's ``hf_quant_config.json`` for an NVFP4 checkpoint (weight-only unless ``w4a4``;
    ``kv_cache``: a source's ``kv_cache_quant_algo``, carried over)."""
    algo = (kv_cache or {}).get("kv_cache_quant_algo")
    return {"producer": PRODUCER,
            "quantization": {"quant_algo": _modelopt_algo(w4a4), "kv_cache_quant_algo": algo, "group_size": GROUP_SIZE,
                             "exclude_modules": module_patterns(high_precision, quantized, Layout.MODELOPT)}}


def _modelopt_algo(w4a4: bool) -> str:
    return "NVFP4" if w4a4 else "W4A16_NVFP4"
