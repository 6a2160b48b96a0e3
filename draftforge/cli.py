"""`draftforge` command line: thin wiring; each subcommand lives in the module that does the work.

A subcommand module exposes `configure(parser)` and `run(args) -> int`. Any DraftforgeError is
printed as one line (`error: ...`) with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys

from draftforge import __version__
from draftforge.argcheck import precheck
from draftforge.errors import DraftforgeError
from draftforge.loading import quiet_known_notices

# name -> (module, one-line help)
COMMANDS = {
    "train": ("draftforge.cli_train", "train a drafter from a YAML recipe (pretrain, sft, ...)"),
    "export": ("draftforge.cli_train:export", "export a run's final checkpoint as safetensors + draftforge.json"),
    "eval": ("draftforge.eval.command", "measure a drafter's speedup over plain decoding (JSON/Markdown/PNG report)"),
    "demo": ("draftforge.demo", "try it in ~15 min on a laptop CPU, offline: train a small Mamba drafter for a "
                                "tiny target and show how much faster it decodes"),
    "harvest": ("draftforge.cli_harvest", "harvest training data from a target (+ drafter): trees (EAGLE-2 trees for "
                                         "C2T), theta (χ labels for Cali-TS), logits (top-k distributions for "
                                         "distill), hidden (states at chosen layers for eagle3)"),
    "generate": ("draftforge.cli_generate", "a target's own answers (greedy and sampled) as token rows for SFT, resumable"),
    "target": ("draftforge.cli_target", "prepare a real target offline (smollm2) or its instruction prompts (prompts)"),
    "chat": ("draftforge.cli_chat", "talk to a target through your drafter: answers stream as they are accepted, "
                                    "with tok/s, τ and the speedup over plain decoding after each"),
}
# What Ctrl-C leaves behind differs per command, so each says how to go on; others print "interrupted".
INTERRUPTED = {
    "train": "the last saved checkpoint is kept (one every train.save_every steps); rerun with --resume to "
             "continue from it",
    "eval": "no report was written for this run (eval writes its report only after every run has finished)",
    "generate": "the rows already appended to --out are kept; rerun the same command to continue",
    "harvest": "the finished shards in --out are kept; rerun the same command with --resume to continue",
    "demo": "what the drafter runs in --out saved is kept; rerun the same command with --resume to continue",
}


def _load(spec: str):
    module, _, prefix = spec.partition(":")
    mod = importlib.import_module(module)
    if prefix:
        return getattr(mod, f"configure_{prefix}"), getattr(mod, f"run_{prefix}")
    return mod.configure, mod.run


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftforge",
        description="Train the small models behind speculative decoding and prove what each one is worth.")
    parser.add_argument("--version", action="version", version=f"draftforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (spec, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if only == name:  # import only the module that will run, so the CLI starts fast
            configure, run = _load(spec)
            configure(p)
            p.set_defaults(_run=run)
    return parser


def interrupted_message(command: str | None) -> str:
    what = INTERRUPTED.get(command)
    return f"interrupted: {what}" if what else "interrupted"


# an access the machine refused (read-only mount, permissions, a full disk or quota): the user's to fix, one line
_WRITE_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT}


def _expand_home(args) -> None:
    """A shell expands `--out ~/x` but leaves `--out=~/x` as it is: each command then checked one path and wrote
    another (a literal ./~/x). Every flag value that starts with `~/` (or is `~`) means the home directory."""
    import os

    def expand(value):
        if isinstance(value, str) and (value == "~" or value.startswith("~/")):
            return os.path.expanduser(value)
        if isinstance(value, list):
            return [expand(v) for v in value]
        return value

    for name, value in vars(args).items():
        if not name.startswith("_"):
            setattr(args, name, expand(value))


def _join_negative_values(argv: list[str]) -> list[str]:
    """`--layers -1,2` is `--layers=-1,2`: argparse takes a value that starts with '-' for a flag unless it is one
    plain negative number, so a list starting with one ended in "expected one argument". No draftforge option is a
    dash and a digit, so such a token after a `--flag` can only be that flag's value."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        if (token.startswith("--") and "=" not in token and i + 1 < len(argv)
                and re.fullmatch(r"-\d[\d.,eE+-]*", argv[i + 1])):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = _join_negative_values(sys.argv[1:] if argv is None else list(argv))
    # Before any command can import deepspeed: it logs its CPU-accelerator notice while being imported.
    quiet_known_notices()
    only = next((a for a in argv if a in COMMANDS), None)
    try:  # plain flags checked before the command's module (torch, transformers) is imported
        precheck(only, argv)
    except DraftforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = build_parser(only)
    args = parser.parse_args(argv)
    _expand_home(args)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except DraftforgeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise  # anything else is a defect: its traceback is the evidence
        print(f"error: {e.filename or 'a file'}: {e.strerror} (the machine refused the access: check that path's "
              "permissions, and that its disk is writable and has room)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted_message(args.command), file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
