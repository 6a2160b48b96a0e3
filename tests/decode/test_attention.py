"""draftforge's decode attention (decode/attention.py) against torch's scaled_dot_product_attention in float64
(the oracle: same mathematics, another implementation), then end to end in bf16 against the float32 model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from draftforge.decode import build_decoder, load_target
from draftforge.decode import attention as decode_attention_mod
from draftforge.decode.attention import (FLASH_ROWS_ENV, NAME, decode_attention_unavailable, matmul_attention,
                                         standard_attention, use_decode_attention)
from draftforge.kernels.attention import packed_flash_attention, probe_flash_rows
from draftforge.decode.tree import DraftTree, ancestor_matrix, packed_tree_mask
from draftforge.errors import RecipeError
from tests.fixtures.decode import tiny_llama


def _qkv(q, k, heads=6, kv_heads=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, q, d, generator=g, dtype=torch.float64),
            torch.randn(1, kv_heads, k, d, generator=g, dtype=torch.float64),
            torch.randn(1, kv_heads, k, d, generator=g, dtype=torch.float64))


def _sdpa(query, key, value, **kw):
    rep = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1), **kw)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q,k", [(1, 1), (1, 37), (4, 37), (9, 9)])
def test_causal_and_unmasked_rows_match_sdpa_in_float64(q, k):
    query, key, value = _qkv(q, k)
    got = matmul_attention(query, key, value, None, is_causal=True).to(torch.float64)
    if q == 1:
        want = _sdpa(query, key, value)
    else:  # causal over the last q keys: row i sees keys up to k - q + i
        visible = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
        want = _sdpa(query, key, value, attn_mask=visible)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)  # float32 arithmetic inside


def _tree_case(past=11):
    """A verified tree's masks (additive and bool [1, 1, 6, past + 6]) over `past` cached keys, its float64 inputs
    and sdpa's float64 answer."""
    anc = ancestor_matrix([-1] + [p + 1 for p in [-1, -1, 0, 1, 3]])
    additive = packed_tree_mask(anc, past, torch.float64, "cpu")
    visible = additive == 0
    query, key, value = _qkv(6, past + 6, seed=1)
    return (query, key, value), additive, visible, _sdpa(query, key, value, attn_mask=visible)


def test_tree_masks_bool_and_additive_match_sdpa():
    past = 11
    (query, key, value), additive, visible, want = _tree_case(past)
    for mask in (additive, visible):
        assert torch.allclose(matmul_attention(query, key, value, mask).double(), want, atol=1e-6, rtol=0)
    per_head = visible.expand(1, 6, 6, past + 6)
    assert torch.allclose(matmul_attention(query, key, value, per_head).double(), want, atol=1e-6, rtol=0)


def test_only_cpu_bf16_llama_family_models_switch(tmp_path):
    fp32 = tiny_llama(vocab=64)
    assert "bf16" in decode_attention_unavailable(fp32)
    assert use_decode_attention(fp32).startswith("attention left as it is")
    assert fp32.config._attn_implementation == "sdpa"
    model = tiny_llama(vocab=64, dtype=torch.bfloat16)
    assert NAME in use_decode_attention(model) and model.config._attn_implementation == NAME
    with standard_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == NAME
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(RecipeError, match="decode_attention must be one of auto, on, off"):
        load_target(tmp_path / "m", decode_attention="fast")


@pytest.mark.parametrize("q,k", [(1, 1), (1, 37), (4, 37), (9, 9)])
def test_packed_flash_causal_and_unmasked_rows_match_sdpa_in_float64(q, k):
    """The flash path regroups query heads and masks; in float64 its arithmetic is sdpa's own, so any error of
    the regrouping (a head paired with the wrong KV head, a mask row with the wrong query row) shows at once."""
    query, key, value = _qkv(q, k, heads=6, kv_heads=2)
    got = packed_flash_attention(query, key, value, None, is_causal=True)
    visible = torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None]
    assert torch.allclose(got, _sdpa(query, key, value, attn_mask=visible), atol=1e-12, rtol=0)


def test_packed_flash_tree_masks_bool_additive_and_per_head():
    past = 11
    (query, key, value), additive, visible, want = _tree_case(past)
    for mask in (additive, visible, visible.expand(1, 6, 6, past + 6)):
        assert torch.allclose(packed_flash_attention(query, key, value, mask), want, atol=1e-12, rtol=0)
    # a per-head mask that differs between the heads of one KV head: each head must get its own rows
    per_head = visible.expand(1, 6, 6, past + 6).clone()
    per_head[0, 1, :, 3] = False
    per_head[0, 4, 2, past + 1] = False
    rep = 3
    want = F.scaled_dot_product_attention(query, key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1),
                                          attn_mask=per_head).transpose(1, 2)
    assert torch.allclose(packed_flash_attention(query, key, value, per_head), want, atol=1e-12, rtol=0)
    # a mask longer than the keys (a static cache's spare columns) is cut to them
    longer = torch.cat([visible, torch.zeros(1, 1, 6, 4, dtype=torch.bool)], dim=-1)
    assert torch.allclose(packed_flash_attention(query, key, value, longer), _sdpa(query, key, value,
                          attn_mask=visible), atol=1e-12, rtol=0)


