"""run_eval and `draftforge eval` with a scripted fake decoding API (the real harness is tested end to end
in tests/eval/test_e2e.py). The fakes give deterministic tokens and times, so every figure is hand-checkable."""

import argparse
from dataclasses import replace
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftforge.decode import parse_tree
from draftforge.decode.base import DecodeResult, DecodeStats
from draftforge.errors import CompatibilityError, DataError, RecipeError
from draftforge.eval import command, runner, selfcheck
from draftforge.eval.runner import EvalConfig, SelfCheckError, run_eval

V = 16


class FakeModel(torch.nn.Module):
    def __init__(self, dtype=torch.float32, logits_V=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.logits_V = torch.zeros(V) if logits_V is None else logits_V
        self.config = SimpleNamespace(max_position_embeddings=64, eos_token_id=None)

    @property
    def device(self):
        return self.w.device

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):  # equal logits: a near-tie
        rows = logits_to_keep or input_ids.shape[1]
        return SimpleNamespace(logits=self.logits_V.expand(input_ids.shape[0], rows, V), cache=cache)


class FakeTarget:
    """The Target calls the cost model and the self-check make: every verified row has the same logits."""

    device, tokenizer, max_context, vocab_size = "cpu", None, None, V

    def __init__(self, model, logits_V=None):
        self.model, self.verified_rows = model, []
        self.logits_V = torch.zeros(V) if logits_V is None else logits_V

    def prefill(self, seq):
        pass

    def verify(self, last, tree):
        self.verified_rows.append(1 + len(tree))
        return self.logits_V.expand(1 + len(tree), V)

    def commit(self, path):
        pass


def reference_tokens(ids, n):
    return [(sum(ids) + 7 * i) % V for i in range(n)]


class FakeDecoder:
    """AR: 0.01 s per token. Speculative: K drafts per round, 2 accepted, 0.005 s per token."""

    def __init__(self, method, broken=False, log=None):
        self.method, self.broken, self.calls, self.log = method, broken, 0, log

    def generate(self, input_ids, *, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos_token_id=None,
                 tree_draws="distinct", params=None):
        self.calls += 1
        if self.log is not None:
            self.log.append((self.method, "generate"))
        toks = reference_tokens(input_ids, max_new_tokens)
        if self.broken:
            toks[-1] = (toks[-1] + 1) % V
        n = len(toks)
        if self.method == "ar":
            return DecodeResult(toks, DecodeStats(new_tokens=n, target_forwards=n, total_time_s=0.01 * n,
                                                  verify_time_s=0.01 * n))
        rounds = n // 3
        return DecodeResult(toks, DecodeStats(
            new_tokens=n, target_forwards=rounds, accepted_per_round=[2] * rounds, drafted_per_round=[3] * rounds,
            accept_by_position=[rounds, rounds, 0], proposed_by_position=[rounds] * 3,
            draft_time_s=0.002 * n, verify_time_s=0.002 * n, total_time_s=0.005 * n))


class ResettableFakeDecoder(FakeDecoder):
    """Like SpeculativeDecoder: has reset() for its adaptive (controller) state."""

    resets = 0

    def reset(self):
        self.resets += 1
        self.log.append((self.method, "reset"))


class FakeAPI:
    def __init__(self, dtype=torch.float32, broken=(), hf_ok=False, log=None, assistant=None, logits_V=None):
        self.dtype, self.broken, self.hf_ok, self.logits_V = dtype, set(broken), hf_ok, logits_V
        self.decoders, self.loaded = {}, []
        self.log, self.assistant = log, assistant  # log: every decoder's calls in order; assistant: hf model

    def load_target(self, path, device="cpu", dtype=None, pack_weights="auto", decode_attention="auto",
                    lean_forward="auto"):
        self.loaded.append(path)
        self.target = FakeTarget(FakeModel(self.dtype, self.logits_V), self.logits_V)
        return self.target

    def load_drafter(self, path, target, device="cpu", dtype=None, allow_vocab_mismatch=False, cuda_graphs="auto",
                     pack_weights="auto", decode_attention="auto", lean_forward="auto"):
        return SimpleNamespace(path=path, cuda_graphs=None)  # what a Drafter declares

    def build_decoder(self, method, target, drafter=None, **opts):
        if method == "hf_assisted" and not self.hf_ok:
            raise CompatibilityError("HF assisted generation needs a Transformer drafter")
        assert (drafter is None) == (method == "ar")
        cls = ResettableFakeDecoder if self.log is not None and method != "hf_assisted" else FakeDecoder
        self.decoders[method] = cls(method, broken=method in self.broken, log=self.log)
        if method == "hf_assisted":  # HFAssistedDecoder: no reset(), drafts with its assistant model's policy
            self.decoders[method].drafter = SimpleNamespace(model=self.assistant)
        return self.decoders[method]


