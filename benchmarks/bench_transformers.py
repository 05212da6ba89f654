"""A Llama-shaped HuggingFace model with sdpa, with tile_ops attention, and with tile_ops attention + linears, one process.

    python benchmarks/bench_transformers.py [--layers 8] [--batch 4] [--tokens 4096] [--rep-ms 2000] [--json out.json]

Random weights at Llama-3-8B's width (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336), bf16: prefill tokens/s
(``--batch`` x ``--tokens``, no grad), a training step's time (forward + backward of the LM loss, batch 1), and a
generation loop's tokens/s (greedy, ``--batch`` prompts of 512 tokens, 128 new tokens with the KV cache; its decode
steps are tile_ops' forward kernel with one query row, no split-KV kernel yet).  Each model first checks its
prefill logits against sdpa's.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import bench_ms, print_table, save  # noqa: E402

import tile_ops.integrations.transformers as hf  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def model(layers: int, attn: str, linears: bool):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.bfloat16).cuda()
    return hf.apply(m) if linears else m


def measure(m, args, ref_logits=None):
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.tokens), device="cuda", generator=gen)
    m.eval()
    with torch.no_grad():
        logits = m(ids[:1, :512]).logits
        err = "-" if ref_logits is None else \
            f"{((logits.float() - ref_logits).abs().max() / ref_logits.abs().max()).item():.1e}"
        prefill = bench_ms(lambda: m(ids).logits, rep_ms=args.rep_ms)
    m.train()
    one = ids[:1]

    def step():
        m.zero_grad(set_to_none=True)
        m(one, labels=one).loss.backward()
    train = bench_ms(step, rep_ms=args.rep_ms)
    m.zero_grad(set_to_none=True)
    m.eval()
    prompts = ids[:, :512]
    _generate_s(m, prompts, 8)  # warm-up
    gen_s = min(_generate_s(m, prompts) for _ in range(3))  # the best of three: the host's jitter is large
    return logits.float(), dict(err=err, prefill_tok_s=f"{args.batch * args.tokens / prefill * 1e3:,.0f}",
                                train_step_ms=f"{train:.1f}", generate_tok_s=f"{args.batch * 128 / gen_s:,.0f}")


def _generate_s(m, prompts, tokens: int = 128) -> float:
    """Seconds of a greedy generation of ``tokens`` new tokens after each prompt."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.generate(prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
               attention_mask=torch.ones_like(prompts), pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rep-ms", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows, ref = [], None
    for label, attn, linears in (("sdpa", "sdpa", False), ("tile_ops attention", "tile_ops", False),
                                 ("tile_ops attention + linears", "tile_ops", True)):
        m = model(args.layers, attn, linears)
        logits, row = measure(m, args, ref)
        ref = logits if ref is None else ref
        rows.append(dict(model=label, **row))
        print(rows[-1], file=sys.stderr)
        del m
        torch.cuda.empty_cache()
    print_table(rows, ["model", "err", "prefill_tok_s", "train_step_ms", "generate_tok_s"],
                f"Llama-shaped, {args.layers} layers, bf16, on {torch.cuda.get_device_name()}")
    save(rows, args.json)


if __name__ == "__main__":
    main()
