"""DTensor sharding strategies for the ops that declare them (``OpSpec.sharding``, e.g. ``tile_ops::gemm``), so
tensor parallelism (``ColwiseParallel``, ``RowwiseParallel``, ``parallelize_module``) runs them on each rank's
local shards.

Registered on ``import tile_ops`` where ``torch.distributed.tensor`` is already loaded, else by the first
``tile_ops.gemm`` call after it is, eager or traced by torch.compile (importing it costs about half a second,
which a process without DTensor should not pay).
"""

import sys

_registered = False


def register_if_in_use() -> None:
    """Register the strategies once, if this process uses DTensor (its module is loaded): every op's, so the ops
    are all registered first (``import tile_ops``)."""
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
    from torch.distributed.tensor.experimental import register_sharding

    from .spec import SPECS

    for spec in SPECS.values():
        if spec.sharding is not None:
            register_sharding(getattr(torch.ops.tile_ops, spec.name).default)(spec.sharding)
