"""transformers' generate() with draftforge drafters (draftforge/decode/hf_generate.py). Oracle: the target's own
generate() without a drafter, fp32 greedy, token for token; for stop strings, generate(stop_strings=...) itself; for
a streamer, the tokens it returned."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import draftforge
from draftforge.errors import CompatibilityError, RecipeError
from tests.fixtures.decode import eagle3_head, feature_mamba_head, late_eos, noisy_copy, tiny_llama, tiny_mamba2

PROMPTS = [[5, 17, 42, 9], [3, 88, 12, 61, 7, 30, 2]]


def _tokenizer():
    from tests.conftest import _data_tokenizer

    return _data_tokenizer()


VOCAB = len(_tokenizer())  # the drafters' vocabulary: the target's tokenizer's


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


@pytest.fixture(scope="module")
def target(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("target")
    model = tiny_llama(vocab=len(tok), layers=2, hidden=32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def eesd_export(target, tok, tmp_path_factory):
    from draftforge.decode import load_target
    from draftforge.models.eesd import ExitHead, split_target
    from draftforge.models.eesd_export import save_exit_head, target_identity

    parts = split_target(load_target(target).model)
    return str(save_exit_head(ExitHead.from_target(parts, 1), target_identity(parts, 1), tok,
                              tmp_path_factory.mktemp("exit") / "exit", {"task": "eesd", "target": "t"}))


def plain(model, ids, **kw):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw)


def spec(model, ids, **kw):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                          custom_generate=draftforge.speculative_generate, **kw)


DRAFTERS = {
    "mamba2": (lambda t: tiny_mamba2(vocab=VOCAB), [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 2, 1)})]),
    "transformer": (lambda t: noisy_copy(t, noise=0.05), [("chain", {"chain_length": 3}), ("ucb", {})]),
    "prompt-lookup": (lambda t: "prompt-lookup", [("chain", {"chain_length": 3})]),
    "eagle3": (lambda t: eagle3_head(t), [("chain", {"chain_length": 3}), ("eagle2", {})]),
    "feature_mamba2": (lambda t: feature_mamba_head(t), [("tree", {"tree": (3, 2, 1)})]),
}


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_greedy_equals_generate_for_every_drafter_kind(target, kind):
    make, methods = DRAFTERS[kind]
    drafter = make(target)
    for method, options in methods:
        for ids in PROMPTS:
            for eos in (None, plain(target, ids, max_new_tokens=12)[0, len(ids) + 5].item()):
                want = plain(target, ids, max_new_tokens=24, eos_token_id=eos)
                got = spec(target, ids, max_new_tokens=24, eos_token_id=eos, drafter=drafter, method=method,
                           method_options=options)
                assert torch.equal(got, want), (kind, method, ids, eos)


def test_calls_from_several_threads_on_one_model_each_equal_generate(target):
    """A server thread per request on one model: the calls share the model's harness (its KV caches), so they take
    turns; without that they crashed or mixed their caches."""
    import threading

    drafter = tiny_mamba2(vocab=VOCAB)
    prompts = PROMPTS + [[11, 22, 33], [100, 200, 300, 50, 60]]
    want = [plain(target, ids, max_new_tokens=24) for ids in prompts]
    spec(target, prompts[0], max_new_tokens=2, drafter=drafter)  # built once first, as a server would warm up
    got, errors = {}, []

    def call(i):
        try:
            got[i] = spec(target, prompts[i], max_new_tokens=24, drafter=drafter, method_options={"chain_length": 4})
        except Exception as e:  # noqa: BLE001 - a thread's error is reported by the assert below
            errors.append(repr(e))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(got[i], want[i]) for i in range(len(prompts)))


def test_a_damaged_exit_head_is_one_error(target, eesd_export, export_dir, tmp_path):
    import shutil

    from draftforge.decode import load_drafter, load_target
    from draftforge.errors import CheckpointError

    copy = tmp_path / "exit"
    shutil.copytree(eesd_export, copy)
    weights = copy / "exit_head.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # SafetensorError's traceback before
    with pytest.raises(CheckpointError, match=r"exit_head.safetensors cannot be read \(.*\); re-export the eesd run"):
        load_drafter(str(copy), load_target(target))
    meta = copy / "draftforge.json"  # cut short: it said the directory "holds no config.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(CheckpointError, match=r"draftforge.json is corrupt \(.*\); re-export the run"):
        load_drafter(str(copy), load_target(target))
    for kind, drafter in (("exit head", eesd_export), ("drafter", export_dir)):  # json's traceback; or no word,
        cut = tmp_path / f"cut-{kind}"  # the drafter then loaded with no tokenizer and its vocabulary unchecked
        shutil.copytree(drafter, cut)
        (cut / "tokenizer.json").write_text((cut / "tokenizer.json").read_text()[:100])
        with pytest.raises(CheckpointError, match=rf"the {kind}'s tokenizer in .* cannot be read \(.*\); re-export"):
            load_drafter(str(cut), load_target(target))


def test_an_eesd_exit_drafts_for_its_own_target(target, eesd_export):
    # as a directory, and as a Drafter loaded for the model generate() runs (the page's "load_drafter(path, model)":
    # given the model itself it failed, "target 'llama' cannot be split after a decoder layer", or an AttributeError)
    from draftforge.decode import load_drafter

    loaded = load_drafter(eesd_export, target)
    for ids in PROMPTS:
        for drafter in (eesd_export, loaded):
            got = spec(target, ids, max_new_tokens=16, drafter=drafter, method="eesd",
                       method_options={"chain_length": 3})
            assert torch.equal(got, plain(target, ids, max_new_tokens=16))


class Collect:
    """A streamer that keeps what it is given (transformers' BaseStreamer interface)."""

    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_the_streamer_receives_exactly_the_returned_tokens(target):
    stream = Collect()
    ids = PROMPTS[1]
    out = spec(target, ids, max_new_tokens=20, drafter=tiny_mamba2(vocab=VOCAB), stream=stream)
    assert stream.puts[0] == ids and stream.ended  # the prompt first, as generate() streams it
    assert sum(stream.puts[1:], []) == out[0, len(ids):].tolist()


def test_stop_strings_stop_where_generate_stops(target, tok):
    ids = PROMPTS[0]
    free = plain(target, ids, max_new_tokens=30)[0, len(ids):].tolist()
    stop = re.findall(r"[A-Za-z]{4,}", tok.decode(free))[0]  # a word the greedy answer reaches (whole characters)
    want = plain(target, ids, max_new_tokens=30, stop_strings=[stop], tokenizer=tok)
    got = spec(target, ids, max_new_tokens=30, drafter="prompt-lookup", stop=[stop], stop_tokenizer=tok)
    assert want.shape[1] < len(ids) + 30 and torch.equal(got, want)


def test_an_exports_own_custom_generate_directory(target, tok, tmp_path):
    """draftforge export writes custom_generate/generate.py: generate(custom_generate=EXPORT, trust_remote_code=True)
    with the usual argument names (streamer, tokenizer, stop_strings, return_dict_in_generate)."""
    from transformers import TextIteratorStreamer

    from draftforge.export import export_model

    # a path with a backslash escape (\\Users, \\x) made the generated file's docstring a SyntaxError
    export = export_model(tiny_mamba2(vocab=VOCAB), tok, tmp_path / "my\\Users\\xport", metadata={"task": "sft",
                                                                                                 "target": "t"})
    assert (export / "custom_generate" / "generate.py").is_file()
    compile((export / "custom_generate" / "generate.py").read_text(), "generate.py", "exec")
    ids = PROMPTS[1]
    x = torch.tensor([ids])
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = target.generate(x, custom_generate=str(export), trust_remote_code=True, max_new_tokens=20,
                          streamer=streamer, return_dict_in_generate=True, method="tree",
                          method_options={"tree": (2, 2)})
    want = plain(target, ids, max_new_tokens=20)
    assert torch.equal(out.sequences, want)
    assert "".join(streamer) == tok.decode(want[0, len(ids):])
    stop = re.findall(r"[A-Za-z]{4,}", tok.decode(want[0, len(ids):]))[0]
    stopped = target.generate(x, custom_generate=str(export), trust_remote_code=True, max_new_tokens=20,
                              tokenizer=tok, stop_strings=[stop])
    assert torch.equal(stopped, plain(target, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tok))


def test_a_copied_export_never_decodes_with_what_its_first_directory_holds_by_now(target, tok, tmp_path):
    """generate.py names the directory it was written into (transformers runs a cached copy of it, which cannot find
    its own). A copy of export A whose A was re-exported with another drafter decoded with that one, silently: now
    refused in one line naming drafter=, which decodes with the copy; A itself still runs."""
    import shutil

    from draftforge.export import export_model

    first = export_model(tiny_mamba2(vocab=VOCAB), tok, tmp_path / "a", metadata={"task": "sft", "target": "t"})
    copy = Path(shutil.copytree(first, tmp_path / "c"))
    x, want = torch.tensor([PROMPTS[0]]), plain(target, PROMPTS[0], max_new_tokens=8)
    assert torch.equal(target.generate(x, custom_generate=str(copy), trust_remote_code=True, max_new_tokens=8), want)
    export_model(noisy_copy(tiny_mamba2(vocab=VOCAB), noise=0.5), tok, first,
                 metadata={"task": "sft", "target": "t"}, overwrite=True)
    with pytest.raises(CompatibilityError, match=r"written for the export at .*/a .*holds another export by now; "
                                                 r"pass drafter="):
        target.generate(x, custom_generate=str(copy), trust_remote_code=True, max_new_tokens=8)
    got = target.generate(x, custom_generate=str(copy), trust_remote_code=True, max_new_tokens=8, drafter=str(copy))
    assert torch.equal(got, want)
    assert torch.equal(target.generate(x, custom_generate=str(first), trust_remote_code=True, max_new_tokens=8), want)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 2}, "beam search"),
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3 is not supported"),
    ({"min_new_tokens": 3, "eos_token_id": 5}, "min_new_tokens=3 is not supported"),
    ({"penalty_alpha": 0.6}, "penalty_alpha=0.6 is not supported"),  # contrastive search: it decoded greedily
    ({"dola_layers": "high"}, "dola_layers='high' is not supported"),  # DoLa: the same
    ({"do_sample": True, "min_p": 0.1}, "min_p=0.1 is not supported"),  # sampled: generate() adds its warper
    ({"num_return_sequences": 2, "do_sample": True}, "one sequence per prompt"),
])
def test_what_the_harness_cannot_verify_is_refused_in_one_line(target, kwargs, message):
    with pytest.raises(CompatibilityError, match=message):
        target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, custom_generate=draftforge.speculative_generate,
                        drafter="prompt-lookup", **{"do_sample": False, **kwargs})


