"""fp4lab: bit-exact NVFP4/MXFP4 numerics, Hopper emulation and FP4 training research.

Layers (imports point down only): formats (the spec) -> kernels -> nn -> train -> studies / cli.
"""

__version__ = "0.1.0"
