"""Property-based fuzzing of every op on the GPU against float64 (hypothesis): shapes, layouts, dtypes and
options drawn per op, outputs allocated over memory poisoned with NaN.  Each op runs in ``SHARDS`` tests (so
pytest-xdist spreads them), each drawing ``TILE_OPS_FUZZ_EXAMPLES`` cases (default 72: over 500 distinct cases
an op) from its own seed, ``TILE_OPS_FUZZ_SEED`` + shard; the seed is printed, and a failure shows the case
itself (hypothesis's falsifying example, shrunk) and the line that reruns it:

    TILE_OPS_FUZZ_SEED=<seed> python -m pytest tests/test_fuzz_gpu.py -k "<op> and <shard>"

What picks a kernel (static dims, layouts, dtypes, mask kinds, a fused softmax's scale) is drawn per shard from
its combinations (``kernel_kinds``: a few of them, other seeds cover others), what a kernel takes at launch
(M, batch, lengths, heads, window sizes, data) per case: a run builds tens of kernels, not hundreds."""

import itertools
import os
import random

import pytest
import torch

import tile_ops
from tile_ops.ops.attention import attention_reference

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, note, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEED = int(os.environ.get("TILE_OPS_FUZZ_SEED") or random.randrange(2**31))
EXAMPLES = int(os.environ.get("TILE_OPS_FUZZ_EXAMPLES", "72"))
SHARDS = 8
KINDS = 6  # kernels a shard draws its cases over
DISTINCT = 0.875  # of each shard's examples at least this share distinct (repeats are skipped): over 8 x 63
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float16: 5e-3, torch.bfloat16: 1e-2}  # relative Frobenius error against float64
ATTN_TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}  # max error over the largest |reference|


def fuzz(shard: int, cases, check, key, examples=EXAMPLES, distinct=DISTINCT):
    """Run ``check`` on ``examples`` cases drawn from ``cases`` with this shard's seed; at least ``distinct`` of
    them distinct by ``key``."""
    print(f"fuzz seed {SEED + shard}: rerun with TILE_OPS_FUZZ_SEED={SEED}")
    seen = set()

    @seed(SEED + shard)
    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case):
        assume(key(case) not in seen)  # a repeat does not count as one of the examples (a failing case is rerun)
        note(f"TILE_OPS_FUZZ_SEED={SEED}")
        check(case)
        seen.add(key(case))

    run()
    print(f"{len(seen)} distinct cases")
    assert len(seen) >= distinct * examples, f"only {len(seen)} distinct cases of {examples}"


def kernel_kinds(shard: int, **pools) -> list:
    """This shard's ``KINDS`` combinations of the options in ``pools`` (name -> values), drawn from its seed."""
    combos = [dict(zip(pools, values)) for values in itertools.product(*pools.values())]
    return random.Random(SEED + shard).sample(combos, min(KINDS, len(combos)))


def case_key(c: dict) -> tuple:
    """What makes two cases distinct: everything but the data's seed."""
    return tuple(sorted((k, v) for k, v in c.items() if k != "seed"))


def poison(nbytes=256 << 20):
    """Fill freed allocator memory with NaN, so an output element the kernel leaves unwritten shows up."""
    t = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del t


def randn(*shape, dtype, gen):
    return torch.randn(*shape, device=gen.device, generator=gen).to(dtype)


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def operand(rows, cols, dtype, transposed, batch, gen):
    """A (batch..., rows, cols) operand, stored row-major or as the transpose of a (cols, rows) one."""
    lead = (batch,) if batch else ()
    if transposed:
        return randn(*lead, cols, rows, dtype=dtype, gen=gen).transpose(-1, -2)
    return randn(*lead, rows, cols, dtype=dtype, gen=gen)


# --------------------------------------------------------------------------- gemm


def gemm_kinds(shard, N=(8, 72, 255, 1000, 4096), K=(13, 64, 200, 1024, 4096)):
    return kernel_kinds(shard, N=N, K=K, dtype=sorted(DTYPES), ta=(False, True), tb=(False, True),
                        bias=(False, True), out_fp32=(False, True), b_batched=(False, True))


@st.composite
def gemm_cases(draw, kinds, max_m=4000):
    return dict(draw(st.sampled_from(kinds)), M=draw(st.integers(1, max_m)), batch=draw(st.sampled_from([0, 0, 1, 3])),
                seed=draw(st.integers(0, 2**16)))


