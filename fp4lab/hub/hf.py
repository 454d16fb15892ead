"""Hugging Face ``transformers``, an optional dependency (``pip install 'fp4lab[hub]'``): imported
only by what builds a model (eval, calibration, PTQ's choice of linears), with one clear error
where it is missing.

Public: ``transformers_module``, ``has_transformers``.
"""

from __future__ import annotations

import importlib.util

from ..train.errors import MissingDependency


def has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def transformers_module():
    try:
        import transformers
    except ImportError as err:
        raise MissingDependency("this builds the model with Hugging Face transformers: pip install 'fp4lab[hub]' "
                                f"(or transformers): {err}") from err
    return transformers
