"""What the FlashAttention kernels share: which keys a query sees (the causal diagonal, aligned bottom-right, and
sliding windows), the tiles a block walks because of it, and the score of a (query, key) pair.  Traced inside a
kernel: sizes and bounds are the kernel's launch-time values."""

import inspect

import tile_ops.lang as T

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def strided(name: str, dims: tuple, dtype: str, vec: int):
    """A (B, H, S, D) view whose batch, head and row strides are read at launch (multiples of ``vec``)."""
    strides = tuple(T.dynamic(f"{name}_stride_{axis}", multiple_of=vec) for axis in "bhs")
    return T.Tensor(dims, dtype, strides=strides + (1,))


class Window:
    """Query q sees key k when k < Sk and k lies in [diagonal - left, diagonal + right], the diagonal being
    q + Sk - Sq.  A bound is None (unbounded), a constant, or a launch-time scalar where -1 means unbounded:
    ``causal`` fixes right at 0; without ``local`` the window sizes are not read."""

    def __init__(self, Sq, Sk, causal: bool, local: bool, left, right):
        self.Sq, self.Sk = Sq, Sk
        self.right = 0 if causal else right if local else None
        self.left = left if local else None

    @staticmethod
    def _bounded(bound, within, otherwise):
        """``within(bound)`` where ``bound`` bounds the window, else ``otherwise``."""
        return otherwise if bound is None else within(bound) if isinstance(bound, int) else \
            T.where(bound >= 0, within(bound), otherwise)

    def visible(self, q, k):
        diagonal = q + (self.Sk - self.Sq)
        return ((k < self.Sk) & self._bounded(self.right, lambda r: k <= diagonal + r, True)
                & self._bounded(self.left, lambda w: k >= diagonal - w, True))

    def key_tiles(self, q0, rows: int, bN: int):
        """(first, count) of the ``bN``-key tiles that queries [q0, q0 + rows) see."""
        shift = self.Sk - self.Sq
        end = self._bounded(self.right, lambda r: T.min(self.Sk, q0 + rows + shift + r), self.Sk)
        first = self._bounded(self.left, lambda w: T.max(q0 + shift - w, 0), 0) // bN
        return first, T.max(T.ceildiv(end, bN) - first, 0)

    def query_tiles(self, k0, cols: int, bM: int):
        """(first, count) of the ``bM``-query tiles that see any of keys [k0, k0 + cols)."""
        shift = self.Sk - self.Sq
        first = self._bounded(self.right, lambda r: T.max(k0 - shift - r, 0), 0) // bM
        end = self._bounded(self.left, lambda w: T.max(T.min(self.Sq, k0 + cols + w - shift), 0), self.Sq)
        return first, T.max(T.ceildiv(end, bM) - first, 0)


def score_log2(s, q, k, Sq, Sk, scale, cap, slope, softcap: bool, alibi: bool):
    """The score of query ``q`` and key ``k`` in log2 units, from their raw product ``s``: s * scale, or with
    ``softcap`` cap * tanh(s * scale / cap); with ``alibi`` less slope * |distance to the diagonal|."""
    x = T.tanh(s * scale / cap) * (cap * LOG2E) if softcap else s * (scale * LOG2E)
    if alibi:
        x = x - slope * LOG2E * T.cast(T.abs(q + (Sk - Sq) - k), "float32")
    return x


def signature(B, Hq, alibi, varlen, tensors: dict):
    """A kernel's parameters: ``tensors`` (name -> T.Tensor), ALiBi's (B, Hq) slopes (a slope per sequence and head
    with ``varlen``), the packed sequences' tile table and offsets, the scalars."""
    params = dict(tensors)
    if alibi:
        params["Slopes"] = T.Tensor((T.dynamic("sequences") if varlen else B, Hq), "float32",
                                    strides=(T.dynamic("slopes_stride_b"), 1))
    if varlen:
        cu = T.dynamic("sequences_1")
        params.update(Tiles=T.Tensor((T.dynamic("tiles"), 2), "int32"), CuQ=T.Tensor((cu,), "int32"),
                      CuK=T.Tensor((cu,), "int32"))
    f32, i32 = T.Scalar("float32"), T.Scalar("int32")
    return {**params, "scale": f32, "softcap": f32, "window_left": i32, "window_right": i32}


def sequence(varlen, blocks, Tiles, CuQ, CuK, Sq, Sk):
    """(block index, head, batch entry, sequence, query start, key start, query length, key length) of a block:
    with ``varlen`` its tile's (sequence, block) from ``Tiles`` and the sequence's rows in the packed tensors."""
    if not varlen:
        bx, h, b = blocks
        return bx, h, b, b, 0, 0, Sq, Sk
    tile, h = blocks
    seq, block = T.bind(Tiles[tile, 0], "seq"), T.bind(Tiles[tile, 1], "block")
    q_start, k_start = T.bind(CuQ[seq], "q_start"), T.bind(CuK[seq], "k_start")
    return block, h, 0, seq, q_start, k_start, T.bind(CuQ[seq + 1] - q_start, "seq_q"), \
        T.bind(CuK[seq + 1] - k_start, "seq_k")


def store_rows(varlen, tile, dst, b, h, start, r0, length):
    """dst[b, h, start + r0 + i] = tile[i] for the tile's rows: with ``varlen`` only those before ``length`` (the
    next sequence's rows follow)."""
    if not varlen:
        T.copy(tile, dst[b, h, r0, 0])
        return
    for i, d in T.Parallel(*tile.shape):
        with T.when(r0 + i < length):
            dst[b, h, start + r0 + i, d] = tile[i, d]


def kernel_function(name: str, params: dict, body):
    """``body(**arguments)`` as a function whose signature is ``params`` (name -> T.Tensor or T.Scalar), for
    ``T.prim_func``: a kernel whose parameter list depends on its compile-time options (ALiBi's slopes)."""
    def fn(*args):
        return body(**dict(zip(params, args)))

    fn.__name__ = fn.__qualname__ = name
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=a)
                                          for n, a in params.items()])
    return fn
