"""MoE grouped matmul: the Pallas Triton kernel (decode sizes), the Mosaic GPU kernel
(prefill sizes) and the ``ragged_dot`` reference; ops.py picks one."""
from .mgpu import grouped_matmul_mgpu, mgpu_tiles, padded_call, tile_table
from .ops import BACKENDS, grouped_matmul, resolve
from .pallas_triton import grouped_matmul_pallas
from .reference import grouped_matmul_reference

__all__ = ["BACKENDS", "grouped_matmul", "grouped_matmul_pallas", "grouped_matmul_reference",
           "grouped_matmul_mgpu", "mgpu_tiles", "padded_call", "resolve", "tile_table"]