def test_packed_flash_in_bf16_is_as_close_to_float64_as_transformers_sdpa():
    """In bf16 the flash path rounds as torch's fused kernel does (not once, as the matmul path): it must be no
    further from the float64 result than transformers' own sdpa path (repeat_kv, then the same kernel), plus one
    bf16 rounding step of the output's scale."""
    query, key, value = _qkv(6, 300, heads=9, kv_heads=3, d=64, seed=4)
    visible = torch.arange(300)[None, :] <= torch.arange(294, 300)[:, None]
    want = _sdpa(query, key, value, attn_mask=visible)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (query, key, value))
    flash = packed_flash_attention(q16, k16, v16, visible[None, None]).double()
    sdpa = _sdpa(q16, k16, v16, attn_mask=visible).double()
    step = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    assert (flash - want).abs().max().item() <= (sdpa - want).abs().max().item() + step


def test_the_probe_times_both_kernels_at_every_row_count():
    best, times = probe_flash_rows(4, 2, 16, torch.bfloat16, keys=64, repeats=1)
    assert sorted(times) == [1, 2, 4, 8, 16, 32, 64] and all(f > 0 and m > 0 for f, m in times.values())
    # best is the largest row count up to which flash won every probe by the margin (0 if it lost at one row)
    wins = [r for r, (f, m) in sorted(times.items()) if f < 0.9 * m]
    prefix = 0
    for r in sorted(times):
        if r not in wins:
            break
        prefix = r
    assert best == prefix


def test_decode_attention_routes_rows_by_the_modules_flash_rows(monkeypatch):
    model = tiny_llama(vocab=64, dtype=torch.bfloat16)
    monkeypatch.setenv(FLASH_ROWS_ENV, "2")
    said = use_decode_attention(model)
    assert "flash kernel" in said and "up to 2 query rows" in said and f"set by {FLASH_ROWS_ENV}" in said
    modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    assert modules and all(m.draftforge_flash_rows == 2 for m in modules)
    used = []
    for name in ("packed_flash_attention", "matmul_attention"):
        real = getattr(decode_attention_mod, name)
        monkeypatch.setattr(decode_attention_mod, name,
                            lambda *a, _n=name, _r=real, **k: used.append((_n, a[0].shape[2])) or _r(*a, **k))
    query, key, value = (t.to(torch.bfloat16) for t in _qkv(1, 9, heads=4, kv_heads=2))
    for rows in (1, 2, 3):
        q = query.expand(1, 4, rows, 8).contiguous()
        decode_attention_mod.decode_attention(modules[0], q, key, value, None)
    assert used == [("packed_flash_attention", 1), ("packed_flash_attention", 2), ("matmul_attention", 3)]
    monkeypatch.setenv(FLASH_ROWS_ENV, "many")
    with pytest.raises(RecipeError, match=f"{FLASH_ROWS_ENV} must be a number of query rows"):
        use_decode_attention(tiny_llama(vocab=64, dtype=torch.bfloat16))
    monkeypatch.delenv(FLASH_ROWS_ENV)
    said = use_decode_attention(tiny_llama(vocab=64, dtype=torch.bfloat16))  # the probe decides
    assert "probed at" in said
    # once per process and shape: a second model of the same shape gets the same choice, whatever the timings now
    assert use_decode_attention(tiny_llama(vocab=64, dtype=torch.bfloat16)) == said


