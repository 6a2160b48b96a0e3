"""The EAGLE-3 head against oracles that do not come from its own code: the fusion and the step losses by hand,
training-time test against drafting the same chain one step at a time (the per-path oracle), and a head built
as a copy of the target's last layer, whose α is then the overlap of the target's distributions at neighbouring
positions, computed from the target alone."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftforge.errors import CheckpointError, CompatibilityError
from draftforge.models.eagle3 import Eagle3Config, Eagle3Head, check_aux_layers, default_aux_layers, init_from_target
from draftforge.models.eagle3_export import is_eagle3_export, load_head, offsets_of, save_head
from draftforge.train.eagle3 import Eagle3TaskConfig, derive, step_losses

V, D, L = 40, 32, 4


def tiny_target(seed=0, layers=L, hidden=D):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).double().eval()


def random_head(target, aux=None, draft_vocab=None, seed=1):
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target.config, aux, draft_vocab)).double()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    head.use_embedding(target.get_input_embeddings())
    return head


def test_default_layers_and_bad_ids():
    assert default_aux_layers(30) == [2, 15, 27] and default_aux_layers(4) == [1, 2, 3]
    for bad in ([0, 4], [-1, 2], [2, 2], []):
        with pytest.raises(CompatibilityError, match="for a target of 4 layers"):
            check_aux_layers(bad, 4)


def test_fusion_is_one_linear_map_of_the_stacked_states():
    head = random_head(tiny_target(), aux=[1, 2, 3])
    states = [torch.randn(5, D, dtype=torch.float64) for _ in range(3)]
    w = head.fc.weight
    by_hand = sum(s @ w[:, i * D : (i + 1) * D].T for i, s in enumerate(states))
    torch.testing.assert_close(head.fuse(torch.cat(states, -1)), by_hand, rtol=0, atol=1e-12)


def test_a_head_cast_to_bf16_keeps_float32_rotation_frequencies():
    """A head loaded for a bf16 target is cast with .to(bfloat16); its inv_freq became bf16 too (relative error up to
    3.7e-3, an angle error of 0.37 rad at position 2,048), which training (fp32 under autocast) and vLLM never see.
    The angles at position 2,048 must be the float32 head's."""
    head = Eagle3Head(Eagle3Config.from_target(tiny_target().config))
    exact = head.inv_freq.clone()
    assert exact.dtype == torch.float32
    low = Eagle3Head(Eagle3Config.from_target(tiny_target().config)).to(torch.bfloat16)
    assert low.inv_freq.dtype == torch.float32 and torch.equal(low.inv_freq, exact)
    cos, sin = low.rope(torch.tensor([2048]))
    cos32, sin32 = head.rope(torch.tensor([2048]))
    assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))
    assert Eagle3Head(Eagle3Config.from_target(tiny_target().config)).double().inv_freq.dtype == torch.float64


@pytest.mark.parametrize("steps", [1, 3])
def test_training_time_test_equals_drafting_the_chain_step_by_step(steps):
    """ttt_forward's output at anchor t, step k == the head run as the drafter runs it: the anchors 0..t fed with
    the target's features (one causal step), then k chain steps, each fed its parent's output and x_{t+1+k}."""
    target = tiny_target()
    head = random_head(target)
    T = 9
    torch.manual_seed(3)
    ids = torch.randint(0, V, (2, T + steps))
    aux = torch.randn(2, T + steps, 3 * D, dtype=torch.float64)
    tokens = ids[:, 1:]  # anchor t consumes x_{t+1}
    outs = head.ttt_forward(tokens, aux[:, : tokens.shape[1]], steps)
    for b in range(2):
        for t in (0, 4, T - 1):
            cache = head.new_cache(capacity=2)  # small: the buffer grows while the chain is drafted
            past_out = head.step(tokens[b, : t + 1], head.fuse(aux[b, : t + 1]), torch.arange(1, t + 2), cache, None)
            torch.testing.assert_close(outs[0][b, t], past_out[-1], rtol=0, atol=1e-10)
            feature = past_out[-1]
            for k in range(1, steps):
                mask = torch.ones(1, cache.length + 1, dtype=torch.bool)  # the anchors 0..t, the chain, itself
                out = head.step(tokens[b, t + k : t + k + 1], feature[None], torch.tensor([t + 1 + k]), cache, mask)
                torch.testing.assert_close(outs[k][b, t], out[0], rtol=0, atol=1e-10)
                feature = out[0]


