"""attn_implementation="tile_ops" on the GPU: the CPU suite's models (tests/test_transformers.py) in bf16 against sdpa:
a left-padded batch's logits, packed sequences, a training step's gradients, greedy generation with the KV cache."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import tile_ops.integrations.transformers  # noqa: E402,F401  (registers "tile_ops")
from test_transformers import MODELS, padded_batch  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)


def pair(name):
    """(sdpa model, tile_ops model), the same random weights, bf16 on the GPU; head dim 64."""
    torch.manual_seed(0)
    cfg = MODELS[name]()
    for k, v in WIDE.items():
        setattr(cfg, k, v)
    if hasattr(cfg, "head_dim"):
        cfg.head_dim = 64
    models = [transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.bfloat16)
              for impl in ("sdpa", "tile_ops")]
    models[1].load_state_dict(models[0].state_dict())
    return [m.cuda().eval() for m in models]


def _close(got, want, tol):
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < tol, err


@pytest.mark.parametrize("name", MODELS)
def test_logits_packing_and_gradients_agree_with_sdpa(name):
    sdpa, ours = pair(name)
    ids, mask = (t.cuda() for t in padded_batch())
    with torch.no_grad():
        want, got = sdpa(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    _close(got[mask.bool()], want[mask.bool()], 3e-2)
    seqs = [torch.randint(1, 128, (n,)).tolist() for n in (70, 129, 3)]
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    with torch.no_grad():
        packed = ours(batch["input_ids"].cuda(), position_ids=batch["position_ids"].cuda()).logits[0]
        alone = torch.cat([ours(torch.tensor([s], device="cuda")).logits[0] for s in seqs])
    _close(packed, alone, 3e-2)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (sdpa, ours):
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for g, w in zip(grads[1], grads[0]):
        _close(g, w, 5e-2)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_generation_runs_its_decode_steps_through_tile_ops(name):
    """Greedy generation of a left-padded batch: the tokens of the first steps agree with sdpa's (bf16 rounding can
    flip a near-tie later on random weights)."""
    sdpa, ours = pair(name)
    ids, mask = (t.cuda() for t in padded_batch(seed=3))
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw)[:, :ids.shape[1] + 2], sdpa.generate(ids, **kw)[:, :ids.shape[1] + 2])
