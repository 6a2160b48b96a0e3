"""A feature-conditioned Mamba2 drafter: the EAGLE-3 head's inputs feeding a Mamba2 body instead of attention.

Inputs are the EAGLE-3 head's (models/eagle3.py): g_t = fc(the target's states entering `aux_layers` at t) and
the target's embedding of x_{t+1}, normalised apart and mixed by `in_fuse` (2D -> D) into the residual stream,
which starts from g_t (the residual carries the feature, as in the attention head). `layers` Mamba2 blocks (pre-norm
residual: RMSNorm, mixer, add) follow, then a final norm and the head over the draft vocabulary. The output state
before the final norm is the feature of the next drafting step, as in the attention head.

The point is long context: a step costs the same at any context and the state is a fixed size per layer
(conv window [K-1, C] and SSM state [H, P, N]), where the attention head's step and KV cache grow with the
context. The mixer is written out in plain PyTorch (one token per call, differentiable, no in-place updates) so
training-time test can run every anchor's chain from that anchor's own state; it follows Mamba2 (arXiv:2405.21060):
in_proj -> (z, xBC, dt); causal depthwise conv over the last K inputs and SiLU; dt = softplus(dt + dt_bias);
h = exp(dt·A)·h + dt·x ⊗ B; y = C·h + D·x; gated RMSNorm with SiLU(z); out_proj. One group (B and C shared by
all heads).

Legend: B rows, T anchors, D hidden size (the target's), E inner width (expand·D), H heads, P head dim, N state
size, C conv channels (E + 2N), K conv kernel, A aux width, V target vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.errors import CompatibilityError
from draftforge.models.eagle3 import FeatureHead, RMSNorm, check_aux_layers, check_shape, default_aux_layers

BODY = "mamba2"


def head_window_refusal(flag: str, subject: str) -> str:
    """The one line a head window (which keeps an attention head's last N keys) gets when asked of this body."""
    return (f"{flag} keeps the last N keys of an EAGLE-3 attention head; {subject} is a feature Mamba2 drafter, whose "
            "state is the same size at any context (drop --head-window)")


State = tuple[torch.Tensor, torch.Tensor]  # one block's (conv window [B, K-1, C], ssm [B, H, P, N])


@dataclass
class FeatureMambaConfig:
    hidden_size: int
    vocab_size: int
    num_target_layers: int
    aux_layers: list[int]
    rms_norm_eps: float
    draft_vocab: list[int] | None = None
    layers: int = 2
    state_size: int = 16
    head_dim: int = 64
    expand: int = 2
    conv_kernel: int = 4
    body: str = BODY
    num_attention_heads: int | None = None  # the target's (checked at load, as for the attention head)
    num_key_value_heads: int | None = None

    @classmethod
    def from_target(cls, config, aux_layers=None, draft_vocab=None, **body) -> "FeatureMambaConfig":
        layers = config.num_hidden_layers
        aux = check_aux_layers(default_aux_layers(layers) if aux_layers is None else aux_layers, layers)
        made = cls(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_target_layers=layers,
                   aux_layers=aux, rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                   draft_vocab=None if draft_vocab is None else [int(t) for t in draft_vocab],
                   num_attention_heads=getattr(config, "num_attention_heads", None),
                   num_key_value_heads=getattr(config, "num_key_value_heads", None), **body)
        if (made.expand * made.hidden_size) % made.head_dim:
            raise CompatibilityError(f"feature Mamba2 body: expand·hidden ({made.expand * made.hidden_size}) is not a "
                                     f"multiple of head_dim {made.head_dim}")
        return made

    @property
    def head_rows(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    @property
    def inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def heads(self) -> int:
        return self.inner // self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.state_size

    def to_dict(self) -> dict:
        return asdict(self)

    def check_target(self, config, where: str) -> None:
        check_shape(self, config, f"feature Mamba2 drafter {where}", attention=False)


class Mixer(nn.Module):
    def __init__(self, c: FeatureMambaConfig):
        super().__init__()
        self.c = c
        self.in_proj = nn.Linear(c.hidden_size, c.inner + c.conv_dim + c.heads, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(c.conv_kernel, c.conv_dim) / c.conv_kernel**0.5)
        self.conv_bias = nn.Parameter(torch.zeros(c.conv_dim))
        dt = torch.exp(torch.rand(c.heads) * (torch.log(torch.tensor(0.1)) - torch.log(torch.tensor(0.001)))
                       + torch.log(torch.tensor(0.001)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1 of dt in [0.001, 0.1]
        self.A_log = nn.Parameter(torch.log(torch.arange(1, c.heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(c.heads))
        self.gate_norm = RMSNorm(c.inner, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.inner, c.hidden_size, bias=False)

    def step(self, u_BD: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One token per row from `state` -> (output [B, D], the new state); nothing is changed in place."""
        c = self.c
        wide = torch.promote_types(u_BD.dtype, torch.float32)  # the SSM in at least fp32
        conv_BKC, ssm_BHPN = state
        z_BE, xbc_BC, dt_BH = self.in_proj(u_BD).split([c.inner, c.conv_dim, c.heads], -1)
        window_BKC = torch.cat([conv_BKC, xbc_BC[:, None]], 1)
        xbc_BC = F.silu((window_BKC * self.conv_weight).sum(1) + self.conv_bias)
        x_BE, b_BN, c_BN = xbc_BC.split([c.inner, c.state_size, c.state_size], -1)
        dt_BH = F.softplus(dt_BH.to(wide) + self.dt_bias.to(wide))
        decay_BH = torch.exp(dt_BH * -torch.exp(self.A_log.to(wide)))
        x_BHP = x_BE.to(wide).unflatten(-1, (c.heads, c.head_dim))
        ssm_BHPN = (ssm_BHPN * decay_BH[..., None, None]
                    + (dt_BH[..., None] * x_BHP)[..., None] * b_BN.to(wide)[:, None, None, :])
        y_BHP = (ssm_BHPN * c_BN.to(wide)[:, None, None, :]).sum(-1) + self.D.to(wide)[:, None] * x_BHP
        y_BE = self.gate_norm((y_BHP.flatten(1) * F.silu(z_BE.to(wide))).to(u_BD.dtype))
        return self.out_proj(y_BE), (window_BKC[:, 1:], ssm_BHPN)


    def scan(self, u_BTD: torch.Tensor, chunk: int = 32, every: bool = True,
             initial: State | None = None) -> tuple[torch.Tensor, State]:
        """A whole sequence from the empty state (or from `initial`, a state [B, ...] as `step` takes it), in
        parallel: (outputs [B, T, D], the state after every position:
        conv windows [B, T, K-1, C] and SSM states [B, T, H, P, N]). The recurrence h_t = a_t·h_{t-1} + b_t is
        summed in chunks: inside one, h_t = Σ_{s<=t} exp(Σ_{s<r<=t} log a_r)·b_s (every factor <= 1), plus the
        carried state decayed by the chunk's running product. Equal to `step` position by position. With
        every=False only the state after the last position is returned ([B, 1, ...]): a prompt's prefill, which
        needs no per-position states (at 8k those would be ~0.6 GB)."""
        c = self.c
        wide = torch.promote_types(u_BTD.dtype, torch.float32)  # the SSM in at least fp32
        b, t, _ = u_BTD.shape
        z_BTE, xbc_BTC, dt_BTH = self.in_proj(u_BTD).split([c.inner, c.conv_dim, c.heads], -1)
        if initial is None:
            padded_BXC, carry = F.pad(xbc_BTC, (0, 0, c.conv_kernel - 1, 0)), None
        else:  # the conv window holds the last K-1 inputs before this sequence; the SSM state carries in
            padded_BXC, carry = torch.cat([initial[0].to(xbc_BTC.dtype), xbc_BTC], 1), initial[1].to(wide)
        window_BTKC = padded_BXC.unfold(1, c.conv_kernel, 1).transpose(2, 3)  # inputs t-K+1..t
        xbc_BTC = F.silu((window_BTKC * self.conv_weight).sum(2) + self.conv_bias)
        x_BTE, b_BTN, c_BTN = xbc_BTC.split([c.inner, c.state_size, c.state_size], -1)
        dt_BTH = F.softplus(dt_BTH.to(wide) + self.dt_bias.to(wide))
        log_a_BTH = dt_BTH * -torch.exp(self.A_log.to(wide))
        x_BTHP = x_BTE.to(wide).unflatten(-1, (c.heads, c.head_dim))
        dx_BTHP = dt_BTH[..., None] * x_BTHP
        states, ys = [], []
        for start in range(0, t, chunk):
            end = min(t, start + chunk)
            cum_BLH = log_a_BTH[:, start:end].cumsum(1)
            gap_BHLL = cum_BLH.transpose(1, 2)[..., :, None] - cum_BLH.transpose(1, 2)[..., None, :]
            causal = torch.ones(end - start, end - start, dtype=torch.bool, device=u_BTD.device).tril()
            weight_BHLL = torch.where(causal, gap_BHLL, float("-inf")).exp()
            # the chunk's inputs dt·x·B, made per chunk: for the whole sequence they would be as large as every
            # position's state (~0.6 GB for an 8k prompt), which a prefill (every=False) never keeps
            inc_BLHPN = dx_BTHP[:, start:end, ..., None] * b_BTN[:, start:end].to(wide)[:, :, None, None, :]
            h_BLHPN = torch.einsum("bhts,bshpn->bthpn", weight_BHLL, inc_BLHPN)
            if carry is not None:
                h_BLHPN = h_BLHPN + cum_BLH.exp()[..., None, None] * carry[:, None]
            ys.append((h_BLHPN * c_BTN[:, start:end].to(wide)[:, :, None, None, :]).sum(-1))
            if every:
                states.append(h_BLHPN)
            carry = h_BLHPN[:, -1]
        y_BTHP = torch.cat(ys, 1) + self.D.to(wide)[:, None] * x_BTHP
        y_BTE = self.gate_norm((y_BTHP.flatten(2) * F.silu(z_BTE.to(wide))).to(u_BTD.dtype))
        if not every:
            return self.out_proj(y_BTE), (window_BTKC[:, -1:, 1:], carry[:, None])
        return self.out_proj(y_BTE), (window_BTKC[:, :, 1:], torch.cat(states, 1))


class Block(nn.Module):
    def __init__(self, c: FeatureMambaConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mixer = Mixer(c)

    def step(self, r_BD, state: State):
        out_BD, state = self.mixer.step(self.norm(r_BD), state)
        return r_BD + out_BD, state

    def scan(self, r_BTD, every: bool = True, initial: State | None = None):
        out_BTD, states = self.mixer.scan(self.norm(r_BTD), every=every, initial=initial)
        return r_BTD + out_BTD, states


class FeatureMamba2Head(FeatureHead):
    """fc + [emb, feature] fusion + Mamba2 blocks + norm + head; `embed` is the target's (use_embedding)."""

    name = "feature-conditioned Mamba2 drafter"

    def __init__(self, config: FeatureMambaConfig):
        super().__init__()
        c = self.config = config
        d = c.hidden_size
        self.fc = nn.Linear(len(c.aux_layers) * d, d, bias=False)
        self.input_layernorm = RMSNorm(d, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, c.rms_norm_eps)
        self.in_fuse = nn.Linear(2 * d, d, bias=False)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lm_head = nn.Linear(d, c.head_rows, bias=False)
        self._register_vocab(c.draft_vocab)

    def empty_state(self, rows: int) -> list[State]:
        """Every block's zero state for `rows` rows (the state before the first anchor)."""
        c, p = self.config, next(self.parameters())
        return [(p.new_zeros(rows, c.conv_kernel - 1, c.conv_dim),
                 torch.zeros(rows, c.heads, c.head_dim, c.state_size, device=p.device,
                             dtype=torch.promote_types(p.dtype, torch.float32)))
                for _ in range(c.layers)]

    def entry(self, tokens: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the blocks: the feature plus the fused [embedding, feature] ([..., D])."""
        emb = self.embed(tokens).to(self.dtype)
        feature = feature.to(self.dtype)
        return feature + self.in_fuse(torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], -1))

    def step(self, tokens_B: torch.Tensor, feature_BD: torch.Tensor, states: list[State]):
        """One entry per row: (output state [B, D], the blocks' new states)."""
        r_BD = self.entry(tokens_B, feature_BD)
        new = []
        for block, state in zip(self.blocks, states):
            r_BD, state = block.step(r_BD, state)
            new.append(state)
        return r_BD, new

    def run(self, tokens_BT: torch.Tensor, feature_BTD: torch.Tensor, states: list[State] | None = None,
            keep_states: bool = False):
        """Entries one position at a time from `states` (None: empty): (outputs [B, T, D], the final states, and
        with keep_states the states after every position, per block (conv [B, T, K-1, C], ssm [B, T, H, P, N]))."""
        b, t = tokens_BT.shape
        states = self.empty_state(b) if states is None else states
        outs, kept = [], []
        for i in range(t):
            out_BD, states = self.step(tokens_BT[:, i], feature_BTD[:, i], states)
            outs.append(out_BD)
            if keep_states:
                kept.append(states)
        per_block = None
        if keep_states:
            per_block = [(torch.stack([s[j][0] for s in kept], 1), torch.stack([s[j][1] for s in kept], 1))
                         for j in range(len(self.blocks))]
        return torch.stack(outs, 1), states, per_block

    def prefill(self, tokens_T: torch.Tensor, feature_TD: torch.Tensor,
                states: list[State] | None = None) -> tuple[torch.Tensor, list[State]]:
        """Anchors of a prompt in one parallel scan, from the empty state or from `states` (a previous piece of
        the same prompt): (outputs [T, D], every block's state after the last one, [1, ...]): what `run` gives
        one position at a time."""
        r_1TD, after = self.entry(tokens_T[None], feature_TD[None]), []
        for j, block in enumerate(self.blocks):
            r_1TD, (conv_1KC, ssm_1HPN) = block.scan(r_1TD, every=False, initial=None if states is None else states[j])
            after.append((conv_1KC[:, 0], ssm_1HPN[:, 0]))
        return r_1TD[0], after

    def ttt_forward(self, tokens_BT: torch.Tensor, aux_BTA: torch.Tensor, steps: int,
                    unroll_BT: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Output states [B, T, D] of every anchor at steps 0..steps-1: step 0 runs the anchors from the empty state
        (a parallel scan keeping the state after every position); step k at anchor t continues from the state
        anchor t's chain had after step k-1 (step 0: after anchor t itself), fed x_{t+1+k} and that chain's
        previous output (what drafting from t does).

        unroll_BT (bool, optional): the anchors whose chains steps 1.. need (those a later step is scored at);
        the other anchors' outputs at steps >= 1 are zeros. Each chain is computed on its own, so a kept anchor's
        outputs are what the full unroll gives (up to the rounding of a product over fewer rows); the states
        carried through steps 1.. shrink to the kept anchors (a 2k block whose loss falls on a 128-token answer
        keeps ~1/16)."""
        b, t = tokens_BT.shape
        r_BTD, per_block = self.entry(tokens_BT, self.fuse(aux_BTA)), []
        for block in self.blocks:  # step 0: every anchor in parallel (Mixer.scan)
            r_BTD, states = block.scan(r_BTD)
            per_block.append(states)
        outs = [r_BTD]
        rows = None if unroll_BT is None else unroll_BT.flatten().nonzero().squeeze(1)
        pick = (lambda x: x) if rows is None else (lambda x: x.index_select(0, rows))
        states = [(pick(c.flatten(0, 1)), pick(s.flatten(0, 1))) for c, s in per_block]
        out_ND = pick(r_BTD.flatten(0, 1))
        for k in range(1, steps):
            tok_N = pick(F.pad(tokens_BT[:, k:], (0, k), value=0).flatten())
            out_ND, states = self.step(tok_N, out_ND, states)
            if rows is None:
                outs.append(out_ND.view(b, t, -1))
            else:
                outs.append(out_ND.new_zeros(b * t, out_ND.shape[-1]).index_copy(0, rows, out_ND).view(b, t, -1))
        return outs

    def forward(self, tokens_BT: torch.Tensor, aux_BTA: torch.Tensor, steps: int,
                unroll_BT: torch.Tensor | None = None,
                keep_by_step: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Head logits of every anchor at each step, or of the kept anchors only (FeatureHead.step_logits)."""
        return self.step_logits(self.ttt_forward(tokens_BT, aux_BTA, steps, unroll_BT), keep_by_step)

    def state_bytes(self) -> int:
        """Bytes of one row's recurrent state (all blocks): constant at any context."""
        return sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in self.empty_state(1))


def init_from_target(head: FeatureMamba2Head, target) -> dict:
    """The final norm (when found: final_norm) and the head rows from the target (restricted to the draft
    vocabulary); fc passes the highest aux state through; the body starts as Mamba2's usual initialisation with
    small output projections."""
    c = head.config
    with torch.no_grad():
        norm = final_norm(target)
        if norm is not None and norm.weight.shape == head.norm.weight.shape:
            head.norm.weight.copy_(norm.weight)
        rows = target.get_output_embeddings().weight
        if c.draft_vocab is not None:
            rows = rows[torch.tensor(c.draft_vocab, device=rows.device)]
        head.lm_head.weight.copy_(rows)
        head.fc.weight.zero_()
        d = c.hidden_size
        head.fc.weight[:, (len(c.aux_layers) - 1) * d :] = torch.eye(d)
        for block in head.blocks:
            block.mixer.out_proj.weight.mul_(0.1)
    return {"init": "target", "fc": "high aux state"}


def final_norm(target):
    """The target's final norm (Llama: model.norm; hybrids: model.final_layernorm / norm_f; Mamba2:
    backbone.norm_f), or None where it has another name."""
    for inner in ("model", "backbone"):
        body = getattr(target, inner, None)
        for name in ("norm", "final_layernorm", "norm_f"):
            module = getattr(body, name, None)
            if module is not None and hasattr(module, "weight"):
                return module
    return None