def test_a_copy_of_the_last_layer_accepts_what_neighbouring_target_positions_share():
    """init_from_target with the state entering the last layer as the only aux state: step 0 at anchor t then
    computes the target's own last layer at position t (RoPE sees the same offsets), so its distribution is the
    target's at t, scored against the target's at t + 1: α must be Σ_v min(p_t, p_{t+1}) averaged, from the target
    alone, and top-1 the share of positions where the two argmaxes agree."""
    target = tiny_target()
    head = Eagle3Head(Eagle3Config.from_target(target.config, [L - 1])).double()
    init_from_target(head, target)
    head.use_embedding(target.get_input_embeddings())
    torch.manual_seed(5)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
        logits = head(torch.nn.functional.pad(ids[:, 1:], (0, 1)), out.hidden_states[L - 1], 1)
    p = out.logits.softmax(-1)
    overlap = torch.minimum(p[:, :-2], p[:, 1:-1]).sum(-1)  # anchors t = 0..T-3 have a label after t + 1
    agree = (p[:, :-2].argmax(-1) == p[:, 1:-1].argmax(-1)).double()
    labels = ids.clone()
    _, count, metrics = step_losses(logits, out.logits, torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100),
                                    Eagle3TaskConfig(steps=1), {"kl": 1.0}, None, evaluating=False)
    assert int(count) == overlap.numel()
    assert float(metrics["alpha_step0"]) / int(count) == pytest.approx(float(overlap.mean()), rel=1e-6)  # α sums in fp32
    assert float(metrics["top1_step0"]) / int(count) == pytest.approx(float(agree.mean()), abs=1e-12)


def test_step_losses_by_hand():
    """Two steps on one row of four positions over three tokens, against sums written out term by term."""
    torch.manual_seed(0)
    s0, s1 = torch.randn(1, 4, 3, dtype=torch.float64), torch.randn(1, 4, 3, dtype=torch.float64)
    teacher = torch.randn(1, 4, 3, dtype=torch.float64)
    next_labels = torch.tensor([[1, 2, 0, -100]])  # position 3 has no next token
    cfg = Eagle3TaskConfig(steps=2, step_decay=0.5, loss="mix", kl_weight=1.0, tvd_weight=2.0)
    total, count, m = step_losses([s0, s1], teacher, next_labels, cfg, cfg.weights(), None, evaluating=True)

    def sm(x):
        e = [math.exp(v) for v in x]
        return [v / sum(e) for v in e]

    def terms(s, t):
        q, p = sm(s.tolist()), sm(t.tolist())
        kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        alpha = sum(min(pi, qi) for pi, qi in zip(p, q))
        return kl, 1 - alpha, alpha, max(range(3), key=lambda i: q[i]) == max(range(3), key=lambda i: p[i])

    # step 0: anchors t = 0, 1 (t + 1 = 1, 2 carry labels: next_labels[1], [2] != -100); step 1: anchor 0 (t+2 = 2)
    step0 = [terms(s0[0, t], teacher[0, t + 1]) for t in (0, 1)]
    step1 = [terms(s1[0, 0], teacher[0, 2])]
    want = sum(kl + 2 * tvd for kl, tvd, _, _ in step0) + 0.5 * sum(kl + 2 * tvd for kl, tvd, _, _ in step1)
    assert float(total) == pytest.approx(want, rel=1e-6)  # the loss sums in fp32 and int(count) == 2
    assert float(m["alpha_step0"]) == pytest.approx(step0[0][2] + step0[1][2], rel=1e-6)
    assert float(m["alpha_step1"]) == pytest.approx(step1[0][2], rel=1e-6)
    # the chain: only anchor 0 reaches both steps; its Π over steps
    assert float(m["chain_anchors"]) == 1
    assert float(m["chain_alpha_step1"]) == pytest.approx(step0[0][2] * step1[0][2], rel=1e-6)
    assert float(m["chain_greedy_step1"]) == float(step0[0][3] and step1[0][3])
    means = {k: float(v) / 2 for k, v in m.items()}
    d = derive(means, 2, (0.1, 1.2))
    assert d["tau_ttt"] == pytest.approx(1 + step0[0][2] + step0[0][2] * step1[0][2], rel=1e-6)
    assert d["alpha_at_step1"] == pytest.approx(step1[0][2], rel=1e-6)
    assert d["predicted_speedup"] == pytest.approx(d["tau_ttt"] / (2 * 0.1 + 1.2), rel=1e-6)


