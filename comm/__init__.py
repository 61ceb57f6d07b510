"""comm/: packed 1-bit and p-bit collectives, parameter-server baselines, the error-feedback
compressed allreduce, byte/time accounting, and the alpha-beta cost model. Pure
torch.distributed; imports nothing of ours.

Every collective takes `group=None` (the default group) and `stats: CommStats | None = None`
(None books into `default_stats()`), and returns the same tensor on every rank.
"""
from . import cost_model, kernels, packing, quantize
from ._groups import all_gather_single, reduce_scatter_single, resolve_node_size, world
from .allreduce import (INT_BITS, allreduce_mean, allreduce_packed_, any_rank, check_lanes, int_allreduce, max_levels,
                        set_debug)
from .compressed import (COMPRESSORS, Compressor, as_compressor, compressed_bytes, ef_buffer_sizes,
                         ef_compressed_allreduce)
from .packing import ceil_div, lane_max, pack_bits, pack_lanes, unpack_bits, unpack_lanes, unpack_signs
from .ps import ps_vote
from .stats import CallRecord, Clock, CommStats, default_stats
from .vote import hierarchical_sign_vote, sign_vote_1bit, sign_vote_packed

__all__ = [
    "allreduce_mean", "allreduce_packed_", "any_rank", "check_lanes", "set_debug", "sign_vote_packed", "int_allreduce", "max_levels", "INT_BITS",
    "pack_bits", "pack_lanes", "unpack_bits", "unpack_lanes", "unpack_signs", "ceil_div", "lane_max",
    "ps_vote", "sign_vote_1bit", "hierarchical_sign_vote", "resolve_node_size", "world",
    "all_gather_single", "reduce_scatter_single",
    "CallRecord", "Clock", "CommStats", "default_stats", "cost_model", "kernels", "packing", "quantize",
    "ef_compressed_allreduce", "ef_buffer_sizes", "compressed_bytes", "Compressor",
    "as_compressor", "COMPRESSORS",
]