def test_batches_padding_and_foreign_drafters_are_refused(target):
    gen = draftforge.speculative_generate
    with pytest.raises(CompatibilityError, match=r"batch size 1\); got input_ids of shape \(2, 4\)"):
        target.generate(torch.tensor([PROMPTS[0]] * 2), max_new_tokens=5, custom_generate=gen, drafter="prompt-lookup")
    x = torch.tensor([PROMPTS[0]])
    with pytest.raises(CompatibilityError, match="padding"):
        target.generate(x, attention_mask=torch.tensor([[0, 1, 1, 1]]), max_new_tokens=5, custom_generate=gen,
                        drafter="prompt-lookup")
    with pytest.raises(CompatibilityError, match=f"vocab sizes differ: target .* has {VOCAB}, drafter .* has 48"):
        target.generate(x, max_new_tokens=5, custom_generate=gen, drafter=tiny_mamba2(vocab=48))
    with pytest.raises(CompatibilityError, match="give drafter="):
        target.generate(x, max_new_tokens=5, custom_generate=gen)
    with pytest.raises(CompatibilityError, match="'hf_assisted' is transformers' own generation"):
        target.generate(x, max_new_tokens=5, custom_generate=gen, drafter="prompt-lookup", method="hf_assisted")


@pytest.mark.parametrize("make", ["mamba2", "bamba"])
def test_ssm_and_hybrid_targets(make):
    """A Mamba2 or Bamba target: the tree-scan harness inside transformers' generate(), greedy identical."""
    from tests.fixtures.hybrid import tiny_bamba, tiny_mamba2_target

    model = (tiny_bamba if make == "bamba" else tiny_mamba2_target)(vocab=48)
    for ids in ([5, 17, 42, 9], [3, 8, 12, 31, 7]):
        got = spec(model, ids, max_new_tokens=16, drafter=tiny_mamba2(vocab=48), method="tree",
                   method_options={"tree": (2, 2, 1)})
        assert torch.equal(got, plain(model, ids, max_new_tokens=16)), (make, ids)