def test_export_round_trip_and_the_speculators_maps(tmp_path):
    target = tiny_target()
    d2t = [0, 3, 4, 9, 17, 30]
    head = random_head(target, draft_vocab=d2t).float()
    out = save_head(head, target.config, None, tmp_path / "e3", {"target": "tiny"}, steps=3)
    assert is_eagle3_export(out)
    import json

    from safetensors.torch import load_file

    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 6
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["norm_before_residual"] is False
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    saved = load_file(str(out / "model.safetensors"))
    assert [i + int(o) for i, o in enumerate(saved["d2t"])] == d2t  # offsets: draft id + d2t[id] = target id
    assert saved["t2d"].nonzero().flatten().tolist() == d2t
    loaded, meta = load_head(out, target.config)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert torch.equal(offsets_of(d2t), saved["d2t"])

    other = tiny_target(hidden=48)
    with pytest.raises(CompatibilityError, match="hidden_size 32 .head. vs 48 .target."):
        load_head(out, other.config)
    with pytest.raises(CompatibilityError, match="num_target_layers 4 .head. vs 6 .target."):
        load_head(out, tiny_target(layers=6).config)
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated shard
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_head(out, target.config)


def test_the_exported_layer_config_describes_the_heads_own_layer(tmp_path, monkeypatch):
    """vLLM builds the head's layer from transformer_layer_config: it sizes fc by num_aux_hidden_states (else 3,
    so a 2-layer choice failed its weight-size check) and creates bias tensors where attention_bias / mlp_bias
    say so (the head has none: copied from a biased target they would be left unloaded)."""
    import json

    config = tiny_target().config
    config.attention_bias = config.mlp_bias = True
    head = Eagle3Head(Eagle3Config.from_target(config, [1, 3]))
    layer = json.loads((save_head(head, config, None, tmp_path / "e3", {"target": "t"}, steps=2) / "config.json")
                       .read_text())["transformer_layer_config"]
    assert layer["num_aux_hidden_states"] == 2 and layer["attention_bias"] is False and layer["mlp_bias"] is False
    assert not [name for name, _ in head.named_parameters() if name.endswith("bias")]
    # a local target named relatively is written absolute: `vllm serve EXPORT` must not depend on where it runs
    (tmp_path / "t").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    out = save_head(head, config, None, tmp_path / "e3b", {"target": "../t"}, steps=2)
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == str((tmp_path / "t").resolve())


def test_the_heads_mlp_uses_the_targets_activation():
    """By hand: down(act(gate x) * up x) with the target's hidden_act (GELU here); the head used SiLU whatever the
    target's, while its export recorded the target's."""
    config = tiny_target().config
    config.hidden_act = "gelu"
    head = Eagle3Head(Eagle3Config.from_target(config)).double()
    mlp = head.layers[0].mlp
    x = torch.randn(3, D, dtype=torch.float64)
    want = mlp.down_proj(torch.nn.functional.gelu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), want, rtol=0, atol=0)


