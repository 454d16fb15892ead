"""fp4lab.convert: MXFP4 -> NVFP4 conversion (mxfp4_to_nvfp4.py) and checkpoint conversion."""

from .mxfp4_to_nvfp4 import ConversionReport, ConvertMethod, mxfp4_to_nvfp4

__all__ = ["ConversionReport", "ConvertMethod", "mxfp4_to_nvfp4"]
