"""The TileLang anchor: the plain 20-line TileLang GEMM (our own code in TileLang's language), best of the
three configs ../shared/ANCHORS.md measured.  Needs ``tilelang`` (on the H200: ``source .tlkit/install.sh``,
see ../shared/GPU.md); ``available()`` says why not when it is missing."""

import functools

CONFIGS = [(128, 256, 64, 256, 3), (128, 128, 64, 256, 3), (128, 128, 32, 128, 3)]  # bM, bN, bK, threads, stages


def available():
    """None when tilelang imports, else the reason."""
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: no TileLang column
        return f"{type(e).__name__}: {e}"
    return None


def _program(M, N, K, bM, bN, bK, threads, stages, dtype):
    import tilelang.language as T

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, bN), T.ceildiv(M, bM), threads=threads) as (bx, by):
            A_s = T.alloc_shared((bM, bK), dtype)
            B_s = T.alloc_shared((bK, bN), dtype)
            C_f = T.alloc_fragment((bM, bN), "float")
            T.clear(C_f)
            for k in T.Pipelined(T.ceildiv(K, bK), num_stages=stages):
                T.copy(A[by * bM, k * bK], A_s)
                T.copy(B[k * bK, bx * bN], B_s)
                T.gemm(A_s, B_s, C_f)
            T.copy(C_f, C[by * bM, bx * bN])

    return main


@functools.lru_cache(maxsize=None)
def kernels(M, N, K, dtype):
    """{config: compiled TileLang kernel taking (a, b) and returning c}; configs that fail are left out."""
    import tilelang

    out = {}
    for cfg in CONFIGS:
        try:
            out[cfg] = tilelang.compile(_program(M, N, K, *cfg, dtype), out_idx=[2])
        except Exception as e:  # noqa: BLE001 - a config TileLang cannot build is skipped, said once
            print(f"tilelang {M}x{N}x{K} {dtype} {cfg}: {type(e).__name__}: {e}"[:300])
    return out