def test_the_cache_grows_without_losing_rows_and_truncates():
    from draftforge.models.eagle3 import KVCache

    cache = KVCache(1, 2, torch.float32, "cpu", capacity=1)
    rows = torch.arange(10.0).view(1, 5, 2)
    for i in range(5):
        cache.append(rows[:, i : i + 1], -rows[:, i : i + 1])
    k, v = cache.view()
    assert torch.equal(k, rows) and torch.equal(v, -rows) and cache.nbytes() == 2 * 5 * 2 * 4
    cache.truncate(2)
    cache.append(rows[:, 4:], rows[:, 4:])
    assert torch.equal(cache.view()[0], rows[:, [0, 1, 4]])


@pytest.mark.parametrize("steps", [1, 3])
def test_mamba_body_training_time_test_equals_drafting_the_chain(steps):
    """The Mamba2 body: ttt_forward at anchor t, step k == feeding anchors 0..t one at a time from the empty state,
    then k chain steps from that state, each fed its parent's output and x_{t+1+k} (the drafter's order)."""
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig

    target = tiny_target()
    torch.manual_seed(2)
    head = FeatureMamba2Head(FeatureMambaConfig.from_target(target.config, head_dim=16, state_size=8)).double()
    head.use_embedding(target.get_input_embeddings())
    T = 7
    ids = torch.randint(0, V, (2, T + steps))
    aux = torch.randn(2, T + steps, 3 * D, dtype=torch.float64)
    tokens = ids[:, 1:]
    outs = head.ttt_forward(tokens, aux[:, : tokens.shape[1]], steps)
    for b in range(2):
        for t in (0, 3, T - 1):
            states = head.empty_state(1)
            for i in range(t + 1):  # one anchor at a time: no batching across positions
                out, states = head.step(tokens[b, i : i + 1], head.fuse(aux[b, i : i + 1]), states)
            torch.testing.assert_close(outs[0][b, t], out[0], rtol=0, atol=1e-12)
            for k in range(1, steps):
                out, states = head.step(tokens[b, t + k : t + k + 1], out, states)
                torch.testing.assert_close(outs[k][b, t], out[0], rtol=0, atol=1e-12)


def test_mamba_body_state_is_the_same_size_at_any_context():
    from draftforge.decode import load_drafter, load_target
    from draftforge.decode.sampling import SamplingParams
    from tests.fixtures.decode import feature_mamba_head

    target = load_target(tiny_target())
    drafter = load_drafter(feature_mamba_head(target.model), target)
    sizes = []
    for n in (5, 40):
        seq = [(7 * i + 1) % V for i in range(n)]
        target.prefill(seq)
        drafter.reset()
        drafter.draft(seq, (1, 1), SamplingParams(), torch.Generator())
        sizes.append(drafter.cache_bytes())
    assert sizes[0] == sizes[1] == drafter.model.state_bytes() > 0


def test_mamba_body_prefill_equals_feeding_the_prompt_one_token_at_a_time():
    """The drafter's prompt prefill (one parallel scan keeping only the last state) == `run`, position by position."""
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig

    target = tiny_target()
    torch.manual_seed(6)
    head = FeatureMamba2Head(FeatureMambaConfig.from_target(target.config, head_dim=16, state_size=8)).double()
    head.use_embedding(target.get_input_embeddings())
    for n in (2, 45):  # shorter than the conv window, and over one scan chunk
        tokens, feature = torch.randint(0, V, (n,)), head.fuse(torch.randn(n, 3 * D, dtype=torch.float64))
        out, states = head.prefill(tokens, feature)
        want_out, want_states, _ = head.run(tokens[None], feature[None])
        torch.testing.assert_close(out, want_out[0], rtol=0, atol=1e-12)
        for (conv, ssm), (want_conv, want_ssm) in zip(states, want_states):
            torch.testing.assert_close(conv, want_conv, rtol=0, atol=1e-12)
            torch.testing.assert_close(ssm, want_ssm, rtol=0, atol=1e-12)


