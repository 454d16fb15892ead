"""What an NVFP4 checkpoint directory declares: its layout, W4A4 or weight-only, and the patterns
of modules kept in high precision, read from ``config.json`` (and ModelOpt's
``hf_quant_config.json``), with a finding for each field an engine's loader would reject or
misread. The expected values are those of the schema table in docs/checkpoints.md.

Public: ``Declared``, ``read_declared``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..convert.layouts import GROUP_SIZE, Layout
from .finding import Finding

_NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP_SIZE,
               "symmetric": True}
_MODELOPT_ALGOS = {"NVFP4": True, "W4A16_NVFP4": False}  # quant_algo -> W4A4


@dataclass(kw_only=True)
class Declared:
    layout: Layout
    w4a4: bool
    """activations declared NVFP4 too: every quantized module needs its input global scale"""
    ignore: list[str]
    """patterns of modules declared high precision"""
    targets: list[str] | None
    """compressed-tensors targets (names, re: patterns or class names); None: every Linear"""
    findings: list[Finding] = field(default_factory=list)


def _load(path: Path, findings: list[Finding]) -> dict | None:
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        findings.append(Finding("error", "bad-json", path.name, f"not valid JSON: {err}"))
        return None
    if not isinstance(value, dict):
        findings.append(Finding("error", "bad-json", path.name, "is not a JSON object"))
        return None
    return value


def _expect(findings: list[Finding], where: str, args: dict, expected: dict) -> None:
    for key, value in expected.items():
        if args.get(key) != value:
            findings.append(Finding("error", "config-field", where,
                                    f"{key} is {args.get(key)!r}, expected {value!r} for NVFP4"))


def _compressed_tensors(qc: dict, findings: list[Finding]) -> Declared:
    where = "config.json quantization_config"
    if qc.get("quantization_status") != "compressed":
        findings.append(Finding("error", "config-field", where, f"quantization_status is "
                                f"{qc.get('quantization_status')!r}: packed weights need 'compressed'"))
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        findings.append(Finding("error", "config-field", where, "config_groups is missing or empty"))
        groups = {}
    targets, w4a4 = [], False
    for name, group in groups.items():
        at = f"{where}.config_groups.{name}"
        fmt = group.get("format", qc.get("format"))
        if fmt != "nvfp4-pack-quantized":
            findings.append(Finding("error", "config-field", at, f"format is {fmt!r}, expected 'nvfp4-pack-quantized'"))
        if not isinstance(group.get("targets"), list) or not group["targets"]:
            findings.append(Finding("error", "config-field", at, "targets is missing or empty"))
        targets += group.get("targets") or []
        _expect(findings, at + ".weights", group.get("weights") or {}, {**_NVFP4_ARGS, "dynamic": False})
        acts = group.get("input_activations")
        if acts is not None:
            w4a4 = True
            _expect(findings, at + ".input_activations", acts, {**_NVFP4_ARGS, "dynamic": "local"})
    ignore = qc.get("ignore") or []
    return Declared(layout=Layout.COMPRESSED_TENSORS, w4a4=w4a4, ignore=list(ignore), targets=targets,
                    findings=findings)


def _modelopt(qc: dict | None, hq: dict | None, findings: list[Finding]) -> Declared:
    algo, ignore = None, None
    if hq is not None:
        q = hq.get("quantization") or {}
        algo, ignore = q.get("quant_algo"), q.get("exclude_modules")
        if "quantized_tensors" in q:
            findings.append(Finding("warning", "config-field", "hf_quant_config.json",
                                    "quantization.quantized_tensors is not a key ModelOpt's loaders read"))
        if ignore is None:
            findings.append(Finding("error", "config-field", "hf_quant_config.json",
                                    "quantization.exclude_modules is missing: every linear is taken as quantized"))
        if q.get("group_size", GROUP_SIZE) != GROUP_SIZE:
            findings.append(Finding("error", "config-field", "hf_quant_config.json",
                                    f"group_size is {q.get('group_size')!r}, expected {GROUP_SIZE}"))
    else:
        findings.append(Finding("warning", "config-missing", "hf_quant_config.json",
                                "absent: TensorRT-LLM and older vLLM look for it"))
    if qc is not None:
        if hq is not None and qc.get("quant_algo") != algo:
            findings.append(Finding("error", "config-mismatch", "config.json quantization_config",
                                    f"quant_algo {qc.get('quant_algo')!r} differs from hf_quant_config.json's {algo!r}"))
        if hq is not None and ignore is not None and sorted(qc.get("ignore") or []) != sorted(ignore):
            findings.append(Finding("error", "config-mismatch", "config.json quantization_config",
                                    "ignore differs from hf_quant_config.json's exclude_modules"))
        # vLLM reads config.json's form before hf_quant_config.json: its list decides
        algo, ignore = qc.get("quant_algo", algo), qc.get("ignore", ignore)
        if qc.get("group_size", GROUP_SIZE) != GROUP_SIZE:
            findings.append(Finding("error", "config-field", "config.json quantization_config",
                                    f"group_size is {qc.get('group_size')!r}, expected {GROUP_SIZE}"))
    if algo not in _MODELOPT_ALGOS:
        findings.append(Finding("error", "config-field", "quant_algo",
                                f"{algo!r} is not an NVFP4 algorithm ({', '.join(_MODELOPT_ALGOS)})"))
    return Declared(layout=Layout.MODELOPT, w4a4=_MODELOPT_ALGOS.get(algo, False), ignore=list(ignore or []),
                    targets=None, findings=findings)


def read_declared(root: Path) -> Declared | list[Finding]:
    """The directory's declared NVFP4 layout, or (when it declares none) the findings that say why."""
    findings: list[Finding] = []
    config = _load(root / "config.json", findings)
    hq = _load(root / "hf_quant_config.json", findings)
    if config is None and not findings:
        findings.append(Finding("error", "config-missing", "config.json",
                                "absent: transformers and vLLM read the quantization config there"))
    qc = (config or {}).get("quantization_config")
    method = (qc or {}).get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, findings)
    if method == "modelopt" or (qc is None and hq is not None):
        if qc is None and config is not None:
            findings.append(Finding("warning", "config-missing", "config.json",
                                    "has no quantization_config: transformers will not see the quantization"))
        return _modelopt(qc, hq, findings)
    if config is not None:
        found = f"quant_method {method!r}" if qc is not None else "no quantization_config"
        findings.append(Finding("error", "config-layout", "config.json",
                                f"{found}: not an NVFP4 layout (compressed-tensors or modelopt)"))
    return findings