@pytest.fixture
def bench(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"input_ids": [i + 1, 2 * i + 3]}) + "\n" for i in range(3)))
    return str(f)


def cfg_for(bench, tmp_path, **kw):
    base = dict(target="t", drafter="d", bench=bench, max_new_tokens=6, out_dir=str(tmp_path / "out"), quiet=True)
    base.update(kw)
    return EvalConfig(**base)


def test_run_eval_reports_all_methods_and_writes_files(bench, tmp_path, monkeypatch):
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    rep = run_eval(cfg_for(bench, tmp_path, temperatures=(0.0, 1.0), repeats=2, command="draftforge eval x"))
    results = {(r["method"], r["temperature"]): r for r in rep["results"]}
    assert set(results) == {(m, t) for m in ("ar", "chain", "tree") for t in (0.0, 1.0)}
    assert len(rep["records"]) == 3 * 2 * 2 * 3  # methods × temperatures × repeats × prompts
    chain = results[("chain", 0.0)]
    assert chain["speedup"] == pytest.approx(2.0)  # 0.01 vs 0.005 s per token
    assert chain["tau"] == pytest.approx(3.0) and chain["tau_no_bonus"] == pytest.approx(2.0)
    assert chain["acceptance_by_position"] == pytest.approx([1.0, 1.0, 0.0])
    assert chain["self_check"]["identical"] == chain["self_check"]["total"] == 3
    assert results[("chain", 1.0)]["self_check"] is None and results[("ar", 0.0)]["speedup"] == pytest.approx(1.0)
    assert rep["skipped"][0]["method"] == "hf_assisted"
    man = rep["manifest"]
    assert man["command"] == "draftforge eval x" and man["repeats"] == 2 and man["dtype"] == "float32"
    assert man["libraries"]["torch"] == torch.__version__.split("+")[0] or man["libraries"]["torch"] == torch.__version__
    assert set(man["tokens_per_s_spread"]["chain@0"]) == {"min", "median", "max"}
    out = tmp_path / "out"
    on_disk = json.loads((out / "report.json").read_text())
    assert len(on_disk["records"]) == len(rep["records"]) and on_disk["records"][0]["stats"]["new_tokens"] == 6
    md = (out / "report.md").read_text()
    assert "| chain | 0 | 3.00 | 2.00 |" in md and "ratio of medians" in md
    assert "prompts identical to AR in this run, every repeat): chain 3/3, tree 3/3." in md
    for png in ("speedup.png", "tau_histogram.png", "acceptance_by_position.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_an_out_under_home_is_checked_and_written_in_one_place(bench, tmp_path, monkeypatch):
    # --out=~/x (a shell leaves it unexpanded): checked at $HOME/x, written to a literal ./~/x, where it replaced a
    # user's own report.md
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    (cwd / "~" / "x").mkdir(parents=True)
    (cwd / "~" / "x" / "report.md").write_text("mine\n")
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    run_eval(cfg_for(bench, tmp_path, out_dir="~/x", methods=("ar", "chain"), plots=False))
    assert (home / "x" / "report.json").is_file() and (home / "x" / "report.md").is_file()
    assert [p.name for p in (cwd / "~" / "x").iterdir()] == ["report.md"]
    assert (cwd / "~" / "x" / "report.md").read_text() == "mine\n"


def test_warmup_runs_are_untimed_and_every_method_sees_the_same_prompts(bench, tmp_path, monkeypatch):
    api = FakeAPI(hf_ok=True)
    monkeypatch.setattr(runner, "decode_api", api)
    rep = run_eval(cfg_for(bench, tmp_path, warmup=2, repeats=3, plots=False))
    for m, dec in api.decoders.items():
        # every repeat re-runs the warm-up prompts, untimed, before its timed pass (was warm-up once: 2 + 3 * 3)
        assert dec.calls == 3 * (2 + 3)  # repeats × (warm-up prompts + prompts)
        mine = [r for r in rep["records"] if r["method"] == m]
        assert [r["prompt_id"] for r in mine] == ["1", "2", "3"] * 3
    assert "hf_assisted" in api.decoders and not rep["skipped"]


ROTATED = [["ar", "chain", "tree"], ["chain", "tree", "ar"], ["tree", "ar", "chain"], ["ar", "chain", "tree"]]


def test_method_order_rotates_across_repeats(bench, tmp_path, monkeypatch):
    log = []
    monkeypatch.setattr(runner, "decode_api", FakeAPI(log=log))
    rep = run_eval(cfg_for(bench, tmp_path, warmup=1, repeats=4, plots=False))
    assert [o["order"] for o in rep["manifest"]["method_order"]] == ROTATED  # repeat r starts at method r mod 3
    assert [(o["temperature"], o["repeat"]) for o in rep["manifest"]["method_order"]] == [(0.0, r) for r in range(4)]
    timed = [(r["repeat"], r["method"]) for r in rep["records"]]
    assert timed == [(i, m) for i, order in enumerate(ROTATED) for m in order for _ in range(3)]
    called = [m for m, what in log if what == "generate"][::4]  # first call of each pass (1 warm-up + 3 timed)
    assert called == [m for order in ROTATED for m in order]
    assert runner.rotated(["a", "b"], 3) == ["b", "a"] and runner.rotated([], 2) == []
    md = (tmp_path / "out" / "report.md").read_text()
    assert "- T=0: repeat 1: ar, chain, tree; repeat 2: chain, tree, ar; repeat 3: tree, ar, chain" in md


def test_every_timed_pass_starts_with_reset_then_warmup(bench, tmp_path, monkeypatch):
    log = []
    api = FakeAPI(log=log, hf_ok=True)  # hf_assisted has no reset(): it must still run
    monkeypatch.setattr(runner, "decode_api", api)
    run_eval(cfg_for(bench, tmp_path, warmup=2, repeats=3, temperatures=(0.0, 1.0), plots=False))
    for m in ("ar", "chain", "tree"):
        assert api.decoders[m].resets == 3 * 2  # repeats × temperatures
        mine = [what for who, what in log if who == m]
        assert mine == (["reset"] + ["generate"] * (2 + 3)) * 6  # reset, 2 warm-up prompts, 3 timed prompts
    assert not hasattr(api.decoders["hf_assisted"], "reset") and api.decoders["hf_assisted"].calls == 6 * (2 + 3)


def test_manifest_records_hf_assisted_policy_threads_and_order(bench, tmp_path, monkeypatch):
    from transformers import GenerationConfig

    assistant = SimpleNamespace(generation_config=GenerationConfig(num_assistant_tokens=7,
                                                                   num_assistant_tokens_schedule="heuristic"))
    monkeypatch.setattr(runner, "decode_api", FakeAPI(hf_ok=True, assistant=assistant))
    caller = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # the runs' thread count is recorded, not the caller's (restored before the manifest is written)
        rep = run_eval(cfg_for(bench, tmp_path, plots=False, threads=1))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(caller)
    man = rep["manifest"]
    hf = man["hf_assisted_policy"]
    assert (hf["num_assistant_tokens"], hf["num_assistant_tokens_schedule"]) == (7, "heuristic")
    assert hf["assistant_confidence_threshold"] == pytest.approx(0.4)  # unset in the config: transformers default
    assert hf["source"]["num_assistant_tokens"] == "generation_config"
    assert hf["source"]["assistant_confidence_threshold"] == "transformers default"
    assert "at_end" not in hf  # the fake never moved it
    assert man["hardware"]["torch_threads"] == 1 and "torch_threads" not in man
    assert "torch threads 1" in (tmp_path / "out" / "report.md").read_text()
    # which attention ran is in the report (kernels are chosen per machine: decode/attention.py)
    assert f"target attention: {man['attention']['target']}." in (tmp_path / "out" / "report.md").read_text()
    assert man["method_order"][0]["order"] == ["ar", "chain", "tree", "hf_assisted"]
    md = (tmp_path / "out" / "report.md").read_text()
    assert "num_assistant_tokens 7 (generation_config), schedule heuristic" in md
    # a "heuristic" schedule moves num_assistant_tokens in the model's generation_config across calls
    api = FakeAPI(hf_ok=True, assistant=assistant)
    build = api.build_decoder

    def build_heuristic(method, target, drafter=None, **opts):
        dec = build(method, target, drafter, **opts)
        if method == "hf_assisted":
            generate = dec.generate

            def moving_generate(*args, **kw):
                assistant.generation_config.num_assistant_tokens += 2
                return generate(*args, **kw)

            dec.generate = moving_generate
        return dec

    api.build_decoder = build_heuristic
    monkeypatch.setattr(runner, "decode_api", api)
    hf = run_eval(cfg_for(bench, tmp_path, plots=False))["manifest"]["hf_assisted_policy"]
    assert hf["num_assistant_tokens"] == 7 and hf["at_end"] == {"num_assistant_tokens": 7 + 2 * (1 + 3)}
    assert "After the run the drafter's generation_config held {'num_assistant_tokens': 15}" in (
        tmp_path / "out" / "report.md").read_text()
    monkeypatch.setattr(runner, "decode_api", FakeAPI())  # hf_assisted skipped: no policy recorded
    assert "hf_assisted_policy" not in run_eval(cfg_for(bench, tmp_path, plots=False))["manifest"]


def test_report_md_links_every_png_and_defines_its_terms(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    rep = run_eval(cfg_for(bench, tmp_path, repeats=2))
    out = tmp_path / "out"
    md = (out / "report.md").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["acceptance_by_position.png", "speedup.png", "tau_histogram.png"]
    for name in pngs:
        assert f"]({name})" in md
    assert sorted(Path(p).name for k, p in rep["files"].items() if k.startswith("plot_")) == pngs
    definitions = md[md.index("## Definitions"):]
    for term in ("**HM %**", "**γ total**", "**accept rate per drafted node**", "**mem MiB +pass (start)**", "**v_d**", "**r_d**",
                 "**draft len**", "**τ (no bonus)**", "**speedup vs AR**"):
        assert term in definitions
    # τ, τ no bonus, tok/s [spread], speedup [spread], v_d, r_d (4 of 6 tokens drafted), HM %, draft length
    assert ("| chain | 0 | 3.00 | 2.00 | 200.0 [200.0–200.0] | 2.00× [2.00–2.00] | 0.67 | 0.67 | 66.7 | 3.00 |"
            in md)


def test_fp32_mismatch_raises_after_writing_the_report(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI(broken={"tree"}))
    with pytest.raises(SelfCheckError, match=r"tree: 0/3 prompts identical"):
        run_eval(cfg_for(bench, tmp_path, plots=False))
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    tree = next(r for r in on_disk["results"] if r["method"] == "tree")
    assert tree["self_check"]["identical"] == 0
    monkeypatch.setattr(runner, "decode_api", FakeAPI(broken={"tree"}))
    run_eval(cfg_for(bench, tmp_path, plots=False, strict_selfcheck=False))  # reported, not raised


def test_bf16_mismatch_is_reported_with_near_ties(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI(dtype=torch.bfloat16, broken={"chain"}))
    rep = run_eval(cfg_for(bench, tmp_path, plots=False))
    sc = next(r for r in rep["results"] if r["method"] == "chain")["self_check"]
    assert (sc["identical"], sc["total"], sc["near_ties"]) == (0, 3, 3)  # fake logits all tie
    assert "0/3 (3 near-tie)" in (tmp_path / "out" / "report.md").read_text()


def test_bf16_mismatch_beyond_the_measured_noise_is_a_defect(bench, tmp_path, monkeypatch):
    """The broken decoder changes the last token; with distinct logits no rounding explains it: a defect fails
    the run in bf16 too (the exit code of `draftforge eval` is then non-zero)."""
    monkeypatch.setattr(runner, "decode_api", FakeAPI(dtype=torch.bfloat16, broken={"chain"},
                                                      logits_V=torch.arange(V, dtype=torch.float32)))
    monkeypatch.setattr(selfcheck, "check_ar", lambda *a: None)  # the fake AR is no model's greedy output
    with pytest.raises(SelfCheckError, match=r"chain: 0/3 prompts identical, 0 near-tie\(s\), 3 defect\(s\)"):
        run_eval(cfg_for(bench, tmp_path, plots=False))
    assert "0/3 (0 near-tie, 3 DEFECT)" in (tmp_path / "out" / "report.md").read_text()


def test_a_defect_in_ar_itself_shows_in_the_table_and_the_error(bench, tmp_path, monkeypatch):
    """AR's own tokens part from the model's plain forward (check_ar's verdict) while every method agrees with AR:
    the rows are 3/3 identical, yet the run holds 3 defects; report.md and the error must both say AR's."""
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    monkeypatch.setattr(selfcheck, "check_ar", lambda *a: {"verdict": "defect", "position": 0})
    with pytest.raises(SelfCheckError, match=r"3/3 prompts identical, 0 near-tie\(s\), 3 defect\(s\) \(prompts \[\]; "
                                             r"AR itself parted from the model's plain forward on \['1', '2', '3'\]"):
        run_eval(cfg_for(bench, tmp_path, plots=False))
    assert "| 3/3, AR: 3 DEFECT |" in (tmp_path / "out" / "report.md").read_text()


def test_cost_model_times_every_planned_row_count_and_predicts_by_hand(bench, tmp_path, monkeypatch):
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    options = {"chain": {"chain_length": 7}, "tree": {"tree": (2, 2)}}
    rep = run_eval(cfg_for(bench, tmp_path, plots=False, method_options=options, cost_repeats=2))
    curve = {int(n) for n in rep["cost_model"]["curve_s"]}
    assert {1, 8, 7} <= curve and set(api.target.verified_rows) == curve  # chain 7 → 8 rows, tree 2,2 → 7 rows
    chain = next(r for r in rep["results"] if r["method"] == "chain" and r["temperature"] == 0)
    c = chain["cost_model"]
    t = {int(n): s for n, s in rep["cost_model"]["curve_s"].items()}
    draft_per_round = 0.002 * 6 / 2  # fake chain: 6 tokens in 2 rounds of 3 drafts each, 0.002 s per token drafting
    assert c["rows_per_round"] == 4 and c["draft_steps_per_round"] == 3
    assert c["predicted_speedup"] == pytest.approx(3.0 * t[1] / (t[4] + draft_per_round))
    assert "| method | T | τ | rows / round |" in (tmp_path / "out" / "report.md").read_text()


def test_the_curve_is_timed_again_after_the_runs_and_ar_pace_is_set_beside_it(bench, tmp_path, monkeypatch):
    """The second timing of t(1) (20% slower here) and AR's own forward (0.01 s a token in the fake AR, 0.5 t(1))
    are reported, so a run whose machine changed pace midway says so."""
    from draftforge.eval import cost

    calls = []

    def curve(target, ids, rows, repeats):
        calls.append(rows)
        return {n: 0.02 * (1.2 if len(calls) > 1 else 1.0) * (1 + 0.1 * (n - 1)) for n in rows}

    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    monkeypatch.setattr(cost, "verify_curve", curve)
    rep = run_eval(cfg_for(bench, tmp_path, plots=False, cost_repeats=2))
    after = rep["cost_model"]["after_runs"]
    assert len(calls) == 2 and calls[1] == [1]  # the chain's 6 rows were on the grid: only t(1) again
    assert after["t1_s"] == pytest.approx(0.024) and after["t1_before_s"] == pytest.approx(0.02)
    assert after["ar_forward_s"] == {"0": pytest.approx(0.01)}
    md = (tmp_path / "out" / "report.md").read_text()
    assert "t(1) re-timed after the runs: 24.0 ms (+20% against before); AR's own forward" in md
    assert "T=0: 10.0 ms (0.50 t(1))" in md


@pytest.mark.parametrize("kw, match", [
    (dict(temperatures=(0.0, -0.5)), "temperature must be >= 0"),
    (dict(method_options={"tree": {"tree": (3, 0, 1)}}), "every width >= 1"),
    (dict(method_options={"chain": {"chain_lenght": 3}}), "did you mean .chain_length."),
    (dict(method_options={"c2t": {"beta": 0.5}}), "which this run does not run"),
    (dict(methods=("ar", "medusa")), "unknown method 'medusa'"),
    (dict(methods=("ar", "chain", "chain")), "--methods names chain twice"),  # ran once, silently
    (dict(drafter=None), "need --drafter"),
    (dict(max_new_tokens=0), "max-new-tokens"),
    (dict(dtype="int8"), "--dtype must be one of"),
    (dict(drafter_dtype="fp8"), "--drafter-dtype must be one of"),
    (dict(threads=0), "--threads must be >= 1"),
    (dict(tree_draws="sorted"), "--tree-draws must be one of distinct, iid"),
    (dict(prefill_chunk=0), "--prefill-chunk must be a whole number of tokens >= 1"),
    # these ran the whole measurement and then lost it: two rows labelled T=0.5 sharing one set of keys, a
    # traceback on a seed past 64 bits, and an AssertionError from torch for cuda on a CPU-only build
    (dict(temperatures=(0.5, 0.5000001)), r"--temperature 0.5 and 0.5000001 are both reported as T=0.5"),
    (dict(seed=2**64), r"--seed must be an integer in \[0, 2\*\*32\)"),
    pytest.param(dict(device="cuda:0"), "--device cuda:0: no CUDA device here",
                 # (the reason must not name the GPU library: the GPU check runs every test whose skip reason does)
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present on this machine")),
])
def test_bad_config_fails_before_loading(bench, tmp_path, monkeypatch, kw, match):
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    with pytest.raises(RecipeError, match=match):
        run_eval(cfg_for(bench, tmp_path, **kw))
    assert api.loaded == []


def test_prompts_sharing_an_id_or_outside_the_vocabulary_are_refused(tmp_path, monkeypatch):
    """Two prompts with one id: the self-check compared the second's output with the first's AR output and failed a
    lossless run; an id past the vocabulary died in the embedding lookup mid-run."""
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"id": "x", "input_ids": [1, 2]}\n{"id": "y", "input_ids": [3]}\n{"id": "x", "input_ids": [4]}\n')
    with pytest.raises(DataError, match=r"prompt id 'x' appears twice \(lines 1 and 3\)"):
        run_eval(cfg_for(str(twice), tmp_path))
    assert api.loaded == []
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps({"input_ids": [1, V + 3]}) + "\n")
    with pytest.raises(DataError, match=f"holds token id {V + 3}, outside the target's vocabulary of {V} ids"):
        run_eval(cfg_for(str(outside), tmp_path))


def test_empty_prompt_file_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        run_eval(cfg_for(str(empty), tmp_path))


def parser():
    return command.configure(argparse.ArgumentParser(prog="draftforge eval"))


def test_command_parses_flags_and_prints_table(bench, tmp_path, monkeypatch, capsys):
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    args = parser().parse_args([
        "--target", "t", "--drafter", "d", "--bench", bench, "--temperature", "0,1", "--temperature", "0.5",
        "--methods", "chain,ucb", "--chain-length", "3", "--ucb-trees", "2,1", "--ucb-trees", "3,1,1",
        "--baseline", "ar", "--max-new-tokens", "6", "--num-prompts", "2", "--out", str(tmp_path / "o"), "--no-plots",
    ])
    cfg = command.config_from_args(args)
    assert cfg.temperatures == (0.0, 1.0, 0.5) and cfg.method_options["chain"] == {"chain_length": 3}
    trees = cfg.method_options["ucb"]["ucb_trees"]
    assert [t.widths for t in trees] == [(2, 1), (3, 1, 1)] and cfg.methods == ("chain", "ucb")
    assert cfg.baselines == ("ar",)
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "| ucb | 0.5 |" in out and "speedup vs AR" in out and str(tmp_path / "o" / "report.json") in out
    assert set(api.decoders) == {"ar", "chain", "ucb"}


def test_command_refuses_an_option_no_running_method_reads(bench):
    args = parser().parse_args(["--target", "t", "--drafter", "d", "--bench", bench, "--methods", "chain",
                                "--tree", "2,2"])
    with pytest.raises(RecipeError, match="--tree given, but no method of this run reads it .read by tree."):
        command.config_from_args(args)
    shared = command.config_from_args(parser().parse_args(["--target", "t", "--drafter", "d", "--bench", bench,
                                                           "--methods", "chain,eesd", "--chain-length", "4"]))
    assert shared.method_options == {"chain": {"chain_length": 4}, "eesd": {"chain_length": 4}}  # one flag, both


def test_the_lookup_method_needs_no_drafter_and_reads_its_own_flags(bench):
    from draftforge.eval.config import validate

    alone = command.config_from_args(parser().parse_args(["--target", "t", "--bench", bench, "--methods", "lookup",
                                                          "--lookup-chain-length", "2"]))
    options = validate(alone).method_options
    assert alone.drafter is None and options["lookup"].lookup_chain_length == 2
    assert options["lookup"].lookup_spec == "prompt-lookup"
    beside = command.config_from_args(parser().parse_args([
        "--target", "t", "--drafter", "d", "--bench", bench, "--methods", "chain,lookup", "--chain-length", "3",
        "--lookup-spec", "prompt-lookup:ngram=2"]))
    assert beside.method_options == {"chain": {"chain_length": 3}, "lookup": {"lookup_spec": "prompt-lookup:ngram=2"}}
    with pytest.raises(RecipeError, match="--lookup-chain-length given, but no method of this run reads it"):
        command.config_from_args(parser().parse_args(["--target", "t", "--drafter", "d", "--bench", bench,
                                                      "--methods", "chain", "--lookup-chain-length", "2"]))


def test_head_window_reaches_the_drafter_loader_only_when_given(bench, tmp_path, monkeypatch):
    seen = []

    class WindowAPI(FakeAPI):
        def load_drafter(self, path, target, **kw):
            seen.append(kw.get("head_window", "absent"))
            return super().load_drafter(path, target, **{k: v for k, v in kw.items() if k != "head_window"})

    monkeypatch.setattr(runner, "decode_api", WindowAPI())
    args = parser().parse_args(["--target", "t", "--drafter", "d", "--bench", bench, "--methods", "chain",
                                "--head-window", "64", "--max-new-tokens", "6", "--out", str(tmp_path / "a")])
    cfg = command.config_from_args(args)
    assert cfg.head_window == 64
    run_eval(replace(cfg, quiet=True, plots=False))
    run_eval(cfg_for(bench, tmp_path, methods=("chain",), plots=False))
    assert seen == [64, "absent"]


def test_command_rejects_bad_tree_and_temperature_text():
    with pytest.raises(RecipeError, match="every tree width must be >= 1"):
        parse_tree("3,-1")
    with pytest.raises(RecipeError, match="comma-separated integers"):
        parse_tree("3,x")
    with pytest.raises(RecipeError, match="expects numbers"):
        command.parse_floats(["0,hot"], "--temperature")


def test_plot_titles_name_the_prompt_set_briefly_and_fit_the_figure(tmp_path):
    """An absolute prompt path made titles wider than the figure (cut at both ends): titles use its short name,
    and the drawn title stays inside the canvas."""
    from draftforge.eval.plots import _figure, _pyplot, bench_name

    assert bench_name("/very/long/absolute/path/to/data/prompts/testbed_heldout.jsonl") == "testbed_heldout"
    assert bench_name("instructions") == "instructions" and len(bench_name("x" * 90)) == 40
    plt = _pyplot()
    fig, ax = _figure(plt, 5.0, "Speedup over AR (same run, same prompts) · testbed_heldout (20 prompts)",
                      "bar: ratio of median tok/s · whisker: min–max over repeats")
    fig.canvas.draw()
    box, canvas = ax.title.get_window_extent(), fig.bbox
    plt.close(fig)
    assert box.x0 >= canvas.x0 and box.x1 <= canvas.x1


def test_a_long_pass_reports_its_progress(bench, tmp_path, monkeypatch, capsys):
    """Every prompt but the last of a pass longer than PROGRESS_EVERY_S gets a progress line (here: every prompt)."""
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    monkeypatch.setattr(runner, "PROGRESS_EVERY_S", 0.0)
    run_eval(cfg_for(bench, tmp_path, quiet=False, methods=("chain",), baselines=("ar",), plots=False))
    err = capsys.readouterr().err
    for method in ("ar", "chain"):
        lines = [ln for ln in err.splitlines() if f"{method} " in ln and "prompts," in ln and " s" in ln
                 and "tok/s" not in ln]
        assert [ln.split(method)[1].split("prompts")[0].strip() for ln in lines] == ["1/3", "2/3"], err


def test_self_check_identity_counts_without_classifying(bench, tmp_path, monkeypatch):
    """--self-check identity: differing bf16 outputs are counted and left unclassified (no forward runs for them:
    a defect that classify would find passes unflagged, and the report says they were not classified); fp32
    still fails on any difference."""
    monkeypatch.setattr(runner, "decode_api", FakeAPI(dtype=torch.bfloat16, broken={"chain"},
                                                      logits_V=torch.arange(V, dtype=torch.float32)))
    monkeypatch.setattr(selfcheck, "classify", lambda *a, **k: pytest.fail("classify ran"))
    monkeypatch.setattr(selfcheck, "check_ar", lambda *a, **k: pytest.fail("check_ar ran"))
    rep = run_eval(cfg_for(bench, tmp_path, plots=False, self_check="identity"))
    sc = next(r for r in rep["results"] if r["method"] == "chain")["self_check"]
    assert (sc["identical"], sc["total"], sc["defects"], sc["near_tie_checked"]) == (0, 3, 0, False)
    assert {d["verdict"] for d in sc["divergences"]} == {"unchecked"}
    assert "0/3 (differences not classified)" in (tmp_path / "out" / "report.md").read_text()
    monkeypatch.setattr(runner, "decode_api", FakeAPI(broken={"tree"}))
    with pytest.raises(SelfCheckError, match=r"tree: 0/3 prompts identical"):
        run_eval(cfg_for(bench, tmp_path / "fp32", plots=False, self_check="identity"))


def test_a_bench_of_several_lengths_gets_a_curve_per_length_bucket(tmp_path, monkeypatch):
    """Prompts of 3, 700 and 900 tokens: two buckets (≤512, ≤1024), each timed on its own first prompt; the chain
    is priced per bucket and report.md shows both curves and the per-length prediction."""
    from draftforge.eval import cost

    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"input_ids": [1 + i % 7] * n}) + "\n" for i, n in enumerate((3, 700, 900))))
    timed = []

    def curve(target, ids, rows, repeats):
        timed.append((len(ids), tuple(rows)))
        slope = 0.1 if len(ids) < 512 else 0.5  # the long bucket's t(N) rises five times faster
        return {n: 0.02 * (1 + slope * (n - 1)) for n in rows}

    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    monkeypatch.setattr(cost, "verify_curve", curve)
    rep = run_eval(cfg_for(str(f), tmp_path, plots=False, cost_repeats=2))
    first = [n for n, rows in timed if len(rows) > 1]
    assert first == [3, 700]  # before the runs: each bucket's first prompt
    c = rep["cost_model"]
    assert sorted(c["curves_by_length_s"]) == [512, 1024] and c["bucket_prompt_tokens"] == {512: 3, 1024: 700}
    chain = next(r for r in rep["results"] if r["method"] == "chain")["cost_model"]
    # fake chain: 2 rounds of 3 drafts per prompt (4 rows); at ≤1024 t(4)/t(1) = 1 + 0.5 * 3
    assert chain["by_length"][1024]["verify_over_t1"] == pytest.approx(2.5)
    assert chain["by_length"][512]["verify_over_t1"] == pytest.approx(1.3)
    assert chain["verify_s_per_round"] == pytest.approx((2 * 0.02 * 1.3 + 4 * 0.02 * 2.5) / 6)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| ≤1024 | 700 | 20.0 |" in md and "| chain | 0 | ≤1024 | 3.00 | 2.50 |" in md