def test_mamba_body_prefill_in_pieces_equals_feeding_the_prompt_one_token_at_a_time():
    """A prompt prefilled in pieces (each piece's scan starting from the last one's conv window and SSM state, as
    the drafter does for a long prompt) == `run`, position by position; pieces shorter than the conv window too."""
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig

    target = tiny_target()
    torch.manual_seed(7)
    head = FeatureMamba2Head(FeatureMambaConfig.from_target(target.config, head_dim=16, state_size=8)).double()
    head.use_embedding(target.get_input_embeddings())
    n = 45
    tokens, feature = torch.randint(0, V, (n,)), head.fuse(torch.randn(n, 3 * D, dtype=torch.float64))
    want_out, want_states, _ = head.run(tokens[None], feature[None])
    for cuts in ([2, 5], [20], [1, 2, 3, 40]):
        outs, states, start = [], None, 0
        for end in [*cuts, n]:
            out, states = head.prefill(tokens[start:end], feature[start:end], states)
            outs.append(out)
            start = end
        torch.testing.assert_close(torch.cat(outs), want_out[0], rtol=0, atol=1e-12)
        for (conv, ssm), (want_conv, want_ssm) in zip(states, want_states):
            torch.testing.assert_close(conv, want_conv, rtol=0, atol=1e-12)
            torch.testing.assert_close(ssm, want_ssm, rtol=0, atol=1e-12)


def test_feature_mamba_drafter_decodes_a_prompt_fed_in_pieces_as_generate_does():
    from draftforge.decode import build_decoder, load_drafter, load_target
    from tests.fixtures.decode import feature_mamba_head

    model = tiny_target()
    target = load_target(model)
    drafter = load_drafter(feature_mamba_head(model), target)
    assert drafter.prompt_chunk == 512  # CPU
    drafter.prompt_chunk = 6
    prompt = [(5 * i + 3) % V for i in range(40)]
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    for method, options in (("chain", {"chain_length": 3}), ("eagle2", {})):
        res = build_decoder(method, target, drafter, **options).generate(prompt, max_new_tokens=12)
        assert res.tokens == ref[0, len(prompt):].tolist(), method


def test_unrolled_anchors_by_hand():
    """Anchor t needs steps >= 1 when some step k >= 1 scores it: the label after t + 1 + k exists."""
    from draftforge.train.eagle3 import unrolled_anchors

    next_BT = torch.full((1, 10), -100)
    next_BT[0, 6] = 5  # scored at step k for anchor 5 - k: anchors 4 (k=1) and 3 (k=2) with 3 steps
    assert unrolled_anchors(next_BT, 1) is None
    assert unrolled_anchors(next_BT, 3)[0].nonzero().flatten().tolist() == [3, 4]
    assert unrolled_anchors(next_BT, 2)[0].nonzero().flatten().tolist() == [4]


def test_mamba_body_unrolls_only_the_anchors_asked_and_its_loss_and_gradients_are_the_full_unrolls():
    """Oracle: the full unroll (every anchor, every step). Kept anchors' outputs are the full unroll's to float64
    rounding, the others are zero past step 0, and the TTT loss (scored only where unrolled_anchors keeps) and
    its gradients match."""
    from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig
    from draftforge.train.eagle3 import full_teacher, scored_steps, unrolled_anchors

    target = tiny_target()
    torch.manual_seed(3)
    head = FeatureMamba2Head(FeatureMambaConfig.from_target(target.config, head_dim=16, state_size=8)).double()
    head.use_embedding(target.get_input_embeddings())
    steps, T = 3, 12
    tokens = torch.randint(0, V, (2, T))
    aux = torch.randn(2, T, 3 * D, dtype=torch.float64)
    next_BT = torch.full((2, T), -100)
    next_BT[0, 7:10], next_BT[1, 4] = 1, 1  # two answers' labels
    keep = unrolled_anchors(next_BT, steps)
    full, part = head.ttt_forward(tokens, aux, steps), head.ttt_forward(tokens, aux, steps, keep)
    assert torch.equal(full[0], part[0])
    for k in range(1, steps):
        torch.testing.assert_close(part[k][keep], full[k][keep], rtol=0, atol=1e-12)
        assert not part[k][~keep].any()
    cfg = Eagle3TaskConfig(steps=steps)
    teacher = torch.randn(2, T, V, dtype=torch.float64)

    def loss_and_grads(unroll):
        head.zero_grad()
        logits = head(tokens, aux, steps, unroll)
        total, count, _ = scored_steps(logits, full_teacher(teacher, 1.0, None), next_BT, cfg, cfg.weights(), False)
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    (loss_full, grads_full), (loss_part, grads_part) = loss_and_grads(None), loss_and_grads(keep)
    torch.testing.assert_close(loss_part, loss_full, rtol=1e-12, atol=0)
    assert grads_part.keys() == grads_full.keys() and len(grads_full) == len(list(head.parameters()))
    for name, g_full in grads_full.items():
        torch.testing.assert_close(grads_part[name], g_full, rtol=1e-10, atol=1e-12, msg=name)