def test_sampling_settings_reach_the_harness(target):
    """do_sample with temperature / top_k / top_p and a seed: the harness's own sampled decode with those settings
    (whose exactness tests/decode/test_sampling.py checks against enumerated distributions), token for token."""
    from draftforge.decode import build_decoder, load_drafter, load_target

    drafter = tiny_mamba2(vocab=VOCAB)
    x = torch.tensor([PROMPTS[0]])
    got = target.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                          max_new_tokens=16, custom_generate=draftforge.speculative_generate, drafter=drafter,
                          method="chain", seed=3)
    t = load_target(target)
    dec = build_decoder("chain", t, load_drafter(drafter, t))
    want = dec.generate(PROMPTS[0], max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=3, eos_token_id=[])
    assert got[0, len(PROMPTS[0]):].tolist() == want.tokens


# --- generate()'s own settings on both paths (the callable, an export's directory): oracle generate() itself -------

@pytest.fixture(scope="module")
def export_dir(tok, tmp_path_factory):
    from draftforge.export import export_model

    out = tmp_path_factory.mktemp("export") / "export"
    return str(export_model(tiny_mamba2(vocab=VOCAB), tok, out, metadata={"task": "sft", "target": "t"}))


def from_export(model, ids, export_dir, **kw):
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), custom_generate=export_dir, trust_remote_code=True,
                          **kw)


