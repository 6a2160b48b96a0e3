"""`draftforge demo`: the embedded default, end to end on one CPU.

1. testbed: BPE tokenizer + corpus from the Python stdlib on this machine (cached);
2. target: a tiny Llama pre-trained on that corpus with the `pretrain` task (cached);
3. drafter: a tiny Mamba2 pre-trained on the same corpus (`pretrain`), then SFT'd (`sft`) on the
   target's own greedy and sampled continuations of training-split snippets (sequence-level
   distillation), stored as the exact token ids the target read and emitted (`format: tokens`);
4. export, then `draftforge eval` of the drafter against the target on held-out prompts:
   autoregressive vs chain vs tree, with the speedup table.
The recipes are recipes/tiny/*.yaml, read from the source tree (see RECIPES).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import time
from pathlib import Path

from draftforge.runtime import choose_threads, resolve_dtype

TESTBED_CACHE = "~/.cache/draftforge/testbed"  # --testbed's default: where the testbed is built and cached
OUT = "runs/demo"
TESTBED = f"{OUT}/testbed"  # what the tiny recipes name: the demo links it to the testbed it used (quick or full)
# The demo runs recipes/tiny/*.yaml, read from the source tree beside this package (a checkout or an
# editable install; recipes/ is not package data), with their testbed and output paths re-rooted.
RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "tiny"
EVAL_REPEATS = 3  # timed passes over the prompts; the table shows their spread


def tiny_recipe(name: str, testbed: str = TESTBED, out: str = OUT) -> dict:
    """recipes/tiny/NAME.yaml as a dict, with TESTBED and OUT path prefixes replaced by `testbed` and `out`."""
    import yaml

    from draftforge.errors import DraftforgeError

    path = RECIPES / f"{name}.yaml"
    if not path.is_file():
        raise DraftforgeError(f"the demo reads its recipes from {RECIPES}, which this installation lacks; "
                              "run it from a source checkout (pip install -e .)")
    return _reroot(yaml.safe_load(path.read_text()), {TESTBED: str(testbed), OUT: str(out)})


def link_testbed(out: Path, testbed: Path, say) -> None:
    """OUT/testbed -> the testbed this demo uses, so that the tiny recipes and the README's next commands find
    its target and corpus after a quick demo as after a full one. Only a link the demo made is replaced."""
    from draftforge.testbed import TESTBED_MARKER

    link = out / "testbed"
    if link.is_symlink() and any((link / name).is_file() for name in (TESTBED_MARKER, "corpus_settings.json")):
        # a link to a testbed (the marker, or the corpus record of one built before it): the demo's own
        link.unlink()
    elif link.is_symlink() or link.exists():
        say(f"note: {link} exists and is not the demo's link; the tiny recipes' paths will not follow this testbed")
        return
    try:
        link.symlink_to(Path(testbed).expanduser().resolve(), target_is_directory=True)
    except OSError as e:  # a filesystem without symlinks: the demo itself needs none
        say(f"note: could not link {link} to {testbed} ({e}); the tiny recipes name {link}")


def _reroot(value, roots: dict[str, str]):
    if isinstance(value, dict):
        return {k: _reroot(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [_reroot(v, roots) for v in value]
    if isinstance(value, str):
        for old, new in roots.items():
            if value == old or value.startswith(old + "/"):
                return new + value[len(old):]
    return value


# --quick: a smoke run of the whole pipeline in about a minute (the numbers mean little).
QUICK = ["train.max_steps=8", "train.block_size=64", "train.global_batch_size=8", "train.micro_batch_size=8",
         "train.eval_every=0", "train.save_every=0"]


def _train(values: dict, label: str, say, quick: bool, resume: bool = False) -> dict:
    """One drafter run; with `resume`, a run the demo started in --out continues from its last checkpoint (a
    finished one only exports again), else it is replaced."""
    from draftforge.errors import CheckpointError
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run as run_training

    say(f"\n== {label}")
    recipe = recipe_from_dict(values, QUICK if quick else ())
    if resume and (Path(recipe.output_dir) / "recipe.yaml").is_file():
        say(f"--resume: continuing the run in {recipe.output_dir}")
        try:
            result = run_training(recipe, resume=True)
        except CheckpointError as e:
            raise CheckpointError(f"the demo in {Path(recipe.output_dir).parent} cannot be resumed ({e}); where the "
                                  "flags differ from the ones it was started with (--quick, --testbed), give those, "
                                  "or run the demo without --resume to start it again") from None
    else:
        result = run_training(recipe, overwrite=True)
    return {"final_loss": result.final_loss, "eval_loss": result.eval_loss, "tokens_per_s": result.tokens_per_s,
            "export": str(result.export_dir)}


def ensure_target(testbed: Path, quick: bool, say) -> dict | None:
    """Pre-train the tiny target once; later runs reuse the export at TESTBED/target."""
    target = testbed / "target"
    if (target / "draftforge.json").is_file():
        say(f"== target: reusing {target}")
        return None
    if target.is_symlink() or target.exists():  # not an export of ours (it has no record): not ours to replace
        from draftforge.errors import DraftforgeError

        raise DraftforgeError(f"{target} is there but holds no draftforge.json, so it is no target the demo "
                              "exported; move it away (the demo then trains the target again) or give another "
                              "--testbed")
    stats = _train(tiny_recipe("target", testbed), "target: pre-training a tiny Llama on the stdlib corpus", say,
                   quick)
    tmp = testbed / ".target.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(stats["export"], tmp)
    tmp.replace(target)
    return stats


def distill_row(prompt_ids: list[int], new_ids: list[int], eos_id: int) -> dict:
    """A format=tokens row: the ids the target read and the ids it emitted, loss on the emitted ones only.

    A continuation cut by max_new_tokens gets one EOS appended outside the loss, so that in a
    packed block the next snippet starts after an EOS, as documents do in pre-training.
    """
    if eos_id in new_ids:
        new_ids = new_ids[: new_ids.index(eos_id) + 1]
    mask = [0] * len(prompt_ids) + [1] * len(new_ids)
    if not new_ids or new_ids[-1] != eos_id:
        new_ids, mask = new_ids + [eos_id], mask + [0]
    return {"input_ids": prompt_ids + new_ids, "loss_mask": mask}


def write_distill_data(testbed: Path, out: Path, n_prompts: int, max_new_tokens: int, say, resume: bool = False
                       ) -> Path:
    """Token rows of training-split snippets and the target's greedy and sampled continuations of them.

    Rows carry ids, not text: the target's output re-tokenized from text is often other ids
    (BPE merges "\n" + "    " into one token, and every prompt ends in indentation), which would
    teach the drafter sequences the target never emits. Prompts are encoded exactly as
    `draftforge eval` encodes a plain-text prompt (tokenizer(text)), so contexts match.
    """
    import torch
    from transformers import AutoTokenizer

    from draftforge.data.provenance import rows_record, write_sidecar
    from draftforge.fsutil import atomic_write_text
    from draftforge.loading import load_causal_lm
    from draftforge.testbed import prompt_candidates

    tok = AutoTokenizer.from_pretrained(testbed / "tokenizer")
    model = load_causal_lm(testbed / "target", what="target", dtype=resolve_dtype("auto").torch_dtype).eval()
    path = out / "sft_distill.jsonl"
    record = {**rows_record(tok, model, testbed / "target", "draftforge demo"),
              "demo": {"prompts": n_prompts, "max_new_tokens": max_new_tokens}}
    if resume and path.is_file() and _kept_rows(path, record):
        say(f"\n== distillation data: --resume keeps {path} (the same target and settings)")
        return path
    prompts = []
    with open(testbed / "corpus_train.jsonl") as f:
        for line in f:
            prompts.extend(prompt_candidates(json.loads(line)["text"])[:2])
            if len(prompts) >= n_prompts:
                break
    say(f"\n== distillation data: the target continues {len(prompts)} training-split snippets "
        "(greedy and sampled at T=1)")
    tok.padding_side = "left"
    torch.manual_seed(0)
    rows = []
    for i in range(0, len(prompts), 32):
        chunk = [tok(p)["input_ids"] for p in prompts[i:i + 32]]
        batch = tok.pad({"input_ids": chunk}, return_tensors="pt")
        for sample in (False, True):  # greedy teaches the T=0 path, sampled the T>0 one (EESD §3.2 mixes both)
            with torch.no_grad():
                sampling = dict(do_sample=True, temperature=1.0, top_k=0) if sample else dict(do_sample=False)
                gen = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling,
                                     pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            for ids, new in zip(chunk, gen[:, batch["input_ids"].shape[1]:].tolist()):
                if new[0] != tok.eos_token_id:  # an immediate EOS teaches nothing about drafting
                    rows.append(distill_row(ids, new, tok.eos_token_id))
    if not rows:
        from draftforge.errors import DataError

        raise DataError("the target produced no text for any snippet; is the target trained? (rebuild it by "
                        f"deleting {testbed / 'target'})")
    # the sidecar first: rows never exist without the record of the tokenizer that made them. It names the rows'
    # sha256 too, and the rows are renamed into place whole: a run killed between the two writes leaves an older
    # file under the new record, which --resume then does not keep
    text = "".join(json.dumps(r) + "\n" for r in rows)
    write_sidecar(path, {**record, "rows_sha256": hashlib.sha256(text.encode()).hexdigest()})
    atomic_write_text(path, text)
    return path


def _kept_rows(path: Path, record: dict) -> bool:
    """Whether --resume may keep the rows at `path`: their sidecar is `record` (the same target and settings) and
    names these very rows."""
    from draftforge.data.provenance import read_sidecar

    side = dict(read_sidecar(path) or {})
    want = side.pop("rows_sha256", None)
    return side == record and want == hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _phase(seconds: dict[str, float], name: str):
    """Record the wall time of the block as seconds[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = time.perf_counter() - t0


def speedup_spread(report: dict) -> str:
    """Each method's median speedup and its range over the timed passes.

    The range is the report's per-pass speedups when it has them (`speedup_spread`), else the widest
    pairing of passes: the method's slowest over AR's fastest, to its fastest over AR's slowest.
    """
    results = report["results"]
    ar = {r["temperature"]: r["tokens_per_s_spread"] for r in results if r["method"] == "ar"}
    parts = []
    for r in results:
        base, tps = ar.get(r["temperature"]), r["tokens_per_s_spread"]
        if r["method"] == "ar" or not base or r.get("speedup") is None:
            continue
        per_pass = r.get("speedup_spread") or {}
        lo, hi = ((per_pass["min"], per_pass["max"]) if per_pass.get("min") is not None else
                  (tps["min"] / base["max"], tps["max"] / base["min"]))
        parts.append(f"{r['method']} {r['speedup']:.2f}× ({lo:.2f}–{hi:.2f}×)")
    line = f"speedup, median of {report['manifest']['repeats']} timed passes (range): " + ", ".join(parts)
    return line + (f" (warning: {report['pace_warning']})" if report.get("pace_warning") else "")


def eval_size(quick: bool, num_prompts: int | None, max_new_tokens: int | None) -> tuple[int, int]:
    """The eval's prompts and tokens per prompt: what the user gave, else the quick or the full default."""
    return (num_prompts or (3 if quick else 20)), (max_new_tokens or (16 if quick else 64))


def _eval(testbed: Path, paths, drafter: str, out: Path, quick: bool, num_prompts: int | None,
          max_new_tokens: int | None):
    from draftforge.eval.runner import EvalConfig, run_eval

    num_prompts, max_new_tokens = eval_size(quick, num_prompts, max_new_tokens)
    return run_eval(EvalConfig(target=str(testbed / "target"), drafter=drafter, bench=str(paths.prompts),
                               num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                               methods=("ar", "chain", "tree"), temperatures=(0.0,), repeats=EVAL_REPEATS,
                               baselines=("ar",),  # the same table whatever transformers can run as an assistant
                               out_dir=str(out / "eval"), plots=True))  # the PNGs the README lists, quick too


def run_demo(testbed: Path, out: Path, *, quick: bool = False, num_prompts: int | None = None,
             max_new_tokens: int | None = None,
             threads: int | None = None, resume: bool = False, say=print) -> dict:
    import torch

    before = torch.get_num_threads()
    try:
        return _run_demo(testbed, out, quick, num_prompts, max_new_tokens, choose_threads(threads), say, resume)
    finally:
        torch.set_num_threads(before)  # an in-process caller (a test) keeps its own setting


def _run_demo(testbed: Path, out: Path, quick: bool, num_prompts: int | None, max_new_tokens: int | None,
              threads_note: str, say, resume: bool = False) -> dict:
    from draftforge.eval.report import markdown_table
    from draftforge.testbed import ensure_testbed

    t0, seconds = time.perf_counter(), {}
    if quick:  # never let a smoke-run target be reused by a full demo
        testbed = testbed / "quick"
    out.mkdir(parents=True, exist_ok=True)
    link_testbed(out, testbed, say)
    say(f"== testbed in {testbed} (tokenizer, stdlib corpus, held-out prompts); {threads_note}")
    with _phase(seconds, "testbed"):
        paths = ensure_testbed(testbed, max_files=12 if quick else None)
    summary = {"testbed": str(testbed), "threads": threads_note}
    with _phase(seconds, "target"):
        summary["target_training"] = ensure_target(testbed, quick, say)
    with _phase(seconds, "drafter pre-training"):
        summary["drafter_pretrain"] = _train(tiny_recipe("pretrain", testbed, out), "drafter: pre-training a tiny "
                                             "Mamba2", say, quick, resume)
    with _phase(seconds, "distillation data"):
        write_distill_data(testbed, out, 32 if quick else 256, 16 if quick else 64, say, resume)
    with _phase(seconds, "drafter SFT"):
        summary["drafter_sft"] = _train(tiny_recipe("sft", testbed, out), "drafter: SFT on the target's "
                                        "continuations", say, quick, resume)
    say(f"\n== eval: speculative decoding vs plain decoding on held-out prompts, {EVAL_REPEATS} timed passes")
    with _phase(seconds, "eval"):
        report = _eval(testbed, paths, summary["drafter_sft"]["export"], out, quick, num_prompts, max_new_tokens)
    summary["eval"] = {r["method"]: {"speedup": r.get("speedup"), "tau": r.get("tau"),
                                     "tokens_per_s_spread": r.get("tokens_per_s_spread")} for r in report["results"]}
    summary["phase_seconds"], summary["minutes"] = seconds, (time.perf_counter() - t0) / 60
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    say("\n" + markdown_table(report))
    say(f"\n{speedup_spread(report)}\nphase times: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items())
        + f"\n{threads_note}")
    say(f"demo done in {summary['minutes']:.1f} min: drafter export {summary['drafter_sft']['export']}, "
        f"eval report {out / 'eval'}, summary {out / 'summary.json'}")
    return summary


def configure(p: argparse.ArgumentParser) -> None:
    p.description = ("See the whole job on your own machine, offline, in about 15 minutes of CPU: draftforge builds "
                     "a tiny target model from the Python standard library's source, trains a small Mamba drafter "
                     "for it (pre-training, then fine-tuning on the target's own outputs), exports it, and measures "
                     "how much faster speculative decoding with it is than plain decoding, checking that every "
                     "greedy output is the target's own. The testbed is cached, so a second run is quicker.")
    p.epilog = "then: draftforge eval --help (measure your own drafter), draftforge train --help-recipe pretrain"
    p.add_argument("--testbed", default=TESTBED_CACHE, help="where the tokenizer, corpus and tiny target are cached "
                                                      "(default %(default)s)")
    p.add_argument("--out", default=OUT, help="where the drafter runs, exports and eval report go (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="smallest settings (a smoke test, ~1 min; numbers mean little)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted demo in --out (same flags): each "
                   "drafter run continues from its last checkpoint (a finished one is kept), the distillation rows "
                   "are kept when the target and settings match, and the eval runs again; without it a demo "
                   "replaces the one in --out")
    p.add_argument("--num-prompts", type=int, help="held-out prompts in the eval (default 20; with --quick 3)")
    p.add_argument("--max-new-tokens", type=int, help="tokens generated per prompt (default 64; with --quick 16)")
    p.add_argument("--threads", type=int, help="torch threads for every phase (default: 1, or OMP_NUM_THREADS "
                                               "when set; more rarely helps models this small)")


def check_args(args) -> None:
    """Refuse what would fail only after minutes of training: counts below 1, paths that are files."""
    from draftforge.errors import DraftforgeError
    from draftforge.fsutil import output_problem

    for flag, value in (("--threads", args.threads), ("--num-prompts", args.num_prompts),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise DraftforgeError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--testbed", Path(args.testbed).expanduser()), ("--out", Path(args.out))):
        file = next((p for p in (value, *value.parents) if p.exists() and not p.is_dir()), None)
        if file is not None:
            raise DraftforgeError(f"{flag} {value}: {file} is a file, not a directory; give {flag} a directory")
        problem = output_problem(value, "dir")
        if problem:
            raise DraftforgeError(f"{flag} {value}: {problem}; give {flag} a writable directory")
    check_out_files(Path(args.out), resume=args.resume)


def check_out_files(out: Path, resume: bool = False) -> None:
    """What the demo writes into --out must be the demo's own where it exists already (an earlier demo's is
    replaced): refused here, before minutes of training, not at the step that writes it."""
    from draftforge.data.provenance import foreign_sidecar, read_sidecar
    from draftforge.errors import DraftforgeError
    from draftforge.eval.output import check_out
    from draftforge.train.rundir import foreign_entries, is_run_dir

    theirs = []
    rows = out / "sft_distill.jsonl"
    if rows.exists() and (read_sidecar(rows) or {}).get("written_by") != "draftforge demo":
        theirs.append(rows.name)
    elif not rows.exists() and foreign_sidecar(rows, "draftforge demo") is not None:  # written first, over it
        theirs.append(foreign_sidecar(rows, "draftforge demo").name)
    summary = out / "summary.json"
    if summary.exists():
        try:
            ours = "phase_seconds" in json.loads(summary.read_text())
        except (ValueError, UnicodeDecodeError, TypeError):
            ours = False
        if not ours:
            theirs.append(summary.name)
    for recipe in ("pretrain", "sft"):
        run = Path(tiny_recipe(recipe, out=str(out))["output_dir"])
        if run.is_symlink():  # a link to a run elsewhere: not one this demo made here, so not one to replace
            theirs.append(str(run.relative_to(out)) + " (a link)")
        elif run.is_dir() and any(run.iterdir()) and not is_run_dir(run):
            theirs.append(str(run.relative_to(out)) + "/")
        elif is_run_dir(run) and foreign_entries(run) and not (resume and (run / "recipe.yaml").is_file()):
            # the demo's run, replaced, with a user's notes in it: --overwrite refused those only at that step
            theirs += [f"{run.relative_to(out)}/{name}" for name in foreign_entries(run)]
    if theirs:
        raise DraftforgeError(f"--out {out}: {', '.join(theirs)} not written by a draftforge demo; the demo would "
                              "replace them: choose another --out")
    check_out(str(out / "eval"))


def run(args) -> int:
    check_args(args)
    run_demo(Path(args.testbed).expanduser(), Path(args.out), quick=args.quick, num_prompts=args.num_prompts,
             max_new_tokens=args.max_new_tokens, threads=args.threads, resume=args.resume)
    return 0
