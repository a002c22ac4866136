"""``x @ w[layer]`` for a stack of layers' weights, reading the layer in place (decode
sizes, Pallas Triton) or slicing it out (the reference; everywhere else)."""
from .ops import BACKENDS, layer_matmul, layer_matmuls, resolve
from .pallas_triton import layer_matmul_pallas
from .reference import layer_matmul_reference

__all__ = ["BACKENDS", "layer_matmul", "layer_matmul_pallas", "layer_matmul_reference",
           "layer_matmuls", "resolve"]