def test_no_length_given_means_20_new_tokens_as_generate(target, export_dir):
    """generate() adds 20 to the prompt when no length is given (a long prompt too); both paths must agree."""
    long_prompt = [int(t) for t in torch.randint(3, VOCAB, (25,), generator=torch.Generator().manual_seed(1))]
    for ids in (PROMPTS[1], long_prompt):
        want = plain(target, ids)
        assert want.shape[1] == len(ids) + 20
        assert torch.equal(from_export(target, ids, export_dir), want)
        assert torch.equal(spec(target, ids, drafter="prompt-lookup"), want)


def test_a_generation_config_given_keeps_the_models_eos(export_dir):
    """generate(generation_config=GenerationConfig(max_new_tokens=12)) still stops at the model's own EOS."""
    from transformers import GenerationConfig

    model = tiny_llama(vocab=VOCAB, layers=2, hidden=32)
    ids = PROMPTS[0]
    free = plain(model, ids, max_new_tokens=12)[0, len(ids):].tolist()
    model.generation_config.eos_token_id = late_eos(free)
    want = model.generate(torch.tensor([ids]), generation_config=GenerationConfig(max_new_tokens=12))
    assert want.shape[1] < len(ids) + 12 and want[0, -1].item() == model.generation_config.eos_token_id
    assert torch.equal(from_export(model, ids, export_dir, generation_config=GenerationConfig(max_new_tokens=12)),
                       want)


def test_sampling_defaults_are_generates(target, export_dir):
    """do_sample=True without top_k samples with transformers' default top_k (50) on both paths, not the full
    vocabulary; the harness's own decode with top_k=50 is the oracle (its exactness: tests/decode/test_sampling.py)."""
    from draftforge.decode import build_decoder, load_drafter, load_target

    t = load_target(target)
    want = build_decoder("chain", t, load_drafter(export_dir, t)).generate(
        PROMPTS[0], max_new_tokens=12, temperature=0.8, top_k=50, top_p=1.0, seed=5, eos_token_id=[]).tokens
    got = from_export(target, PROMPTS[0], export_dir, do_sample=True, temperature=0.8, max_new_tokens=12, seed=5,
                      method="chain")
    assert got[0, len(PROMPTS[0]):].tolist() == want


def test_top_p_zero_is_greedy_and_temperature_zero_is_refused(target, export_dir):
    """generate() with top_p=0 keeps only the most likely token (greedy, short of an exact tie); do_sample with
    temperature 0 is an error there."""
    want = plain(target, PROMPTS[1], max_new_tokens=12)
    got = target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=12, do_sample=True, top_p=0.0,
                          custom_generate=draftforge.speculative_generate, drafter="prompt-lookup")
    assert torch.equal(got, want)
    with pytest.raises(CompatibilityError, match="temperature=0.0 with do_sample=True"):
        from_export(target, PROMPTS[1], export_dir, do_sample=True, temperature=0.0, max_new_tokens=4)


def test_warpers_passed_by_hand_are_refused_not_ignored(target, export_dir):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    for procs in ([TemperatureLogitsWarper(0.3)], [TopKLogitsWarper(3)]):
        with pytest.raises(CompatibilityError, match="passed by hand"):
            target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=True, logits_processor=procs,
                            custom_generate=draftforge.speculative_generate, drafter="prompt-lookup")
        with pytest.raises(CompatibilityError, match="passed by hand"):
            from_export(target, PROMPTS[0], export_dir, max_new_tokens=5, do_sample=True, logits_processor=procs)


