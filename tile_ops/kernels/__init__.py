"""The library's kernels, written in tile_ops.lang.  Each op's kernel is a few modules side by side:

    <op>.py           the programs (``@tile_ops.jit`` factories returning ``@T.prim_func``s)
    <op>_config.py    the config type, what it cannot build, its shared-memory estimate
    <op>_defaults.py  the configs tuned per GPU (data) and the heuristic choosing among them
    <op>_space.py     the autotuner's candidates
    <op>_launch.py    the torch side: the kernel an op call launches, its launch and its fast-path plan
"""
