"""tile_ops.autotune — find and remember the fastest kernel config per (GPU, op, shape, dtype).

Each op's kernel declares its space, its heuristic default and a shared-memory estimate, which the op
hands the tuner as a :class:`~.targets.Target` (registered by its ``OpSpec``).  :func:`tune`
prunes the space, compiles the candidates in parallel, checks and times them on the GPU (CUDA events,
warm-up, rotating inputs), and records the fastest in ``<cache_dir()>/autotune.json``.  The ops ask
:func:`config_for` which config to launch: the tuned one (exact shape, else same N and K with M in the
same power-of-two bucket), else the heuristic.  ``python -m tile_ops tune ...`` is the command line.
"""

from .table import (TuneTable, config_for, config_from_dict, config_to_dict, gpu_name, lookup, record, reload,
                    shape_bucket, table_path)
from .tuner import Candidate, TuneResult, tune

__all__ = ["Candidate", "TuneResult", "TuneTable", "config_for", "config_from_dict", "config_to_dict", "gpu_name",
           "lookup", "record", "reload", "shape_bucket", "table_path", "tune"]