def check_gemm(c, device="cuda"):
    """The op against float64 (on the CPU the op is its float32 reference)."""
    dtype, gen = DTYPES[c["dtype"]], torch.Generator(device=device).manual_seed(c["seed"])
    a = operand(c["M"], c["K"], dtype, c["ta"], c["batch"], gen)
    b = operand(c["K"], c["N"], dtype, c["tb"], c["batch"] if c["b_batched"] else 0, gen)
    bias = randn(c["N"], dtype=dtype, gen=gen) if c["bias"] else None
    if device == "cuda":
        poison()
    out = tile_ops.gemm(a, b, bias=bias, out_dtype=torch.float32 if c["out_fp32"] else None)
    ref = torch.matmul(a.double(), b.double()) + (0 if bias is None else bias.double())
    assert out.shape == ref.shape and out.dtype == (torch.float32 if c["out_fp32"] else dtype)
    assert not out.isnan().any(), "an element was left unwritten (NaN)"
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_gemm(shard):
    fuzz(shard, gemm_cases(gemm_kinds(shard)), check_gemm, case_key)


# --------------------------------------------------------------------------- gemm_softmax


@st.composite
def gemm_softmax_cases(draw, kinds):
    return dict(draw(st.sampled_from(kinds)), M=draw(st.integers(1, 3000)), batch=draw(st.sampled_from([0, 0, 2])),
                seed=draw(st.integers(0, 2**16)))


def check_gemm_softmax(c):
    dtype, gen = DTYPES[c["dtype"]], torch.Generator(device="cuda").manual_seed(c["seed"])
    a = operand(c["M"], c["K"], dtype, c["ta"], c["batch"], gen)
    b = operand(c["K"], c["N"], dtype, c["tb"], c["batch"], gen)
    poison()
    out = tile_ops.gemm_softmax(a, b, c["scale"], out_dtype=torch.float32 if c["out_fp32"] else None)
    ref = torch.softmax(torch.matmul(a.double(), b.double()) * c["scale"], -1)
    assert out.shape == ref.shape and not out.isnan().any(), "an element was left unwritten (NaN)"
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_gemm_softmax(shard):
    kinds = kernel_kinds(shard, N=(8, 100, 256, 1000, 2048, 8192), K=(16, 64, 200, 1024), dtype=sorted(DTYPES),
                         ta=(False, True), tb=(False, True), out_fp32=(False, True), scale=(0.05, 0.125, 1.0))
    fuzz(shard, gemm_softmax_cases(kinds), check_gemm_softmax, case_key)


# --------------------------------------------------------------------------- attention


def attention_kinds(shard, backward=False, dims=(64, 96, 128, 192, 256)):
    """The forward's kernels are per (head dim, dtype, causal, local, softcap, ALiBi); the backward's draw softcap
    and ALiBi together, and dQ's kernel (``deterministic``) apart."""
    kinds = dict(D=dims, dtype=sorted(DTYPES), causal=(False, True), local=(False, True))
    extra = dict(transform=(False, True), deterministic=(False, True)) if backward else \
        dict(capped=(False, True), alibi=(False, True))
    return kernel_kinds(shard, **kinds, **extra)


@st.composite
def attention_cases(draw, kinds, max_len=600):
    kind = dict(draw(st.sampled_from(kinds)))
    transform = kind.pop("transform", None)
    capped, alibi = (transform, transform) if transform is not None else (kind.pop("capped"), kind.pop("alibi"))
    Hq, Hkv = draw(st.sampled_from([(1, 1), (2, 2), (4, 1), (4, 2), (6, 3)]))
    local = kind.pop("local")
    return dict(kind, B=draw(st.integers(1, 3)), Hq=Hq, Hkv=Hkv, Sq=draw(st.integers(1, max_len)),
                Sk=draw(st.integers(1, max_len)), bhsd=draw(st.booleans()), alibi=alibi,
                window=(draw(st.integers(-1, 300)), draw(st.integers(-1, 60))) if local else (-1, -1),
                softcap=draw(st.sampled_from([5.0, 30.0])) if capped else 0.0,
                scale=draw(st.one_of(st.none(), st.floats(0.02, 1.0))), seed=draw(st.integers(0, 2**16)))


def attention_inputs(c, gen):
    """q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D); with ``bhsd`` (B, H, S, D) storage seen through a transpose."""
    dtype = DTYPES[c["dtype"]]
    out = []
    for S, H in ((c["Sq"], c["Hq"]), (c["Sk"], c["Hkv"]), (c["Sk"], c["Hkv"])):
        shape = (c["B"], H, S, c["D"]) if c["bhsd"] else (c["B"], S, H, c["D"])
        t = randn(*shape, dtype=dtype, gen=gen)
        out.append(t.transpose(1, 2) if c["bhsd"] else t)
    slopes = torch.rand(c["Hq"], device=gen.device, generator=gen) * 0.3 if c["alibi"] else None
    return out, slopes


def options(c, slopes):
    return dict(softmax_scale=c["scale"], causal=c["causal"], window_size=c["window"], softcap=c["softcap"],
                alibi_slopes=slopes)


