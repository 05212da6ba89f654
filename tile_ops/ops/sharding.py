"""DTensor sharding strategies for ``tile_ops::gemm``, so tensor parallelism (``ColwiseParallel``,
``RowwiseParallel``, ``parallelize_module``) runs it on each rank's local shards.

``out = a @ b (+ bias)`` with ``a (..., M, K)``, ``b (..., K, N)``, ``bias (N,)``, on one mesh dimension:
all replicated; the rows of ``a`` sharded (M); the columns of ``b`` sharded (N, the bias with them); or the
contraction dimension sharded (K), giving a Partial (summed) output and a Partial bias.

Registered on ``import tile_ops`` where ``torch.distributed.tensor`` is already loaded, else by the first
``tile_ops.gemm`` call after it is, eager or traced by torch.compile (importing it costs about half a second,
which a process without DTensor should not pay).
"""

import sys

_registered = False


def register_if_in_use() -> None:
    """Register the strategies once, if this process uses DTensor (its module is loaded)."""
    global _registered
    if _registered or "torch.distributed.tensor" not in sys.modules:
        return
    _registered = True
    _register()


def register_when_traced() -> bool:
    """``register_if_in_use`` for ``tile_ops.gemm`` under torch.compile: dynamo runs it while tracing (a
    registration is not an op to put in the graph), before DTensor propagates the op's sharding on fake
    shards.  A compiled first call would otherwise find no strategy."""
    register_if_in_use()
    return _registered


# torch.compiler.assume_constant_result's mark, set as torch marks its own functions (justknobs_check): the
# decorator imports dynamo, and DTensor with it, which `import tile_ops` should not
register_when_traced._dynamo_marked_constant = True


def _register() -> None:
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.tile_ops.gemm.default)
    def _gemm_sharding(a, b, bias=None, out_dtype=None):
        out_nd = max(a.ndim, b.ndim)

        def strategy(out, pa, pb, pbias):
            return [out], [pa, pb, pbias if bias is not None else None, None]

        return [
            strategy(Replicate(), Replicate(), Replicate(), Replicate()),
            strategy(Shard(out_nd - 2), Shard(a.ndim - 2), Replicate(), Replicate()),  # rows (M)
            strategy(Shard(out_nd - 1), Replicate(), Shard(b.ndim - 1), Shard(0)),  # columns (N)
            strategy(Partial(), Shard(a.ndim - 1), Shard(b.ndim - 2), Partial()),  # contraction (K)
        ]
