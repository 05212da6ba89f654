"""attn_implementation="tile_ops" in HuggingFace models on the CPU (tile_ops' reference path), beside eager attention,
from small random configs (no downloads): Llama (GQA), Qwen3, Mistral (sliding window), Gemma 2 (softcap,
alternating sliding windows) and Phi-3: a left-padded batch's logits, packed sequences against the unpacked run,
a training step's gradients, greedy generation with the KV cache, a compiled forward without graph breaks, the
three ways to switch a model, and apply(model)'s linears."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import tile_ops.integrations.transformers as hf  # noqa: E402  (registers "tile_ops")
from tile_ops.integrations.linear import Linear  # noqa: E402
from tile_ops.ops.attention import FLASH_ATTENTION  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
MODELS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=5),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=5, attn_logit_softcapping=20.0,
                                                final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "phi3": lambda: transformers.Phi3Config(**SMALL),
}


def pair(name):
    """(eager model, tile_ops model) with the same random weights, in eval mode."""
    torch.manual_seed(0)
    cfg = MODELS[name]()
    eager = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="tile_ops").eval()
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "tile_ops"
    return eager, ours


def padded_batch(seed=0, lengths=(13, 8, 11)):
    """Token ids (len(lengths), 13), left-padded, and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", MODELS)
def test_left_padded_logits_agree_with_eager(name):
    eager, ours = pair(name)
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.allclose(got[real], want[real], atol=1e-4), (got[real] - want[real]).abs().max()


@pytest.mark.parametrize("name", MODELS)
def test_packed_sequences_agree_with_the_unpacked_run(name):
    """DataCollatorWithFlattening's batch (one row, position_ids restarting per sequence): transformers turns the
    positions into varlen calls; each sequence's logits are those of running it alone."""
    _, ours = pair(name)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (7, 12, 3)]
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": s} for s in seqs])
    with torch.no_grad():
        packed = ours(batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([ours(torch.tensor([s])).logits[0] for s in seqs])
    assert torch.allclose(packed, alone, atol=1e-4), (packed - alone).abs().max()


@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients_agree_with_eager(name):
    eager, ours = pair(name)
    ids, mask = padded_batch(seed=2)
    labels = ids.masked_fill(mask == 0, -100)
    grads = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, atol=1e-5, rtol=1e-4), (n, (grads[1][n] - g).abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_with_the_cache_gives_eager_tokens(name):
    """Prefill of a left-padded batch, then decode steps of one query against the KV cache."""
    eager, ours = pair(name)
    ids, mask = padded_batch(seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.mark.parametrize("name", MODELS)
def test_compiled_forward_has_no_graph_break(name):
    """torch.compile(model, fullgraph=True) in bf16, as models run (transformers' flash path logs a warning, a graph
    break of its own, when it casts float32 activations)."""
    _, ours = pair(name)
    ours.to(torch.bfloat16)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(ids).logits.float(), ours(ids).logits.float()
    assert torch.allclose(got, want, atol=2e-2 * want.abs().max().item())


def test_every_way_of_switching_a_model(tmp_path, monkeypatch):
    """from_pretrained(..., attn_implementation="tile_ops"), from_config (above) and set_attn_implementation all run
    attention through tile_ops' op: the registered function is called."""
    eager, _ = pair("llama")
    eager.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="tile_ops")
    switched = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    switched.set_attn_implementation("tile_ops")
    calls = []
    real = FLASH_ATTENTION.op

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    ids = torch.randint(1, 128, (1, 6))
    monkeypatch.setattr(FLASH_ATTENTION, "op", counted)  # what flash_attn_func calls
    hf_attention = transformers.AttentionInterface()["tile_ops"]
    assert hf_attention is hf.attention_forward
    for model in (loaded, switched):
        with torch.no_grad():
            model(ids)
    assert len(calls) == 4  # two layers, two models


def test_apply_switches_attention_and_linears():
    eager, _ = pair("llama")
    ids, mask = padded_batch()
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
    model = hf.apply(eager)
    assert model.config._attn_implementation == "tile_ops"
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)  # q/k/v/o, MLP and the output head
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-4)


def test_what_flash_attention_cannot_give_is_refused():
    eager, ours = pair("llama")
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        ours(torch.randint(1, 128, (1, 5)), output_attentions=True)
    q = torch.randn(1, 4, 5, 16)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        hf.attention_forward(ours.model.layers[0].self_attn, q, q[:, :2], q[:, :2], None, s_aux=torch.zeros(4))