def max_err(x, ref, floor=1e-6):
    """The largest error over the largest |reference|, or over ``floor`` where that is smaller (a gradient that
    is exactly 0, e.g. dQ of a row that sees one key, comes out as rounding noise)."""
    return ((x.double() - ref).abs().max() / ref.abs().max().clamp_min(floor)).item()


def check_attention(c, device="cuda", oracle=attention_reference):
    """The op's output and LSE against ``oracle``'s in float64 (on the CPU the op is the float32 reference)."""
    gen = torch.Generator(device=device).manual_seed(c["seed"])
    (q, k, v), slopes = attention_inputs(c, gen)
    if device == "cuda":
        poison()
    out, lse, _ = tile_ops.flash_attn_func(q, k, v, return_attn_probs=True, **options(c, slopes))
    ref, ref_lse = oracle(q.double(), k.double(), v.double(), return_lse=True, **options(c, slopes))
    assert not out.isnan().any() and not lse.isnan().any(), "an element was left unwritten (NaN)"
    assert torch.equal(lse.isinf(), ref_lse.isinf()), "rows that see no key differ"
    finite = ~ref_lse.isinf()
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    assert max_err(out, ref) < ATTN_TOL[q.dtype], max_err(out, ref)


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_flash_attention(shard):
    fuzz(shard, attention_cases(attention_kinds(shard)), check_attention, case_key)


def check_attention_backward(c):
    gen = torch.Generator(device="cuda").manual_seed(c["seed"])
    (q, k, v), slopes = attention_inputs(c, gen)
    dout = randn(c["B"], c["Sq"], c["Hq"], c["D"], dtype=q.dtype, gen=gen)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    poison()
    out = tile_ops.flash_attn_func(q, k, v, deterministic=c["deterministic"], **options(c, slopes))
    got = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_reference(q64, k64, v64, **options(c, slopes)), (q64, k64, v64),
                               dout.double())
    tol = 3e-2 if q.dtype == torch.bfloat16 else 1e-2
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert not g.isnan().any(), f"{name}: an element was left unwritten (NaN)"
        assert max_err(g, w, floor=1e-2) < tol, (name, max_err(g, w, floor=1e-2))


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_flash_attention_backward(shard):
    fuzz(shard, attention_cases(attention_kinds(shard, backward=True), max_len=300), check_attention_backward,
         case_key)


# --------------------------------------------------------------------------- varlen


@st.composite
def varlen_cases(draw, kinds):
    lengths_q = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
    same = draw(st.booleans())  # self-attention over one set of offsets, or K/V lengths of their own
    lengths_k = lengths_q if same else draw(st.lists(st.integers(0, 300), min_size=len(lengths_q),
                                                     max_size=len(lengths_q)))
    kind = dict(draw(st.sampled_from(kinds)))
    Hq, Hkv = draw(st.sampled_from([(2, 2), (4, 1), (4, 2)]))
    window = (draw(st.integers(0, 200)), draw(st.integers(0, 40))) if kind.pop("local") else (-1, -1)
    return dict(kind, lq=tuple(lengths_q), lk=tuple(lengths_k), Hq=Hq, Hkv=Hkv, window=window,
                seed=draw(st.integers(0, 2**16)))


def check_varlen(c):
    dtype, gen = DTYPES[c["dtype"]], torch.Generator(device="cuda").manual_seed(c["seed"])
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=gen.device)
          for lens in (c["lq"], c["lk"])]
    q = randn(sum(c["lq"]), c["Hq"], c["D"], dtype=dtype, gen=gen)
    k, v = (randn(sum(c["lk"]), c["Hkv"], c["D"], dtype=dtype, gen=gen) for _ in range(2))
    poison()
    out = tile_ops.flash_attn_varlen_func(q, k, v, cu[0], cu[1], max(c["lq"]), max(c["lk"]), causal=c["causal"],
                                          window_size=c["window"])
    assert out.shape == q.shape and not out.isnan().any(), "an element was left unwritten (NaN)"
    for i, (sq, sk) in enumerate(zip(c["lq"], c["lk"])):
        if sq == 0:
            continue
        rows, keys = slice(int(cu[0][i]), int(cu[0][i + 1])), slice(int(cu[1][i]), int(cu[1][i + 1]))
        ref = attention_reference(q[None, rows].double(), k[None, keys].double(), v[None, keys].double(),
                                  causal=c["causal"], window_size=c["window"])[0]
        assert max_err(out[rows], ref) < ATTN_TOL[dtype], (i, max_err(out[rows], ref))


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_flash_attention_varlen(shard):
    kinds = kernel_kinds(shard, D=(64, 128, 256), dtype=sorted(DTYPES), causal=(False, True), local=(False, True))
    fuzz(shard, varlen_cases(kinds), check_varlen, case_key)
