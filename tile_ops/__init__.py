"""tile_ops: a tile-level GPU kernel language on TVM TIRx, and a PyTorch op library written in it."""

__version__ = "0.1.0"

from .jit import jit, compile  # noqa: E402,F401
from .jit.interpret import interpret  # noqa: E402,F401
from . import lang  # noqa: E402,F401
from .ops import flash_attn_func, flash_attn_varlen_func, gemm, gemm_softmax  # noqa: E402,F401
from . import nn  # noqa: E402,F401
