"""``attn_implementation="tile_ops"`` in HuggingFace transformers models.

    import tile_ops.integrations.transformers  # registers "tile_ops" with transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tile_ops")

Importing this module registers the name (``register()``, idempotent): an attention function with
``AttentionInterface`` and transformers' flash-attention mask (the 2-D padding mask, or None) with
``AttentionMaskInterface`` — without the mask registration transformers drops the mask, causal masking included.
``import tile_ops`` does not do it because it would import transformers' modeling code (seconds) for every user.

The attention function is transformers' own flash-attention forward (``integrations.flash_attention``), so
padding (unpadded into varlen calls), packed sequences (``position_ids`` or ``cu_seq_lens_*`` into varlen),
sliding windows (``window_size``), softcap, the decode step against the KV cache (bottom-right causal) and
deterministic mode follow its semantics, with tile_ops' ``flash_attn_func`` / ``flash_attn_varlen_func`` as the
kernels.  transformers resolves those functions by implementation name and knows no hook for a library's own
(it would look the name up on the Hub), so ``_use_tile_ops`` points its loaded-implementation slots
(``modeling_flash_attention_utils._flash_fn`` and friends) at ours before each call; a model using
``flash_attention_2`` in the same process reloads its own there.

``apply(model)`` switches a loaded model: its attention, and its ``nn.Linear`` layers to ``tile_ops.nn.Linear``
(``tile_ops.nn.convert_linears``: every plain ``nn.Linear``, the output head included; modules with a forward of
their own, hooks or parametrizations are left and listed)."""

from __future__ import annotations

from ..ops.attention import flash_attn_func
from ..ops.attention_varlen import flash_attn_varlen_func

NAME = "tile_ops"


def register() -> None:
    """Make ``attn_implementation="tile_ops"`` available to every transformers model."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    _use_tile_ops()


def _use_tile_ops() -> None:
    """transformers' flash-attention plumbing, loaded with tile_ops' functions under our name."""
    from transformers import modeling_flash_attention_utils as fa

    if fa._loaded_implementation == NAME:
        return
    fa._loaded_implementation = NAME
    fa._flash_fn, fa._flash_varlen_fn, fa._flash_with_kvcache_fn = flash_attn_func, flash_attn_varlen_func, None
    fa._pad_fn, fa._unpad_fn = fa._pad_input, fa._unpad_input
    fa._process_flash_kwargs_fn = fa._lazy_define_process_function(flash_attn_varlen_func)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """The attention of one layer: query (B, Hq, S, D), key and value (B, Hkv, S, D) in, (B, S, Hq, D) and no
    weights out, through transformers' flash-attention forward onto tile_ops' ops."""
    from transformers.integrations.flash_attention import flash_attention_forward

    if s_aux is not None:
        raise NotImplementedError(f"attn_implementation={NAME!r}: attention sinks (s_aux, as in gpt-oss) are not "
                                  f"supported; accepted: models without them, or attn_implementation='eager'")
    if kwargs.get("output_attentions", False):
        raise NotImplementedError(f"attn_implementation={NAME!r}: output_attentions=True needs the attention "
                                  f"weights, which FlashAttention never forms; use attn_implementation='eager'")
    _use_tile_ops()
    return flash_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                   sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, **kwargs)


def apply(model, linears: bool = True):
    """``model`` with its attention on tile_ops (``set_attn_implementation``) and, with ``linears``, its plain
    ``nn.Linear`` layers converted to ``tile_ops.nn.Linear`` in place; returns it."""
    from .linear import convert_linears

    register()
    model.set_attn_implementation(NAME)
    return convert_linears(model) if linears else model


register()