def test_top_h_is_refused_on_both_paths(target, export_dir):
    """generate() adds a top-H warper when sampling with top_h set; the directory path sampled without it."""
    with pytest.raises(CompatibilityError, match="top_h=0.5 is not supported"):
        target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=5, do_sample=True, top_h=0.5,
                        custom_generate=draftforge.speculative_generate, drafter="prompt-lookup")
    with pytest.raises(CompatibilityError, match="top_h=0.5 is not supported"):
        from_export(target, PROMPTS[0], export_dir, max_new_tokens=5, do_sample=True, top_h=0.5)


def test_the_export_loaded_with_trust_remote_code_generates_as_itself(export_dir):
    """transformers puts an export's custom_generate in place of the export's own generate() when the export is
    loaded with trust_remote_code=True: generate(ids) then raised (two values for `model`) and generate(input_ids=)
    ran the drafter speculatively against itself. That model is the drafter: it generates as it does loaded
    plainly (the oracle), batch and repetition_penalty too."""
    import shutil

    from transformers import AutoModelForCausalLM

    plain_model = AutoModelForCausalLM.from_pretrained(export_dir)
    x = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    for where in (export_dir, shutil.copytree(export_dir, Path(export_dir).parent / "copied")):
        loaded = AutoModelForCausalLM.from_pretrained(where, trust_remote_code=True)
        assert loaded.generate is not plain_model.generate  # transformers did replace it
        for kw in ({"max_new_tokens": 6}, {"max_new_tokens": 6, "repetition_penalty": 1.3}):
            want = plain_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw)
            assert torch.equal(loaded.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw), want)
            assert torch.equal(loaded.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                               **kw), want)


class StopAfter:
    """A user's stopping criterion: stop once the sequence is `n` tokens long."""

    def __init__(self, n):
        self.n = n

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)


def test_stopping_criteria_and_max_time_stop_where_generate_stops(target, export_dir):
    from transformers import StoppingCriteriaList

    ids = PROMPTS[1]
    crit = StoppingCriteriaList([StopAfter(len(ids) + 3)])
    want = plain(target, ids, max_new_tokens=20, stopping_criteria=crit)
    assert want.shape[1] == len(ids) + 3
    assert torch.equal(spec(target, ids, max_new_tokens=20, drafter="prompt-lookup", stopping_criteria=crit), want)
    assert torch.equal(from_export(target, ids, export_dir, max_new_tokens=20, stopping_criteria=crit), want)
    # max_time=0: generate() emits one token, then its time is up
    want = plain(target, ids, max_new_tokens=20, max_time=0.0)
    assert want.shape[1] == len(ids) + 1
    assert torch.equal(spec(target, ids, max_new_tokens=20, drafter="prompt-lookup", max_time=0.0), want)
    assert torch.equal(from_export(target, ids, export_dir, max_new_tokens=20, max_time=0.0), want)


def test_the_harness_dies_with_its_model():
    """The decoder cached for a model must not keep the model (and its KV caches) alive once the user drops it."""
    import gc
    import weakref

    model = tiny_llama(vocab=VOCAB, layers=1, hidden=32)
    spec(model, PROMPTS[0], max_new_tokens=4, drafter="prompt-lookup")
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_the_streamer_ends_on_an_error_and_a_too_long_prompt_says_so(target, monkeypatch):
    from draftforge.decode import hf_generate

    stream = Collect()
    with pytest.raises(CompatibilityError, match="the prompt has 256 tokens and the target's context is 256"):
        spec(target, [5] * 256, max_new_tokens=4, drafter="prompt-lookup", stream=stream)
    assert stream.puts == []  # refused before anything was streamed

    real = hf_generate._decoder(target, "prompt-lookup", "chain", {}, None)

    class Broken:
        target = real.target

        def generate(self, *args, **kwargs):
            raise RuntimeError("out of memory")

    monkeypatch.setattr(hf_generate, "_decoder", lambda *args: Broken())
    stream = Collect()
    with pytest.raises(RuntimeError, match="out of memory"):
        spec(target, PROMPTS[0], max_new_tokens=4, drafter="prompt-lookup", stream=stream)
    assert stream.puts == [PROMPTS[0]] and stream.ended  # a TextIteratorStreamer's reader is released


