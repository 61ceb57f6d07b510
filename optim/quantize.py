"""Lp quantization of Lion update vectors (Lion Cub §4.2, eq. 1): `lp_quantize` and `lp_mean`.

The implementation is comm.quantize, the reference of the p-bit wire that comm.kernels fuses;
this module is its public name for optimizers and tools (docs/architecture.md).
"""
from comm.quantize import MAX_LEVELS, ROUNDINGS, levels_for_bits, lp_mean, lp_quantize

__all__ = ["MAX_LEVELS", "ROUNDINGS", "levels_for_bits", "lp_mean", "lp_quantize"]