def test_speculators_offsets_by_hand_and_an_unsorted_map_is_refused():
    # d2t[i] = target id − i (speculators' vocab_mapping); its t2d mask carries no order, so rows must ascend
    from draftforge.errors import CompatibilityError

    assert offsets_of([1, 3, 4, 9]).tolist() == [1, 2, 2, 6]
    with pytest.raises(CompatibilityError, match="ascending"):
        offsets_of([1, 9, 4])


def test_a_draft_vocabulary_of_every_id_exports_no_maps(tmp_path):
    """A head whose draft vocabulary holds every target id wrote d2t / t2d with draft_vocab_size == vocab_size;
    vLLM drops its map for such a head and then refuses the checkpoint's d2t (no parameter of that name)."""
    from safetensors.torch import load_file

    target = tiny_target()
    vocab = target.config.vocab_size
    head = random_head(target, draft_vocab=list(range(vocab))).float()
    out = save_head(head, target.config, None, tmp_path / "e3", {"target": "tiny"}, steps=3)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == vocab
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    loaded, _ = load_head(out, target.config)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # every id in another order wrote no map either, so an engine paired lm_head row i with token i, not perm[i]
    from draftforge.errors import CompatibilityError

    shuffled = random_head(target, draft_vocab=[1, 0, *range(2, vocab)]).float()
    with pytest.raises(CompatibilityError, match="ascending"):
        save_head(shuffled, target.config, None, tmp_path / "shuffled", {"target": "tiny"}, steps=3)
    assert not (tmp_path / "shuffled").exists()


def test_tree_nodes_see_the_anchors_and_their_own_ancestors_at_their_positions():
    """Lossless decoding hides what a drafter proposes, so node logits are checked directly: a tree with two children
    of the root and a grandchild under the second, against a chain drafted through Eagle3Head.step (the anchors,
    then root -> 8 -> 13 at positions n, n + 1). A node position off by one (0.48 off) or a node that misses its
    ancestors or sees its parent's sibling (0.29 off) both passed every other test."""
    from draftforge.decode import load_drafter, load_target

    target_model = tiny_target(layers=4)
    head = random_head(target_model)
    with torch.no_grad():
        head.layers[0].self_attn.q_proj.weight.mul_(0.2)  # attention weights that are not one-hot
        head.layers[0].self_attn.k_proj.weight.mul_(0.2)
    target = load_target(target_model)
    drafter = load_drafter(head, target)
    seq = [5, 17, 3, 9, 22, 7, 11]
    target.prefill(seq)
    drafter.reset()
    drafter.begin(seq)
    level1 = drafter.feed([-1, -1], [4, 8], [0, 1])
    level2 = drafter.feed([1], [13], [2])
    n = len(seq)
    with torch.no_grad():
        states = target_model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i][0] for i in head.config.aux_layers], -1)[: n - 1]
        cache = head.new_cache()
        last = head.step(torch.tensor(seq[1:]), head.fuse(aux), torch.arange(1, n), cache, None)[-1]
        out1 = head.step(torch.tensor([8]), last[None], torch.tensor([n]), cache, None)
        out2 = head.step(torch.tensor([13]), out1, torch.tensor([n + 1]), cache, None)
    # the drafter hands out float32 logits: 1e-5 covers their rounding, far below either break
    torch.testing.assert_close(level1[1:2].double(), head.logits(out1).double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(level2.double(), head.logits(out2).double(), rtol=0, atol=1e-5)
