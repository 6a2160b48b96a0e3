"""The numeric regime: `dtype auto` resolution (capability probe mocked), the bf16 self-check on real tiny
models (a tie made by construction is a near-tie, a wrong verifier is a defect that fails the command), and
bf16 decoding of tiny models: identical to bf16 AR or near-ties, never a defect."""

import json

import pytest
import torch

from draftforge import runtime
from draftforge.decode import build_decoder, load_target
from draftforge.decode.base import DecodeStats
from draftforge.eval import selfcheck
from draftforge.eval.metrics import RunRecord
from draftforge.eval.runner import EvalConfig, run_eval

AVX512 = {"fpu", "avx2", "avx512f", "avx512_vnni", "avx512_bf16"}


@pytest.mark.parametrize("flags, want, native", [
    (AVX512, "bfloat16", True),
    ({"fpu", "amx_bf16", "amx_tile"}, "bfloat16", True),
    ({"fpu", "avx2", "avx512f"}, "float32", False),
    (set(), "float32", False),
])
def test_auto_picks_bf16_only_where_the_cpu_has_it(flags, want, native):
    choice = runtime.resolve_dtype("auto", "cpu", flags=flags)
    assert choice.name == want and not choice.slow
    assert choice.reason.startswith("auto: CPU ") and (("has avx512_bf16" in choice.reason or
                                                       "has amx_bf16" in choice.reason) == native)
    assert runtime.resolve_dtype(None, "cpu", flags=flags).name == want  # None = auto


def test_explicit_dtypes_are_kept_and_emulation_is_said():
    assert runtime.resolve_dtype("float32", "cpu", flags=AVX512).name == "float32"
    slow_bf16 = runtime.resolve_dtype("bfloat16", "cpu", flags={"avx2"})
    assert slow_bf16.name == "bfloat16" and slow_bf16.slow and "emulated: slow" in slow_bf16.reason
    fast_bf16 = runtime.resolve_dtype("bfloat16", "cpu", flags=AVX512)
    assert fast_bf16.name == "bfloat16" and not fast_bf16.slow
    fp16 = runtime.resolve_dtype("float16", "cpu", flags=AVX512)
    assert fp16.name == "float16" and fp16.slow  # no silent fallback: runs as asked, said to be slow
    lines = []
    runtime.announce(fp16, "target", say=lines.append)
    assert len(lines) == 1 and "float16" in lines[0] and "WARNING" in lines[0]


def test_unknown_dtype_is_refused():
    from draftforge.errors import RecipeError

    with pytest.raises(RecipeError, match="--dtype must be one of auto, float32, bfloat16, float16"):
        runtime.resolve_dtype("int8", "cpu")


def test_cpu_flag_probe_reads_proc_cpuinfo():
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this OS: the probe returns an empty set there by design")
    lines = [ln for ln in cpuinfo.read_text().splitlines() if ln.split(":")[0].strip() == "flags"]
    if not lines:
        pytest.skip("this /proc/cpuinfo has no 'flags' line (not x86)")
    want = set(lines[0].split(":", 1)[1].split())
    assert want and runtime.cpu_flags() == want
    native = runtime.cpu_bf16_native()
    assert native == ("avx512_bf16" if "avx512_bf16" in want else "amx_bf16" if "amx_bf16" in want else None)


@pytest.mark.parametrize("flags, want", [(set(), None), ({"avx2", "avx512f"}, None), ({"amx_bf16"}, "amx_bf16"),
                                         ({"avx512_bf16", "amx_bf16"}, "avx512_bf16"),
                                         ({"avx512_bf16"}, "avx512_bf16")])
def test_bf16_native_flags_by_hand(flags, want):
    assert runtime.cpu_bf16_native(flags) == want


# ---- the self-check on a real tiny model ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.fixtures.decode import TIED_PROMPT, save_tied_top2_llama

    path = tmp_path_factory.mktemp("tied") / "target"
    a, b, _ = save_tied_top2_llama(path)  # top-2 tied by construction
    return str(path), list(TIED_PROMPT), [a, b]


