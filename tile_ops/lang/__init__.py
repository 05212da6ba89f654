"""tile_ops.lang — the tile language (``import tile_ops.lang as T``).

A TileLang-style surface: kernels are written over shared-memory tiles and register
fragments with block-collective tile operations; the compiler picks thread mappings,
layouts, swizzles, synchronization, pipelining and instructions.

Importing this module does not import TVM: TVM is loaded when a program is first traced,
so a process whose kernels all come from the disk cache never loads the compiler.
"""

from .errors import SharedMemoryError, TileLangError  # noqa: F401

float16, bfloat16, float32, float64, int32 = "float16", "bfloat16", "float32", "float64", "int32"
MAX_CLUSTER = 8  # blocks in a thread-block cluster: the portable maximum (T.Kernel(..., cluster=n))
# T.row_reduce_store: tiles a row, on distinct CTAs of any Hopper grid (a 16-SM MIG slice included): a CTA
# holding two tiles of a row would wait for its own later one
MAX_ROW_TILES = 16

_FRONTEND = {
    "Kernel", "Parallel", "Pipelined", "Scalar", "Tensor", "abs", "atomic_add", "alloc_fragment", "alloc_local",
    "alloc_shared", "bind", "cast", "ceildiv", "clear", "cluster_allreduce", "copy", "deferred", "dynamic", "fill", "gemm",
    "if_then_else", "infinity", "max", "min", "prim_func", "reduce_max", "reduce_min", "reduce_sum", "row_reduce_store", "serial",
    "unroll", "use_swizzle", "when", "where",
    # math on floating values
    "atan", "ceil", "cos", "erf", "exp", "exp2", "floor", "log", "log1p", "log2", "pow", "round", "rsqrt", "sigmoid",
    "sin", "sqrt", "tan", "tanh", "trunc",
}


def known_multiple(dim) -> int:
    """What a tensor dimension is known to be a multiple of: itself (an int), or a ``T.dynamic`` size's
    ``multiple_of``."""
    return dim if isinstance(dim, int) else dim.multiple_of


def __getattr__(name):
    if name in _FRONTEND:
        from . import frontend

        return getattr(frontend, name)
    names = sorted(n for n in __dir__() if not n.startswith("_"))
    raise AttributeError(f"tile_ops.lang has no {name!r}; the language's names: {', '.join(names)}")


def __dir__():
    return sorted(set(globals()) | _FRONTEND)