class LongChainDecoder(FakeDecoder):
    """A dynamic chain that drafts past every planned row count: 2 rounds of 20 drafts (21 rows), 5 accepted each,
    12 tokens, 0.024 s drafting."""

    def generate(self, input_ids, *, max_new_tokens, **kw):
        self.calls += 1
        assert max_new_tokens == 12
        return DecodeResult(reference_tokens(input_ids, 12), DecodeStats(
            new_tokens=12, target_forwards=2, accepted_per_round=[5, 5], drafted_per_round=[20, 20],
            accept_by_position=[2] * 5 + [0] * 15, proposed_by_position=[2] * 20, draft_time_s=0.024,
            verify_time_s=0.02, total_time_s=0.06))


class LongChainAPI(FakeAPI):
    def build_decoder(self, method, target, drafter=None, **opts):
        dec = super().build_decoder(method, target, drafter, **opts)
        if method == "chain":
            dec = self.decoders[method] = LongChainDecoder(method)
        return dec


def test_rows_past_the_grid_are_timed_after_the_runs_and_scaled_to_each_buckets_pace(tmp_path, monkeypatch):
    """Prompts of 3, 700 and 900 tokens (buckets ≤512 and ≤1024); the chain verifies 21 rows a round, past the
    grid's 16. Before the runs t(N) = 20 ms (1 + 0.05 (N - 1)) at ≤512 and 30 ms (1 + 0.1 (N - 1)) at ≤1024; after
    them the machine is 1.5x slower, so t(1) and t(21) are timed again on each bucket's first prompt and t(21) is
    scaled by t(1) before / t(1) after: 40 ms at ≤512 and 90 ms at ≤1024, the pace of the curves it joins (unscaled
    60 and 135 ms; not timed at all, t(16)'s 35 and 75 ms)."""
    from draftforge.eval import cost

    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"input_ids": [1 + i % 7] * n}) + "\n" for i, n in enumerate((3, 700, 900))))
    api, timed = LongChainAPI(), []

    def curve(target, ids, rows, repeats):
        after = api.decoders["ar"].calls > 0  # the runs have started: the machine is 1.5x slower
        timed.append((len(ids), list(rows), after))
        t1, slope = (0.020, 0.05) if len(ids) < 512 else (0.030, 0.1)
        return {n: (1.5 if after else 1.0) * t1 * (1 + slope * (n - 1)) for n in rows}

    monkeypatch.setattr(runner, "decode_api", api)
    monkeypatch.setattr(cost, "verify_curve", curve)
    rep = run_eval(cfg_for(str(f), tmp_path, methods=("chain",), baselines=("ar",), max_new_tokens=12, plots=False,
                           cost_repeats=3))
    assert [(n, after) for n, _, after in timed] == [(3, False), (700, False), (3, True), (700, True)]
    assert 21 not in timed[0][1] and 16 in timed[0][1] and [rows for _, rows, _ in timed[2:]] == [[1, 21], [1, 21]]
    c = rep["cost_model"]
    assert c["curves_by_length_s"][512][21] == pytest.approx(0.040) and c["curve_s"][21] == pytest.approx(0.040)
    assert c["curves_by_length_s"][1024][21] == pytest.approx(0.090)
    assert c["after_runs"]["t1_s"] == pytest.approx(0.030) and c["after_runs"]["t1_before_s"] == pytest.approx(0.020)
    chain = next(r for r in rep["results"] if r["method"] == "chain")["cost_model"]
    # per bucket: τ 12 / 2, every round 21 rows, 0.024 s of drafting over 2 rounds a prompt
    assert chain["by_length"][512]["predicted_speedup"] == pytest.approx(6 * 0.020 / (0.040 + 0.012))
    assert chain["by_length"][1024]["predicted_speedup"] == pytest.approx(6 * 0.030 / (0.090 + 0.012))
    # overall: 2 rounds at ≤512 and 4 at ≤1024; AR's t(1) is the 12 + 24 tokens' average of 20 and 30 ms
    verify, t1 = (2 * 0.040 + 4 * 0.090) / 6, (12 * 0.020 + 24 * 0.030) / 36
    assert chain["verify_s_per_round"] == pytest.approx(verify)
    assert chain["predicted_speedup"] == pytest.approx(6 * t1 / (verify + 0.072 / 6)) == pytest.approx(1.875)
