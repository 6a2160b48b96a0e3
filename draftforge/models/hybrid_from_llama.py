"""A Llama-family Transformer turned into a Mamba2 + attention hybrid, the MambaInLlama way (STree §5.1).

A chosen share of the attention layers is replaced by Mamba2 mixers initialised from the layer's own
attention weights: V → x, K → B, Q → C, o_proj → out_proj (K and V are repeated over the query heads
of their GQA group, so every SSM head h reads the K/V head of h's group). The state size is the head
dim, there is one B/C group per query head, and the conv1d starts as the identity. Everything else
(embeddings, norms, MLPs, the kept attention layers, the head) is copied. The result is a transformers
`BambaForCausalLM`, which the harness verifies with the tree scan like any hybrid; distil it against
the original with task `distill` (recipes/hybrid/).

Legend: H query heads, Hkv key/value heads, P head dim, D hidden size, I = H*P.
"""

from __future__ import annotations

import torch

from draftforge.errors import CompatibilityError


def every_other(n_layers: int, share: float = 0.5) -> list[int]:
    """Layer indices to replace: `share` of the layers, spread evenly. The first layer stays attention while
    share <= 2/3 (each stretch then ends past layer 0); above that layer 0 is replaced too."""
    n_replace = round(n_layers * share)
    if n_replace <= 0:
        return []
    step = n_layers / n_replace  # >= 1; layer round(k*step)-1 ends the k-th stretch, so layer 0 stays attention
    return sorted({int(round((k + 1) * step)) - 1 for k in range(n_replace)})


def bamba_config_for(llama_config, mamba_layers: list[int]):
    """A BambaConfig with the Llama's shapes; attention everywhere except `mamba_layers`."""
    from transformers import BambaConfig

    c = llama_config
    heads, head_dim = c.num_attention_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if (heads * head_dim) % c.hidden_size:
        raise CompatibilityError(f"{c.model_type}: heads*head_dim = {heads * head_dim} is not a multiple of the hidden "
                                 f"size {c.hidden_size}; the Mamba2 expand factor must be an integer")
    rope = dict(getattr(c, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    rope.setdefault("partial_rotary_factor", 1.0)  # Bamba's default rotates half the head dim; Llama all of it
    return BambaConfig(
        vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, pad_token_id=c.pad_token_id, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, attn_layer_indices=[i for i in range(c.num_hidden_layers) if i not in mamba_layers],
        mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=heads, mamba_d_state=head_dim, mamba_d_conv=4,
        mamba_expand=heads * head_dim // c.hidden_size, mamba_chunk_size=256, mamba_conv_bias=True,
        mamba_proj_bias=False, rope_parameters=rope, attention_bias=getattr(c, "attention_bias", False),
        mlp_bias=getattr(c, "mlp_bias", False), head_dim=head_dim,  # Bamba's attention reads it (default D / H)
    )


def _per_query_head(weight_RD: torch.Tensor, n_kv: int, n_heads: int) -> torch.Tensor:
    """[Hkv*P, D] K or V rows repeated so that query head h gets its group's rows: [H*P, D]."""
    rows_kPD = weight_RD.view(n_kv, -1, weight_RD.shape[-1])
    return rows_kPD.repeat_interleave(n_heads // n_kv, dim=0).reshape(-1, weight_RD.shape[-1])


@torch.no_grad()
def init_mixer_from_attention(mixer, attn, n_heads: int, n_kv: int) -> None:
    """MambaInLlama's init: in_proj's x/B/C rows from V/K/Q, out_proj from o_proj, identity conv1d."""
    inner = mixer.intermediate_size
    groups_state = mixer.n_groups * mixer.ssm_state_size
    x_rows = _per_query_head(attn.v_proj.weight, n_kv, n_heads)
    b_rows = _per_query_head(attn.k_proj.weight, n_kv, n_heads)
    c_rows = attn.q_proj.weight
    if x_rows.shape[0] != inner or b_rows.shape[0] != groups_state or c_rows.shape[0] != groups_state:
        raise CompatibilityError(f"mixer shapes (x {inner}, B/C {groups_state}) do not match the attention's "
                                 f"(V {x_rows.shape[0]}, K {b_rows.shape[0]}, Q {c_rows.shape[0]} after GQA repeat)")
    w = mixer.in_proj.weight  # rows: [z (I) | x (I) | B (G*S) | C (G*S) | dt (H)]
    start = inner
    for rows in (x_rows, b_rows, c_rows):
        w[start : start + rows.shape[0]].copy_(rows.to(w.dtype))
        start += rows.shape[0]
    mixer.out_proj.weight.copy_(attn.o_proj.weight.to(mixer.out_proj.weight.dtype))
    mixer.conv1d.weight.zero_()
    mixer.conv1d.weight[:, 0, -1] = 1.0  # identity: the conv starts by passing the current token through
    if mixer.conv1d.bias is not None:
        mixer.conv1d.bias.zero_()


@torch.no_grad()
def llama_to_hybrid(llama, mamba_layers: list[int]):
    """A BambaForCausalLM copy of `llama` with `mamba_layers` replaced by attention-initialised Mamba2 mixers."""
    from transformers import BambaForCausalLM

    c = llama.config
    if c.model_type not in ("llama", "mistral"):  # qwen2's q/k/v carry biases its o_proj lacks: Bamba has one switch
        raise CompatibilityError(f"hybrid conversion reads Llama-style layers (llama, mistral); got {c.model_type!r}")
    window = getattr(c, "sliding_window", None)
    if window is not None and window < c.max_position_embeddings:  # Bamba's attention sees the whole context
        raise CompatibilityError(f"{c.model_type}: sliding_window={window} is below the context of "
                                 f"{c.max_position_embeddings}, and the hybrid's attention layers see the whole "
                                 "context (it would part from the model past the window); set "
                                 "config.sliding_window = None first if full attention is what you convert")
    bad = [i for i in mamba_layers if not 0 <= i < llama.config.num_hidden_layers]
    if bad:
        raise CompatibilityError(f"layers {bad} do not exist (the model has {llama.config.num_hidden_layers})")
    config = bamba_config_for(llama.config, sorted(mamba_layers))
    hybrid = BambaForCausalLM(config).to(next(llama.parameters()).dtype).eval()
    src, dst = llama.model, hybrid.model
    dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
    dst.final_layernorm.weight.copy_(src.norm.weight)
    if not config.tie_word_embeddings:
        hybrid.lm_head.weight.copy_(llama.lm_head.weight)
    for i, (s, d) in enumerate(zip(src.layers, dst.layers)):
        d.input_layernorm.weight.copy_(s.input_layernorm.weight)
        d.pre_ff_layernorm.weight.copy_(s.post_attention_layernorm.weight)
        d.feed_forward.load_state_dict(s.mlp.state_dict())
        if i in mamba_layers:
            init_mixer_from_attention(d.mamba, s.self_attn, config.num_attention_heads, config.num_key_value_heads)
        else:
            d.self_attn.load_state_dict(s.self_attn.state_dict())
    hybrid.generation_config = llama.generation_config
    return hybrid
