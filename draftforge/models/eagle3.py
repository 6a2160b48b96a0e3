"""An EAGLE-3 head (arXiv:2503.01840): one decoder layer that reads the target's own hidden states.

Input at anchor position t: the target's states after layers `aux_layers` (low, middle, high; HF's
`hidden_states[i]`, the residual stream entering layer i, which is what vLLM's aux layers are) fused by a
linear `fc` into g_t, and the target's (frozen) embedding of the next token x_{t+1}. The layer normalises the two
halves apart (`input_layernorm` on the embedding, `hidden_norm` on the feature), attends with q/k/v projections
of their concatenation [emb, feature] (2D wide), adds the result to the feature (the residual carries the feature,
not the embedding), then the MLP; a final `norm` and an LM head over the draft vocabulary give the logits of
x_{t+2}. The layer's output before `norm` is the feature of the next drafting step: step k > 1 has no target
state for the drafted token, so it reads its parent's output (training-time test, `ttt_forward`).

Names follow the `speculators` / vLLM checkpoint (`fc`, `layers.0.self_attn.q_proj`, `layers.0.hidden_norm`,
`norm`, `lm_head`, `d2t`, `t2d`), so the export (models/eagle3_export.py) writes the state dict as it is.
Positions: the entry of anchor t at step k sits at sequence position t + 1 + k (the position of the token it
consumes). vLLM places it at t + k (the target's own positions); with plain RoPE attention reads only position
differences, so the two give the same logits. The whole derivation and the mask: docs/methods/eagle3.md.

Legend: B batch, T anchors (positions), K keys, Q queries, H query heads, G key/value heads, E head dim,
D hidden size, A = len(aux_layers)·D, V target vocabulary, N draft vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from draftforge.errors import CompatibilityError
from draftforge.kernels.attention import MAX_ROWS, matmul_attention, packed_flash_attention, rotate
from draftforge.kernels.kv_buffer import GrowingKV

HEAD_KIND = "eagle3"
SUPPORTED_FAMILIES = ("llama",)  # a Llama-family decoder layer (SmolLM2 is one); others: CompatibilityError


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high choice, as vLLM makes it: [2, L // 2, L - 3] (SmolLM2's 30: [2, 15, 27]);
    a target too shallow for three distinct ids of that form gets layers 1, L // 2 and L - 1 (merged if equal)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and ids == sorted(ids):
        return ids
    return sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1})


def check_aux_layers(layers, num_layers: int, where: str = "eagle3.aux_layers") -> list[int]:
    """Layer ids in 0..L-1 (id i = the state entering target layer i; 0 = the embedding), distinct, ascending."""
    ids = list(layers)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if not ids or bad or len(set(ids)) != len(ids):
        what = f"ids {bad} outside 0..{num_layers - 1}" if bad else "an empty or repeated list"
        raise CompatibilityError(f"{where}: {what} for a target of {num_layers} layers (id i is the state entering "
                                 f"layer i; EAGLE-3's choice for it: {default_aux_layers(num_layers)})")
    return sorted(ids)


@dataclass
class Eagle3Config:
    """The head's shape (the target's, one layer) and what it reads of the target."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    num_target_layers: int
    aux_layers: list[int]
    max_position_embeddings: int
    draft_vocab: list[int] | None = None  # target ids of the head's rows (None: the whole vocabulary)
    hidden_act: str = "silu"
    model_type: str = "llama"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, config, aux_layers=None, draft_vocab=None) -> "Eagle3Config":
        """The head for a HF Llama-family target config; CompatibilityError for anything it cannot copy."""
        if config.model_type not in SUPPORTED_FAMILIES:
            raise CompatibilityError(f"an EAGLE-3 head copies the target's decoder layer; supported families: "
                                     f"{', '.join(SUPPORTED_FAMILIES)}, not {config.model_type!r}")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise CompatibilityError(f"the target's RoPE is {rope_type!r}; the EAGLE-3 head implements plain RoPE "
                                     "(rope_type 'default') only")
        layers = config.num_hidden_layers
        aux = check_aux_layers(default_aux_layers(layers) if aux_layers is None else aux_layers, layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                   head_dim=head_dim, rms_norm_eps=float(config.rms_norm_eps),
                   rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
                   vocab_size=config.vocab_size, num_target_layers=layers, aux_layers=aux,
                   max_position_embeddings=config.max_position_embeddings,
                   draft_vocab=None if draft_vocab is None else [int(t) for t in draft_vocab],
                   hidden_act=config.hidden_act)

    @property
    def head_rows(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def to_dict(self) -> dict:
        return asdict(self)

    def check_target(self, config, where: str) -> None:
        """CompatibilityError unless `config` (a HF target config) has the shape this head was built for."""
        check_shape(self, config, f"EAGLE-3 head {where}", attention=True)


def check_shape(head_config, config, what: str, attention: bool) -> None:
    """CompatibilityError naming both sides unless a target `config` has the hidden size, depth and vocabulary (and
    with `attention`, the heads) that `head_config` was built for (either drafter that reads the target)."""
    have = {"hidden_size": config.hidden_size, "num_target_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size}
    if attention:
        have.update(num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads)
    diff = [f"{k} {getattr(head_config, k)} (head) vs {v} (target)" for k, v in have.items()
            if getattr(head_config, k) != v]
    if diff:
        raise CompatibilityError(f"{what} was built for another target: {'; '.join(diff)}; use the target it was "
                                 "trained on, or train one for this target (task eagle3)")


def matmul_attention_for(q_QHE: torch.Tensor) -> bool:
    """Decoding steps on CPU in bf16/fp16 use draftforge's float32 matmul attention or, up to the head's
    `draftforge_flash_rows` (a probe's verdict, set when the drafter is loaded: decode/loading.py), the packed
    flash kernel (kernels/attention.py): transformers-style sdpa with a mask is several times slower for a few
    query rows against a long cache on some CPUs. A prompt's rows (more than MAX_ROWS) stay on sdpa, whose memory
    does not grow with rows x keys."""
    return (q_QHE.device.type == "cpu" and q_QHE.dtype in (torch.bfloat16, torch.float16)
            and q_QHE.shape[0] <= MAX_ROWS)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        d, e = c.hidden_size, c.head_dim
        self.heads, self.groups, self.head_dim = c.num_attention_heads, c.num_key_value_heads, e
        self.q_proj = nn.Linear(2 * d, c.num_attention_heads * e, bias=False)
        self.k_proj = nn.Linear(2 * d, c.num_key_value_heads * e, bias=False)
        self.v_proj = nn.Linear(2 * d, c.num_key_value_heads * e, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * e, d, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.act_fn = ACT2FN[c.hidden_act]  # the target's, as the export records it (a fixed SiLU was not)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)


KVCache = GrowingKV  # the head's keys and values [G, K, E] (kernels/kv_buffer.py)


class FeatureHead(nn.Module):
    """What both heads that read the target share (this one and models/feature_mamba.py's): `fc` over the aux
    states, a final `norm` and an `lm_head` over the draft vocabulary (`d2t_ids`), and the target's embedding
    (`embed`, set by `use_embedding`: never trained, never saved, as vLLM shares the verifier's). The interface the
    harness and the training loop use: device, dtype, get_output_embeddings, draft_to_target, fuse, logits."""

    name = "feature head"
    config: Eagle3Config
    fc: nn.Linear
    norm: nn.Module
    lm_head: nn.Linear

    def _register_vocab(self, draft_vocab) -> None:
        d2t = torch.tensor(draft_vocab if draft_vocab is not None else [], dtype=torch.long)
        self.register_buffer("d2t_ids", d2t, persistent=False)  # target ids of the head's rows
        self.embed: nn.Embedding | None = None

    @property
    def device(self):
        return self.fc.weight.device

    @property
    def dtype(self):
        return self.fc.weight.dtype

    def get_output_embeddings(self):
        return self.lm_head

    def use_embedding(self, embedding: nn.Module) -> None:
        """Read tokens through `embedding` (the target's; it stays the target's module, frozen)."""
        rows = embedding.weight.shape
        if rows != (self.config.vocab_size, self.config.hidden_size):
            raise CompatibilityError(f"the target's embedding is {tuple(rows)}, the {self.name} expects "
                                     f"({self.config.vocab_size}, {self.config.hidden_size})")
        object.__setattr__(self, "embed", embedding)  # not a submodule: not trained, not in the state dict

    def draft_to_target(self) -> torch.Tensor | None:
        return None if self.config.draft_vocab is None else self.d2t_ids

    def fuse(self, aux_TA: torch.Tensor) -> torch.Tensor:
        """g = fc(concat of the aux states) [..., D]."""
        return self.fc(aux_TA.to(self.dtype))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head logits [..., N] of output states."""
        return self.lm_head(self.norm(out))

    def step_logits(self, outs: list[torch.Tensor], keep_by_step: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Head logits of each unrolled step's output states [B, T, D]: [B, T, N] each, or with keep_by_step (step
        k's bool mask [B, span] over anchors 0..span-1, as the loss keeps them) only those rows, [P_k, N]: the
        norm and head run on the rows a loss reads, and their backward scatters [P_k, D] rows, not [B, T, N]."""
        if keep_by_step is None:
            return [self.logits(out) for out in outs]
        return [self.logits(out[:, : keep.shape[1]][keep]) for out, keep in zip(outs, keep_by_step)]


class Eagle3Head(FeatureHead):
    """fc + one decoder layer + norm + head."""

    name = "EAGLE-3 head"

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.aux_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.head_rows, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self._register_vocab(c.draft_vocab)

    def _apply(self, fn, recurse=True):
        """`.to(bfloat16)` (a head loaded for a bf16 target) would round the rotation frequencies too, an angle
        error growing with position (0.37 rad at 2,048); they stay float32, as training and vLLM keep them."""
        inv_freq = self.inv_freq
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype in (torch.bfloat16, torch.float16):
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return out

    # ---- the pieces

    def rope(self, positions: torch.Tensor):
        """(cos, sin) [..., E] at integer `positions` (rotate-half layout, as Llama)."""
        angle = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        angle = torch.cat([angle, angle], -1)
        return angle.cos().to(self.dtype), angle.sin().to(self.dtype)

    def project(self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor):
        """q [..., H, E], k / v [..., G, E] (rotated at `positions`) and the residual (the feature) for tokens
        [...] with their input features [..., D]."""
        layer = self.layers[0]
        emb = self.embed(tokens).to(self.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(feature)], -1)
        att, e = layer.self_attn, self.config.head_dim
        q = att.q_proj(x).unflatten(-1, (att.heads, e))
        k = att.k_proj(x).unflatten(-1, (att.groups, e))
        v = att.v_proj(x).unflatten(-1, (att.groups, e))
        cos, sin = self.rope(positions)
        cos, sin = cos[..., None, :], sin[..., None, :]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o_proj + residual, then the MLP block -> the output state [..., D]."""
        layer = self.layers[0]
        h = residual + layer.self_attn.o_proj(attended.flatten(-2))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ---- decoding: any set of queries against cached keys, with an explicit mask

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.config.num_key_value_heads, self.config.head_dim, self.dtype, self.device, capacity)

    def step(self, tokens_Q: torch.Tensor, feature_QD: torch.Tensor, positions_Q: torch.Tensor, cache: KVCache,
             mask_QK: torch.Tensor | None) -> torch.Tensor:
        """One forward of Q entries: their keys/values are appended to `cache`, and each sees the cache's rows as
        mask_QK [Q, cache rows after appending] says (True = may attend); None = every earlier row and a causal
        order among the queries. Returns the output states [Q, D]."""
        q_QHE, k_QGE, v_QGE = self.project(tokens_Q, feature_QD, positions_Q)
        cache.append(k_QGE.transpose(0, 1), v_QGE.transpose(0, 1))
        k_GKE, v_GKE = cache.view()
        n_q, n_k = len(tokens_Q), cache.length
        att = self.config.num_attention_heads // self.config.num_key_value_heads
        if mask_QK is None and n_q == n_k and n_q > MAX_ROWS:  # a prompt into an empty cache: causal, no mask
            # made, so sdpa runs block by block (an explicit [Q, K] mask sends it to its math path, which holds the
            # whole score matrix: +5.7 GiB for an 8k-token prompt in bf16)
            q_GAQE = q_QHE.transpose(0, 1).unflatten(0, (-1, att))
            k_GAKE, v_GAKE = (x[:, None].expand(-1, att, -1, -1) for x in (k_GKE, v_GKE))
            out_GAQE = F.scaled_dot_product_attention(q_GAQE, k_GAKE, v_GAKE, is_causal=True)
            return self.finish(out_GAQE.flatten(0, 1).transpose(0, 1), feature_QD.to(self.dtype))
        if mask_QK is None:
            mask_QK = torch.ones(n_q, n_k, dtype=torch.bool, device=q_QHE.device).tril(n_k - n_q)
        if matmul_attention_for(q_QHE):  # up to draftforge_flash_rows rows (set at load by a probe) flash instead
            kernel = packed_flash_attention if n_q <= getattr(self, "draftforge_flash_rows", 0) else matmul_attention
            out_QHE = kernel(q_QHE.transpose(0, 1)[None], k_GKE[None], v_GKE[None],
                             mask_QK.to(q_QHE.device)[None, None])[0]
            return self.finish(out_QHE, feature_QD.to(self.dtype))
        q_GAQE = q_QHE.transpose(0, 1).unflatten(0, (-1, att))  # query heads grouped by the K/V head they share
        out_GAQE = F.scaled_dot_product_attention(q_GAQE, k_GKE[:, None], v_GKE[:, None],
                                                  attn_mask=mask_QK.to(q_QHE.device))
        return self.finish(out_GAQE.flatten(0, 1).transpose(0, 1), feature_QD.to(self.dtype))

    # ---- training: K unrolled steps over whole sequences (training-time test)

    def forward(self, tokens_BT: torch.Tensor, aux_BTA: torch.Tensor, steps: int,
                unroll_BT: torch.Tensor | None = None,
                keep_by_step: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Head logits [B, T, N] of every anchor at steps 0..steps-1 (ttt_forward, then norm and head), or at the
        kept anchors only (step_logits). unroll_BT (the anchors a later step is scored at) is not used: step k
        attends over every anchor's chain."""
        return self.step_logits(self.ttt_forward(tokens_BT, aux_BTA, steps), keep_by_step)

    def ttt_forward(self, tokens_BT: torch.Tensor, aux_BTA: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Output states [B, T, D] of every anchor t at steps 0..steps-1.

        Step 0 at anchor t consumes (x_{t+1}, g_t); step k consumes (x_{t+1+k}, its own step k-1 output) at
        position t+1+k and attends to the step-0 entries of anchors <= t and its own entries of steps 1..k
        (what drafting a chain from anchor t sees). tokens_BT[t] = x_{t+1}; where t+1+k runs past the end the
        token is a stand-in (0) and those outputs carry no loss (the caller's targets stop there)."""
        b, t = tokens_BT.shape
        positions_T = torch.arange(1, t + 1, device=tokens_BT.device)
        feature = self.fuse(aux_BTA)
        att = self.config.num_attention_heads // self.config.num_key_value_heads
        scale = self.config.head_dim ** -0.5
        wide = torch.promote_types(self.dtype, torch.float32)  # scores and softmax in at least fp32
        causal_TT = torch.ones(t, t, dtype=torch.bool, device=tokens_BT.device).tril()
        keys0 = vals0 = None
        diag_k, diag_v, outs = [], [], []
        for k in range(steps):
            tok = tokens_BT if k == 0 else F.pad(tokens_BT[:, k:], (0, k), value=0)
            q, key, val = self.project(tok, feature, positions_T + k)  # [B, T, H|G, E]
            key, val = key.repeat_interleave(att, 2), val.repeat_interleave(att, 2)
            if k == 0:
                keys0, vals0 = key, val
            else:
                diag_k.append(key)
                diag_v.append(val)
            s0_BHTT = torch.einsum("bqhe,bkhe->bhqk", q, keys0).to(wide) * scale
            s0_BHTT = s0_BHTT.masked_fill(~causal_TT, float("-inf"))
            sd_BHTJ = (torch.stack([torch.einsum("bqhe,bqhe->bhq", q, dk) for dk in diag_k], -1).to(wide) * scale
                       if diag_k else s0_BHTT.new_zeros(b, q.shape[2], t, 0))
            w = torch.cat([s0_BHTT, sd_BHTJ], -1).softmax(-1).to(q.dtype)
            out_BHTE = torch.einsum("bhqk,bkhe->bhqe", w[..., :t], vals0)
            for j, dv in enumerate(diag_v):
                out_BHTE = out_BHTE + w[..., t + j, None] * dv.transpose(1, 2)
            feature = self.finish(out_BHTE.transpose(1, 2), feature)
            outs.append(feature)
        return outs


def init_from_target(head: Eagle3Head, target, seed: int = 0) -> dict:
    """Start the head from the target: norm and head rows copied (restricted to the draft vocabulary), the layer a
    copy of the target's last layer reading the feature half (the embedding half starts at zero), and fc passing
    the highest aux state through. At step 0 the head then runs the target's last layer on the high state (which enters layer L - 3, not L - 1).
    Returns what was done, for the run log."""
    c, inner = head.config, target.model
    last = inner.layers[-1]
    torch.manual_seed(seed)
    with torch.no_grad():
        d = c.hidden_size
        layer = head.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            mine, theirs = getattr(layer.self_attn, name).weight, getattr(last.self_attn, name).weight
            mine.zero_()
            mine[:, d:] = theirs.to(mine.dtype)
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
        layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.norm.weight.copy_(inner.norm.weight)
        rows = target.get_output_embeddings().weight
        if c.draft_vocab is not None:
            rows = rows[torch.tensor(c.draft_vocab, device=rows.device)]
        head.lm_head.weight.copy_(rows)
        head.fc.weight.zero_()
        n_aux = len(c.aux_layers)
        head.fc.weight[:, (n_aux - 1) * d:] = torch.eye(d)
    return {"init": "target", "layer_from": f"target layer {c.num_target_layers - 1}", "fc": "high aux state"}


def aux_states(hidden_states, layers: list[int]) -> torch.Tensor:
    """Concat of HF hidden_states[i] for i in `layers` along the last axis ([..., A])."""
    return torch.cat([hidden_states[i] for i in layers], -1)