def test_stopping_at_the_context_warns(target):
    ids = PROMPTS[0]
    with pytest.warns(UserWarning, match="stops at the target's context of 256 tokens, 252 new tokens instead of 300"):
        out = spec(target, ids, max_new_tokens=300, drafter="prompt-lookup")
    assert out.shape[1] == 256 and torch.equal(out, plain(target, ids, max_new_tokens=252))


def test_a_tokenizer_given_later_still_checks_the_drafter(tok, tmp_path):
    """A target loaded in memory (no tokenizer found): a later call that gives one must check the drafter against it,
    even after an earlier call built the harness without one."""
    from draftforge.export import export_model
    from tests.toplevel.test_export import _swap_two_ids

    model = tiny_llama(vocab=VOCAB, layers=1, hidden=32)
    spec(model, PROMPTS[0], max_new_tokens=4, drafter="prompt-lookup")  # the harness, built without a tokenizer
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(_swap_two_ids(tok, tmp_path / "other-tok"))
    foreign = export_model(tiny_mamba2(vocab=VOCAB), other, tmp_path / "foreign", metadata={"task": "sft",
                                                                                            "target": "t"})
    with pytest.raises(CompatibilityError, match=f"tokenizers differ: .*\\({len(tok)} tokens each\\)"):
        spec(model, PROMPTS[0], max_new_tokens=4, drafter=str(foreign), stop=["zz"], stop_tokenizer=tok)


def test_a_model_moved_after_a_first_call_gets_a_new_harness():
    """The harness (its target's caches, the drafters it loaded) is built for the model's device and dtype. After
    model.to(...) a later call builds a new one: on CPU the old one still decodes a cast model correctly, so the
    rebuild is checked as such; a move to CUDA with the old one would leave its caches on the CPU."""
    model = tiny_llama(vocab=VOCAB, layers=2, hidden=32)
    ids = PROMPTS[1]
    want = plain(model, ids, max_new_tokens=12)
    assert torch.equal(spec(model, ids, max_new_tokens=12, drafter="prompt-lookup"), want)
    first = model.__dict__["_draftforge_speculative_cache"]["target"]
    spec(model, ids, max_new_tokens=12, drafter="prompt-lookup")
    assert model.__dict__["_draftforge_speculative_cache"]["target"] is first  # reused while nothing changed
    model.to(torch.bfloat16)
    got = spec(model, ids, max_new_tokens=12, drafter="prompt-lookup")
    assert model.__dict__["_draftforge_speculative_cache"]["target"] is not first
    assert torch.equal(got, plain(model, ids, max_new_tokens=12))


