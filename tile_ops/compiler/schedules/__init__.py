"""How a kernel's tile ops are ordered in time and over the GPU: ``cp_async`` (a pipelined loop's multi-stage
cp.async loads), ``warp_specialized`` (a producer warpgroup's TMA loads against consumer warpgroups, over
mbarriers, sm_90a), and what that one can add: ``persistent`` (CTAs walking the tiles), ``pingpong`` (two
consumer warpgroups taking tiles in turns) and ``stream_k`` (the last wave's tiles split along K)."""
