"""Hugging Face ``transformers``, an optional dependency (``pip install 'fp4lab[hub]'``): imported
only by what builds a model (eval, calibration), with one clear error where it is missing."""

from __future__ import annotations


def transformers_module():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("this builds the model with Hugging Face transformers: pip install 'fp4lab[hub]' "
                          "(or transformers)") from err
    return transformers