def records_at(prompt_id, ar_tokens, other_tokens, drafted=(3,)):
    ar = [RunRecord("ar", 0.0, 0, prompt_id, 6, ar_tokens, DecodeStats())]
    spec = [RunRecord("chain", 0.0, 0, prompt_id, 6, other_tokens, DecodeStats(drafted_per_round=list(drafted)))]
    return spec, ar


def test_a_tie_by_construction_is_a_near_tie_and_a_far_token_a_defect(tiny):
    path, prompt, (a, b) = tiny
    target = load_target(path, dtype=torch.bfloat16)
    one_V = selfcheck.logits_after(target, prompt, 1)
    assert one_V[a] == one_V[b]  # the tie holds in bf16 too
    far = int(one_V.argmin())
    spec, ar = records_at("p", [a], [b])
    sc = selfcheck.self_check(spec, ar, {"p": prompt}, target)
    assert (sc["near_ties"], sc["defects"]) == (1, 0) and sc["divergences"][0]["gap"] == 0.0
    assert sc["divergences"][0]["top2_margin"] == 0.0
    spec, ar = records_at("p", [a], [far])
    sc = selfcheck.self_check(spec, ar, {"p": prompt}, target)
    assert (sc["near_ties"], sc["defects"]) == (0, 1) and sc["divergences"][0]["gap"] > 2 * sc["divergences"][0]["noise"]


def test_a_bf16_target_is_the_model_transformers_loads_in_bf16(tiny):
    """load_target(dtype=bf16) loaded the checkpoint in bf16 and then cast it again with .to(bf16), which also rounded
    RoPE's inv_freq buffer (transformers keeps it float32): an angle error growing with position, so draftforge's
    bf16 target was not the model a user's from_pretrained(dtype=bfloat16) gives, nor vLLM's. At positions past 200
    the last logits must equal transformers' own bf16 model's bitwise."""
    from transformers import AutoModelForCausalLM

    path, prompt, _ = tiny
    target = load_target(path, dtype=torch.bfloat16, pack_weights="off")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert target.model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.tensor([(prompt * 40)[:230]])
    with torch.no_grad():
        mine_V = target.model(input_ids=ids).logits[0, -1]
        want_V = theirs(input_ids=ids).logits[0, -1]
    assert torch.equal(mine_V, want_V)


def test_multi_row_logits_differ_from_one_row_only_by_rounding(tiny):
    """The noise the classifier allows for stays small: a verification of 4 rows gives the 1-row logits to within
    1e-4 in fp32 and 0.25 in bf16 (whether bf16 rows differ at all depends on the kernels: on this tiny model they
    sometimes agree exactly, so only the bound is checked)."""
    path, prompt, _ = tiny
    for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 0.25)):
        target = load_target(path, dtype=dtype)
        one_V = selfcheck.logits_after(target, prompt, 1)
        many_V = selfcheck.logits_after(target, prompt, 4)
        assert float((one_V - many_V).abs().max()) <= bound


@pytest.fixture(scope="module")
def models(random_models):
    return random_models


def test_bf16_decoding_of_tiny_models_has_no_defect(models, tmp_path):
    from benchmarks.decoding import spec_decode

    bench = spec_decode.write_random_prompts(tmp_path / "p.jsonl", 6)
    for drafter in ("transformer_drafter", "mamba_drafter"):
        rep = run_eval(EvalConfig(target=models["target"], drafter=models[drafter], bench=bench, max_new_tokens=24,
                                  methods=("ar", "chain", "tree"), dtype="bfloat16",
                                  method_options={"chain": {"chain_length": 4}, "tree": {"tree": (2, 2, 1)}},
                                  baselines=(), out_dir=str(tmp_path / drafter), quiet=True, plots=False,
                                  cost_repeats=1))
        assert rep["manifest"]["dtype"] == "bfloat16"
        assert rep["manifest"]["dtype_choice"]["drafter"]["dtype"] == "bfloat16"
        assert {r["method"] for r in rep["results"] if r["self_check"] is not None} == {"chain", "tree"}
        for row in rep["results"]:
            sc = row["self_check"]
            if sc is not None:
                assert sc["defects"] == 0 and sc["identical"] + sc["near_ties"] == sc["total"] == 6, sc