def test_what_generate_itself_ignores_or_takes_from_the_caller_is_what_the_harness_does(target, tok, export_dir):
    """generate() puts a user's MaxLengthCriteria / EosTokenCriteria in place of its own: the harness dropped them
    and ran to max_new_tokens. Settings generate() ignores (min_p, typical_p when greedy; guidance_scale 1;
    suppress_tokens []; min_new_tokens without an eos) were refused. An eos id given as a tensor raised a
    TypeError. Oracle: the target's own generate() with the same arguments."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    ids = PROMPTS[1]
    free = plain(target, ids, max_new_tokens=16)[0, len(ids):].tolist()
    stop_at = free[5]  # an eos the free run meets mid-way
    cases = [
        {"stopping_criteria": StoppingCriteriaList([EosTokenCriteria(eos_token_id=stop_at)])},
        {"stopping_criteria": StoppingCriteriaList([MaxLengthCriteria(max_length=len(ids) + 4)])},
        {"eos_token_id": torch.tensor(stop_at)},
        {"min_p": 0.1}, {"typical_p": 0.5}, {"guidance_scale": 1.0}, {"suppress_tokens": []},
        {"renormalize_logits": True},
        {"min_new_tokens": 3},  # the target has no eos: generate() adds no processor
        {"output_scores": True},  # without return_dict_in_generate nothing is returned for it
    ]
    for kw in cases:
        want = plain(target, ids, max_new_tokens=16, **kw)
        assert torch.equal(spec(target, ids, max_new_tokens=16, drafter="prompt-lookup", **kw), want), kw
        assert torch.equal(from_export(target, ids, export_dir, max_new_tokens=16, do_sample=False, **kw), want), kw
    sampled = target.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=True, min_p=0.0,
                              custom_generate=draftforge.speculative_generate, drafter="prompt-lookup")
    assert sampled.shape[1] == len(ids) + 16  # a min-p of 0 removes nothing: sampling runs
    assert plain(target, ids, max_new_tokens=16, **cases[0]).shape[1] < len(ids) + 16  # the cases stop early
    assert plain(target, ids, max_new_tokens=16, **cases[1]).shape[1] == len(ids) + 4


def test_a_prompt_holding_the_pad_token_is_padding_on_both_paths(target, export_dir):
    """Without an attention_mask generate() reads the pad token in a prompt as padding: the callable path refused
    it, the export's directory path decoded it as text."""
    x = torch.tensor([[12] + PROMPTS[0]])
    with pytest.raises(CompatibilityError, match="padding"):
        target.generate(x, max_new_tokens=5, pad_token_id=12, custom_generate=draftforge.speculative_generate,
                        drafter="prompt-lookup")
    with pytest.raises(CompatibilityError, match="padding"):
        target.generate(x, max_new_tokens=5, pad_token_id=12, custom_generate=export_dir, trust_remote_code=True)
    want = target.generate(x, max_new_tokens=5, pad_token_id=12, eos_token_id=12, do_sample=False)  # pad = eos:
    got = target.generate(x, max_new_tokens=5, pad_token_id=12, eos_token_id=12, do_sample=False,  # not padding
                          custom_generate=export_dir, trust_remote_code=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_cache_passed_in_is_not_read_and_none_comes_out(target, export_dir, name):
    """The harness prefills the whole prompt: a cache of the prompt's first tokens changes nothing, and one holding
    another text's states (which would change generate()'s own output) is not read either; the callable and the
    export's directory form alike (the directory form refused the argument)."""
    from transformers import DynamicCache

    ids, other = PROMPTS[1], [11, 22, 33, 44]
    want = plain(target, ids, max_new_tokens=16)
    for prefix in (ids[:4], other):
        for call in (lambda **kw: spec(target, ids, drafter=noisy_copy(target, noise=0.05), **kw),
                     lambda **kw: from_export(target, ids, export_dir, **kw)):
            cache = DynamicCache(config=target.config)
            with torch.no_grad():
                target(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
            out = call(max_new_tokens=16, return_dict_in_generate=True, **{name: cache})
            assert torch.equal(out.sequences, want), prefix
            assert getattr(out, "past_key_values", None) is None and getattr(out, "cache", None) is None


def test_inputs_embeds_are_refused_and_output_flags_generate_ignores_are_ignored(target, export_dir):
    """inputs_embeds beside input_ids: generate() prefills from the embeddings, the callable decoded from the ids
    and dropped them (another answer, nothing said); alone they were called an "empty prompt". The export's
    directory form refused output_attentions / output_hidden_states, which generate() ignores without
    return_dict_in_generate. Oracle: the target's own generate()."""
    ids = PROMPTS[1]
    embeds = target.get_input_embeddings()(torch.tensor([PROMPTS[0]])).detach()
    assert not torch.equal(plain(target, ids, max_new_tokens=8, inputs_embeds=embeds)[:, -8:],
                           plain(target, ids, max_new_tokens=8)[:, -8:])  # the embeddings do decide generate()'s answer
    for kw in ({"inputs_embeds": embeds},):
        with pytest.raises(CompatibilityError, match=r"unsupported generate\(\) argument\(s\): inputs_embeds"):
            spec(target, ids, max_new_tokens=8, drafter="prompt-lookup", **kw)
    with pytest.raises(CompatibilityError, match="inputs_embeds"):
        target.generate(inputs_embeds=embeds, max_new_tokens=8, custom_generate=draftforge.speculative_generate,
                        drafter="prompt-lookup")
    for flag in ("output_attentions", "output_hidden_states"):
        want = plain(target, ids, max_new_tokens=8, **{flag: True})
        assert torch.equal(from_export(target, ids, export_dir, max_new_tokens=8, do_sample=False, **{flag: True}),
                           want), flag
        assert torch.equal(spec(target, ids, max_new_tokens=8, drafter="prompt-lookup", **{flag: True}), want), flag


def test_c2t_without_a_classifier_names_the_option_generate_takes(target):
    with pytest.raises(RecipeError, match=r"method_options=\{'c2t': PATH\} in generate\(\)"):
        spec(target, PROMPTS[0], max_new_tokens=4, drafter=tiny_mamba2(vocab=VOCAB), method="c2t")