@pytest.fixture(scope="module", params=[0, 64], ids=["matmul", "flash"])
def pair(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("attn") / "target"
    tiny_llama(vocab=96, layers=2, hidden=64, ctx=512).save_pretrained(path)
    with pytest.MonkeyPatch.context() as env:  # every decoding row on one kernel, whatever the probe would pick
        env.setenv(FLASH_ROWS_ENV, str(request.param))
        fast = load_target(path, dtype=torch.bfloat16)
    plain = load_target(path, dtype=torch.bfloat16, decode_attention="off")
    exact = load_target(path, dtype=torch.float32)
    assert fast.model.config._attn_implementation == NAME
    assert {m.draftforge_flash_rows for m in fast.model.modules() if hasattr(m, "num_key_value_groups")} == {
        request.param}
    assert plain.model.config._attn_implementation == "sdpa" == exact.model.config._attn_implementation
    return fast, plain, exact


def test_bf16_logits_are_as_close_to_fp32_as_sdpas(pair):
    """AR steps, a verified chain and a verified tree against a long cache: the decode attention's bf16 logits are
    no further from the fp32 model's than transformers' sdpa's bf16 logits are (plus one bf16 rounding step)."""
    fast, plain, exact = pair
    prompt = [(5 * i + 1) % 96 for i in range(300)]
    tree = DraftTree([5, 6, 9, 11, 12], [-1, -1, 0, 0, 2], [1, 1, 2, 2, 3])
    for draft in (DraftTree([], [], []), DraftTree([5, 9, 11], [-1, 0, 1], [1, 2, 3]), tree):
        logits = []
        for t in pair:
            t.prefill(prompt)
            logits.append(t.verify(prompt[-1], draft))
        err_fast = (logits[0] - logits[2]).abs().max().item()
        err_sdpa = (logits[1] - logits[2]).abs().max().item()
        step = torch.finfo(torch.bfloat16).eps * logits[2].abs().max().item()
        assert err_fast <= err_sdpa + step, (len(draft), err_fast, err_sdpa)


def test_an_fp32_copy_computes_sdpa_exactly(pair):
    fast, plain, _ = pair
    fp32_copy = copy.deepcopy(fast.model).float()  # the self-check's reference copy: falls back to sdpa
    fp32_plain = copy.deepcopy(plain.model).float()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        assert torch.equal(fp32_copy(ids).logits, fp32_plain(ids).logits)
        assert torch.equal(fp32_copy(ids[:, :1]).logits, fp32_plain(ids[:, :1]).logits)  # one row too


def test_decodes_with_the_decode_attention_are_lossless(pair):
    """The harness with the decode attention equals the same model's own greedy generate() (which runs the same
    attention for its one-row steps)."""
    fast = pair[0]
    prompt = [(7 * i + 3) % 96 for i in range(40)]
    ids = torch.tensor([prompt])
    want = fast.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got = build_decoder("ar", fast).generate(prompt, max_new_tokens=30, eos_token_id=[]).tokens
    assert got == want


def test_eagle3_head_step_in_bf16_takes_the_matmul_path_and_agrees_with_sdpa(monkeypatch):
    """The EAGLE-3 head's decoding step (its own KV cache) in bf16 uses matmul_attention; against the same head's
    float32 step (torch's sdpa) it is no further off than the bf16 step with sdpa (plus one bf16 step)."""
    import draftforge.models.eagle3 as e3
    from tests.fixtures.decode import eagle3_head

    target = tiny_llama(vocab=64, layers=4, hidden=64)
    head32 = eagle3_head(target)
    head16 = copy.deepcopy(head32).to(torch.bfloat16)
    for head in (head32, head16):
        head.use_embedding(target.get_input_embeddings())
    gen = torch.Generator().manual_seed(3)
    ctx, q = 40, 5
    tokens = torch.randint(0, 64, (ctx + q,), generator=gen)
    feature = torch.randn(ctx + q, head32.config.hidden_size, generator=gen)
    mask = torch.ones(q, ctx + q, dtype=torch.bool).tril(ctx)
    mask[3, ctx + 1] = False  # a tree-shaped row

    def run(head):
        cache = head.new_cache()
        head.step(tokens[:ctx], feature[:ctx].to(head.dtype), torch.arange(ctx), cache, None)
        return head.step(tokens[ctx:], feature[ctx:].to(head.dtype), torch.arange(ctx, ctx + q), cache, mask).float()

    calls = []
    real = e3.matmul_attention_for
    monkeypatch.setattr(e3, "matmul_attention_for", lambda q_: calls.append(q_.dtype) or real(q_))
    want, fast = run(head32), run(head16)
    assert calls == [torch.float32] * 2 + [torch.bfloat16] * 2 and not real(torch.zeros(1))
    kernels = []
    for name in ("packed_flash_attention", "matmul_attention"):
        real_kernel = getattr(e3, name)
        monkeypatch.setattr(e3, name, lambda *a, _n=name, _r=real_kernel, **k: kernels.append(_n) or _r(*a, **k))
    head16.draftforge_flash_rows = q  # what load_eagle3 sets from the probe: the packed flash kernel up to q rows
    flash = run(head16)
    assert kernels == ["matmul_attention", "packed_flash_attention"], kernels  # the 40-row prompt, then q rows
    head16.draftforge_flash_rows = 0
    monkeypatch.setattr(e3, "matmul_attention_for", lambda q_: False)
    sdpa16 = run(head16)
    step = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
    assert (fast - want).abs().max().item() <= (sdpa16 - want).abs().max().item() + step
    assert (flash - want).abs().max().item() <= (sdpa16 - want).abs().max().item() + step


def test_the_heads_prompt_feed_keeps_sdpa_and_its_memory_bounded(monkeypatch):
    """A prompt of more than MAX_ROWS anchors fed to the bf16 head in one step must not build the whole score
    matrix (rows x keys x heads: +5 GiB for an 8k prompt of SmolLM2's head, in the float32 matmul path or in
    sdpa's math path, which an explicit mask selects): it goes to sdpa as causal with no mask; decoding steps of
    up to MAX_ROWS rows keep the matmul path."""
    import draftforge.models.eagle3 as e3
    from draftforge.kernels.attention import MAX_ROWS
    from tests.fixtures.decode import eagle3_head

    target = tiny_llama(vocab=64, layers=4, hidden=64)
    head = eagle3_head(target).to(torch.bfloat16)
    head.use_embedding(target.get_input_embeddings())
    heads, dim = head.config.num_attention_heads, head.config.head_dim
    assert e3.matmul_attention_for(torch.zeros(MAX_ROWS, heads, dim, dtype=torch.bfloat16))
    assert not e3.matmul_attention_for(torch.zeros(MAX_ROWS + 1, heads, dim, dtype=torch.bfloat16))
    used = []
    real = e3.matmul_attention
    monkeypatch.setattr(e3, "matmul_attention", lambda *a, **k: used.append(a[0].shape[2]) or real(*a, **k))
    n = 3 * MAX_ROWS
    tokens = torch.randint(0, 64, (n + 1,), generator=torch.Generator().manual_seed(0))
    feature = torch.randn(n + 1, head.config.hidden_size).to(torch.bfloat16)
    sdpa_calls = []
    real_sdpa = e3.F.scaled_dot_product_attention
    monkeypatch.setattr(e3.F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa_calls.append((k.get("attn_mask"), k.get("is_causal"))) or real_sdpa(*a, **k))
    cache = head.new_cache()
    head.step(tokens[:n], feature[:n], torch.arange(n), cache, None)  # the prompt: sdpa, causal, no mask made
    head.step(tokens[n:], feature[n:], torch.arange(n, n + 1), cache, None)  # a decoding step: matmul
    assert used == [1] and sdpa_calls == [(None, True)]
    # the causal prompt path computes what an explicit causal mask does (float32: the same sums, up to order)
    head32 = eagle3_head(target)
    head32.use_embedding(target.get_input_embeddings())
    feature32 = feature[:n].float()
    causal = head32.step(tokens[:n], feature32, torch.arange(n), head32.new_cache(), None)
    masked = head32.step(tokens[:n], feature32, torch.arange(n), head32.new_cache(),
                         torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.allclose(causal, masked, rtol=1e-5, atol=1e-5)


def test_a_mask_hiding_a_cached_key_is_applied_in_full():
    """The trailing-block shortcut applies only where every cached key is visible: a mask that also hides a cached
    key (a sliding window, padding) must still hide it."""
    query, key, value = _qkv(3, 20, seed=2)
    visible = torch.arange(20)[None, :] <= torch.arange(17, 20)[:, None]
    visible[:, 4] = False  # a cached key nobody may see
    want = _sdpa(query, key, value, attn_mask=visible)
    assert torch.allclose(matmul_attention(query, key, value, visible[None, None]).double(), want, atol=1e-6, rtol=0)
    visible[1, 5] = False  # hidden from one row only
    want = _sdpa(query, key, value, attn_mask=visible)
    assert torch.allclose(matmul_attention(query, key, value, visible[None, None]).double(), want, atol=1e-6, rtol=0)


def test_a_bf16_eagle3_head_gets_the_kernel_choice_at_load(tmp_path, monkeypatch):
    from draftforge.decode import load_drafter
    from tests.fixtures.decode import eagle3_head

    model = tiny_llama(vocab=64, layers=4, hidden=64)
    model.save_pretrained(tmp_path / "t")
    monkeypatch.setenv(FLASH_ROWS_ENV, "3")
    drafter = load_drafter(eagle3_head(model), load_target(tmp_path / "t", dtype=torch.bfloat16))
    assert drafter.model.draftforge_flash_rows == 3 and f"set by {FLASH_ROWS_ENV}" in drafter.model.draftforge_attention
    fp32 = load_drafter(eagle3_head(model), load_target(tmp_path / "t", dtype=torch.float32))
    assert not hasattr(fp32.model, "draftforge_flash_rows")  # fp32 decodes with sdpa: nothing to choose