def test_a_wrong_verifier_is_a_defect_and_eval_exits_non_zero(models, tmp_path, monkeypatch, capsys):
    """A verifier that accepts every draft changes the output by far more than rounding: exit status 2."""
    from benchmarks.decoding import spec_decode
    from draftforge import cli
    from draftforge.decode import engine
    from draftforge.decode.verify import Verdict

    def accept_all(tree, logits_NV, params, vocab_size, generator):
        path, node = [], -1
        while True:
            kids = tree.children(node)
            if not kids:
                return Verdict(path, int(logits_NV[1 + node].argmax()))
            node = kids[0]
            path.append(node)

    monkeypatch.setattr(engine, "verify", accept_all)
    bench = spec_decode.write_random_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "out"
    code = cli.main(["eval", "--target", models["target"], "--drafter", models["mamba_drafter"], "--bench", bench,
                     "--methods", "ar,chain", "--dtype", "bfloat16", "--max-new-tokens", "16", "--out", str(out),
                     "--no-plots", "--cost-repeats", "1"])
    assert code == 2
    assert "DEFECT" in (out / "report.md").read_text() and "defect(s)" in capsys.readouterr().err
    chain = next(r for r in json.loads((out / "report.json").read_text())["results"] if r["method"] == "chain")
    assert chain["self_check"]["defects"] >= 1


def test_bf16_eesd_decoding_has_no_defect():
    """The early-exit drafter shares the target's first N layers and KV cache; in bf16 its output is AR's or a
    measured near-tie."""
    from draftforge.decode.methods.eesd import EarlyExitDrafter
    from draftforge.models.eesd import ExitHead, split_target
    from tests.fixtures.decode import tiny_llama

    target = load_target(tiny_llama(vocab=64, layers=4, hidden=64, dtype=torch.bfloat16))
    drafter = EarlyExitDrafter(ExitHead.from_target(split_target(target.model), 3, True), 3, target.vocab_size)
    prompts = {str(i): [(7 * i + 3 * j + 2) % 64 for j in range(5 + 3 * i)] for i in range(4)}
    ar, eesd = build_decoder("ar", target), build_decoder("eesd", target, drafter, chain_length=4)
    records = {"ar": [], "eesd": []}
    for name, dec in (("ar", ar), ("eesd", eesd)):
        for pid, ids in prompts.items():
            res = dec.generate(ids, max_new_tokens=24)
            records[name].append(RunRecord(name, 0.0, 0, pid, len(ids), res.tokens, res.stats))
    assert sum(sum(r.stats.accepted_per_round) for r in records["eesd"]) > 0  # the exit really drafts
    sc = selfcheck.self_check(records["eesd"], records["ar"], prompts, target)
    assert sc["defects"] == 0 and sc["identical"] + sc["near_ties"] == sc["total"] == 4, sc


@pytest.mark.parametrize("flags, want", [(AVX512, "bf16"), ({"avx2"}, "fp32")])
def test_train_precision_auto_follows_native_bf16(flags, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.resolve_precision("auto", flags=flags) == want
    assert runtime.resolve_precision("fp32", flags=AVX512) == "fp32"  # an explicit choice is kept


def test_the_self_checks_evidence_runs_no_packed_linear(tiny, monkeypatch):
    # the dtype-side noise ran the harness's oneDNN-packed linears, so a packing bug widened the tolerance that
    # was to catch it (up to the ceiling): the plain forward now multiplies by the plain weights
    from draftforge.decode.packing import PackedLinear

    path, prompt, _ = tiny
    target = load_target(path, dtype=torch.bfloat16)
    if not any(isinstance(m, PackedLinear) and m.packed is not None for m in target.model.modules()):
        pytest.skip("this CPU does not pack bf16 linears")
    clean, harness = selfcheck.reference(target, prompt)["noise"], selfcheck.logits_after(target, prompt, 1)
    real = PackedLinear.forward

    def broken(self, x):  # a packed product that is off by 0.5 everywhere
        out = real(self, x)
        return out + 0.5 if self.packed is not None else out

    monkeypatch.setattr(PackedLinear, "forward", broken)
    assert float((selfcheck.logits_after(target, prompt, 1) - harness).abs().max()) > 0.5  # the harness sees it
    assert selfcheck.reference(target, prompt)["noise"] == clean  # the evidence does not
