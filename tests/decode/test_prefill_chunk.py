"""Chunked prefill (#34: prompts encoded in forwards of `prefill_chunk` tokens). Oracles: a float64 forward of the
whole prompt for the logits, the target's own generate() for the decodes.

Not bitwise in fp32, and this file does not ask it to be: torch's CPU GEMM may sum a row in an order that depends
on how many rows the product has and on the thread count (on the 2-core dev machine a row of a 7-row fp32 product
differed in the last bit from the same row of a 90-row one with 2 threads, not with 1), so a prompt encoded in
chunks can differ from one encoded at once by an ulp or two, as a one-shot prefill differs from token-by-token
decoding. The bound below is set before looking at either result: within 64 ulps (fp32) or 4 ulps
(bf16) of the largest float64 logit, for a 2-layer model whose reductions are at most a few hundred terms long."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.errors import CompatibilityError
from draftforge.eval.selfcheck import chain_tree
from tests.fixtures.decode import eagle3_head, greedy_runs, noisy_copy, tiny_llama, tiny_mamba2
from tests.fixtures.hybrid import HYBRIDS

VOCAB = 64
SEQ = torch.randint(1, VOCAB, (90,), generator=torch.Generator().manual_seed(1)).tolist()
ULPS = {torch.float32: 64, torch.bfloat16: 4}


def verify_after_prefill(model, chunk, seq=SEQ, drafts=(3, 4, 5)):
    target = load_target(model, prefill_chunk=chunk)
    target.prefill(seq)
    return target.verify(seq[-1], chain_tree(list(drafts))).double(), target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 16, 89, 500])
def test_chunked_prefill_logits_are_a_float64_forward_within_the_dtypes_rounding(dtype, chunk):
    model = tiny_llama(vocab=VOCAB, dtype=dtype)
    reference, _ = verify_after_prefill(tiny_llama(vocab=VOCAB, dtype=torch.float64), None)
    bound = ULPS[dtype] * torch.finfo(dtype).eps * reference.abs().max()
    once, _ = verify_after_prefill(model, None)
    chunked, target = verify_after_prefill(model, chunk)
    assert (once - reference).abs().max() <= bound  # the bound holds for the one-shot prefill too
    assert (chunked - reference).abs().max() <= bound
    assert target.lm.length == len(SEQ) + 3  # prompt (less its last token) + the verified 4 rows


def test_chunk_of_the_whole_prompt_or_more_is_one_forward_bitwise():
    model = tiny_llama(vocab=VOCAB)
    once, _ = verify_after_prefill(model, None)
    for chunk in (len(SEQ) - 1, 10_000):
        assert torch.equal(verify_after_prefill(model, chunk)[0], once)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_decodes_with_a_chunked_prefill_equal_generate(chunk):
    """fp32: AR, a chain and a tree over a Transformer drafter, and a chain over an EAGLE-3 head (which reads the
    prompt's features, gathered chunk by chunk), all equal to the target's own generate()."""
    model = tiny_llama(vocab=VOCAB, layers=3)
    target = load_target(model, prefill_chunk=chunk)
    prompts = [SEQ[:1], SEQ[:7], SEQ[:40]]
    drafter = load_drafter(noisy_copy(model, noise=0.05), target)
    head = load_drafter(eagle3_head(model), target)
    for method, d, opts in [("ar", None, {}), ("chain", drafter, {"chain_length": 3}),
                            ("tree", drafter, {"tree": (2, 2, 1)}), ("chain", head, {"chain_length": 3})]:
        dec = build_decoder(method, target, d, **opts)
        for _ in greedy_runs(dec, target, prompts, (1, 12)):
            pass


def test_features_of_a_chunked_prefill_are_the_one_shot_features_within_rounding():
    model = tiny_llama(vocab=VOCAB, layers=3)
    feats = {}
    for chunk in (None, 9):
        target = load_target(model, prefill_chunk=chunk)
        target.want_features([0, 1, 2])
        target.prefill(SEQ)
        feats[chunk] = target.take_features()
    assert feats[9].shape == feats[None].shape == (len(SEQ) - 1, 3 * model.config.hidden_size)
    assert torch.allclose(feats[9], feats[None], rtol=0, atol=64 * torch.finfo(torch.float32).eps
                          * feats[None].abs().max())


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_a_bad_chunk_is_refused_in_one_line(bad):
    with pytest.raises(CompatibilityError, match="prefill_chunk must be a whole number of tokens >= 1"):
        load_target(tiny_llama(vocab=VOCAB), prefill_chunk=bad)


# ---- SSM / hybrid targets (HybridTarget): chunks continue the K/V and the conv / SSM states


@pytest.mark.parametrize("kind", [k if k in ("bamba", "mamba2") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in sorted(HYBRIDS)])  # ~10 s each on 2 cores: two in the fast suite
def test_hybrid_target_chunked_prefill_is_a_float64_prefill_within_fp32_rounding(kind):
    """Oracle: the same model in float64, one plain forward over the prompt and the drafts (the tree scan runs in
    float32 at most, so the harness cannot verify in float64). The one-shot prefill meets the bound too. Chunks of
    5 and 13 cut across the models' own scan chunks; each continues from the cached conv window and SSM state (and
    K/V for attention layers)."""
    seq = [t % 48 for t in SEQ[:60]]  # the fixtures' vocabulary is 48
    with torch.no_grad():
        reference = HYBRIDS[kind](dtype=torch.float64)(input_ids=torch.tensor([seq + [3, 4, 5]])).logits[0, -4:]
    bound = 64 * torch.finfo(torch.float32).eps * reference.abs().max()
    for chunk in (None, 5, 13, 59):
        chunked, target = verify_after_prefill(HYBRIDS[kind](), chunk, seq)
        assert (chunked - reference).abs().max() <= bound, chunk
        assert target.length == len(seq) - 1  # the prompt less its last token (a verify moves nothing until commit)


@pytest.mark.parametrize("kind", ["bamba", "mamba2"])
def test_decodes_after_a_chunked_hybrid_prefill_equal_generate(kind):
    model = HYBRIDS[kind]()
    target = load_target(model, prefill_chunk=7)
    drafter = load_drafter(tiny_mamba2(vocab=48), target)
    for prompt in (SEQ[:3], SEQ[:30]):
        prompt = [t % 48 for t in prompt]
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        for method, options in (("ar", {}), ("chain", {"chain_length": 3}), ("tree", {"tree": "2,1"})):
            res = build_decoder(method, target, None if method == "ar" else drafter, **options).generate(
                prompt, max_new_tokens=10)
            assert res.tokens == ref[0, len(prompt):].tolist(), method


# ---- a Mamba2 drafter encodes a long prompt in chunks (drafters/mamba.py PROMPT_CHUNK)


def encoded(drafter, seq, chunk):
    drafter.prompt_chunk = chunk
    drafter.reset()
    logits = drafter._sync(seq).double().clone()
    return logits, [(c.double().clone(), s.double().clone()) for c, s in drafter.live]


def test_mamba2_drafter_prompt_in_chunks_is_a_float64_encode_within_fp32_rounding():
    """Oracle: the same drafter in float64 encoding the prompt in one forward. Chunks of 16 are the model's own
    scan chunk; 5 and 23 cut across it (the scan then restarts mid-chunk from the cached state)."""
    model = tiny_mamba2(vocab=VOCAB)
    target = load_target(tiny_llama(vocab=VOCAB))
    reference = load_drafter(tiny_mamba2(vocab=VOCAB, dtype=torch.float64), target)
    ref_logits, ref_states = encoded(reference, SEQ, None)
    drafter = load_drafter(model, target)
    assert drafter.prompt_chunk == 512  # the default for a Mamba2 drafter on CPU
    for chunk in (5, 16, 23, None):
        logits, states = encoded(drafter, SEQ, chunk)
        bound = 64 * torch.finfo(torch.float32).eps
        assert (logits - ref_logits).abs().max() <= bound * ref_logits.abs().max()
        for (c, s), (c_ref, s_ref) in zip(states, ref_states):
            assert (c - c_ref).abs().max() <= bound * c_ref.abs().max()
            assert (s - s_ref).abs().max() <= bound * s_ref.abs().max()


def test_mamba1_drafter_encodes_a_prompt_in_one_forward():
    """transformers' Mamba1 multi-token path starts from a zero state: chunks would drop the earlier ones."""
    from tests.fixtures.decode import tiny_mamba

    assert load_drafter(tiny_mamba(vocab=VOCAB), load_target(tiny_llama(vocab=VOCAB))).prompt_chunk is None


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_decodes_over_a_chunk_encoded_mamba2_drafter_equal_generate(method):
    model = tiny_llama(vocab=VOCAB, layers=3)
    target = load_target(model)
    drafter = load_drafter(tiny_mamba2(vocab=VOCAB), target)
    drafter.prompt_chunk = 6
    options = {"chain": {"chain_length": 4}, "tree": {"tree": "3,2,1"}}[method]
    for prompt in (SEQ[:3], SEQ[:40], SEQ[:85]):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert build_decoder(method, target, drafter, **options).generate(prompt, max_new_tokens=12).tokens == \
            ref[0, len(prompt):].tolist()
