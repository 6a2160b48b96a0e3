"""`draftforge chat`: talk to a target through your drafter, and watch it work.

  draftforge chat --target DIR --drafter EXPORT [--method tree --tree 3,2,2,1] [--temperature 0]

Each answer streams as the target accepts it: drafted tokens the target accepted in one colour, the target's own
token that ends each round (its correction, or the bonus after a fully accepted draft) in another (where the
terminal shows colour; NO_COLOR or a pipe turns it off). After each answer: tokens/s, τ (tokens per target
forward) and the speedup against plain decoding of the same conversation, timed in the same session (--no-ar
skips that; the time spent printing is left out of both). An answer stops at the target's EOS tokens (its
generation config's and its tokenizer's). When the conversation outgrows the target's context, the oldest turns
are dropped (the system message stays), and the session says so; a message too long for the context on its own is
refused, the conversation kept as it was. An empty line, /quit or end of input ends the session with a summary.
Ctrl-C during an answer stops it after the round being decoded (the answer so far stays in the conversation) and
the session goes on; Ctrl-C at the prompt, or a second one during an answer, ends the session with its summary.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from draftforge.runtime import add_device_flag, add_dtype_flag, check_device

ACCEPTED, OWN, RESET = "\033[32m", "\033[1m", "\033[0m"  # green: accepted drafts; bold: the target's token
MAX_NEW_TOKENS = 256  # per answer, unless the target's context is under twice that


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n", 1)[1]
    p.add_argument("--target", required=True, help="target model directory (with its tokenizer)")
    p.add_argument("--drafter", required=True, help="drafter export directory, or prompt-lookup")
    p.add_argument("--method", default="chain", help="draftforge method: chain (default), tree, ucb, eesd, ...")
    p.add_argument("--chain-length", type=int, help="drafts per round for chain / eesd (the method's default if unset)")
    p.add_argument("--tree", help="tree shape for --method tree, e.g. 3,2,2,1 or stree13")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens per answer at most (default {MAX_NEW_TOKENS}, or half the target's context if that "
                        "is less); the conversation keeps room for this many in the target's context, dropping its "
                        "oldest turns, so it must be less than that context (refused before the first question if not)")
    p.add_argument("--no-ar", action="store_true", help="do not time plain decoding after each answer")
    p.add_argument("--system", help="a system message for the chat template")
    add_dtype_flag(p)
    add_device_flag(p)
    p.add_argument("--threads", type=int, help="torch threads (default 1, or OMP_NUM_THREADS)")


def _options(args) -> dict:
    from draftforge.decode import parse_tree

    out = {}
    if args.chain_length is not None:
        out["chain_length"] = args.chain_length
    if args.tree is not None:
        out["tree"] = parse_tree(args.tree)
    return out


def check_args(args) -> dict:
    """What would fail only after the models load (seconds for a small target, minutes for a large one), refused
    first in one line: the method, its options, the numbers, a local --target / --drafter that does not exist.
    Returns the method's options."""
    from draftforge.decode.loading import check_local_models
    from draftforge.decode.methods import OPTIONS, get_method, readers, resolve_options
    from draftforge.errors import RecipeError

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:  # NaN too
        raise RecipeError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.threads is not None and args.threads < 1:
        raise RecipeError(f"--threads must be >= 1, got {args.threads}")
    method = get_method(args.method)  # an unknown name, with the names there are
    # dynamic trees (eagle2, c2t) choose children by top-k: the decode refuses them at T > 0, after the models load
    # and the first question (decode/dynamic.py); every dynamic-tree builder there is is greedy-only
    if args.temperature > 0 and method.dynamic_trees:
        raise RecipeError(f"--method {args.method} chooses its tree's children deterministically, which speculative "
                          "sampling cannot verify losslessly; use it at --temperature 0, or sample with chain, tree "
                          "or ucb")
    if args.method.startswith("hf_"):
        raise RecipeError(f"--method {args.method} is transformers' own generation, which cannot stream its rounds; "
                          "chat runs draftforge's methods (chain, tree, ucb, eagle2, c2t, eesd, ...)")
    options = _options(args)
    for name in options:
        if args.method not in readers(name):
            raise RecipeError(f"{OPTIONS[name].flag} does not apply to --method {args.method} (it is read by "
                              f"{', '.join(readers(name))})")
    resolve_options(args.method, options)  # each value checked
    check_device(args.device)
    check_local_models(args.target, args.drafter)
    return options


def answer_room(max_new_tokens: int | None, context: int | None) -> int:
    """Tokens per answer at most: --max-new-tokens, or (unset) MAX_NEW_TOKENS or half the target's context if that
    is less. One as long as the context leaves no room for the question (every turn would drop the whole
    conversation before it) is refused once the target is loaded (its context is known then), before any question."""
    from draftforge.errors import RecipeError

    if max_new_tokens is None:
        return MAX_NEW_TOKENS if context is None else max(1, min(MAX_NEW_TOKENS, context // 2))
    if context is not None and max_new_tokens >= context:
        raise RecipeError(f"--max-new-tokens {max_new_tokens} leaves no room for the conversation in the target's "
                          f"context of {context} tokens; give fewer, e.g. --max-new-tokens "
                          f"{max(1, min(MAX_NEW_TOKENS, context // 2))}")
    return max_new_tokens


def _encode(tokenizer, messages: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
        return [int(t) for t in ids]
    return tokenizer.encode("\n".join(m["content"] for m in messages) + "\n")


class Printer:
    """Prints an answer as it grows, exactly the tokenizer's decode of the whole answer: only whole characters (a
    byte-level token may end mid-character), each new token decoded after the ones before it (decoded on its own,
    a sentencepiece token loses its leading space, a WordPiece one the space that joins it). It decodes the current
    line with the last few tokens before it, not the whole answer, so each token costs about the same (a decode of
    the whole answer per token grows with its square); `seconds` is the time spent here."""

    CONTEXT = 4  # tokens before the current line decoded with it: a decoder's rules look one token back

    def __init__(self, tokenizer, color: bool, out=None):
        self.tokenizer, self.color, self.out = tokenizer, color, out if out is not None else sys.stdout
        self.tokens, self.seconds, self.done = [], 0.0, False  # the answer's tokens
        self.start, self.shown = 0, 0  # decode from tokens[start]; characters of that text printed (or context)

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens[self.start:], skip_special_tokens=True)

    def add(self, tokens: list[int], own_last: bool) -> None:
        start = time.perf_counter()
        for i, tok in enumerate(tokens):
            self.tokens.append(tok)
            text = self._text()
            if text.endswith("\ufffd"):
                continue  # wait for the rest of the character
            new, self.shown = text[self.shown:], len(text)
            if text.endswith("\n") and len(self.tokens) - self.CONTEXT > self.start:
                # a line is done: later tokens decode after its last few, which are context, not printed again
                self.start = len(self.tokens) - self.CONTEXT
                self.shown = len(self._text())
            if self.color and new:
                new = f"{OWN if own_last and i == len(tokens) - 1 else ACCEPTED}{new}{RESET}"
            self.out.write(new)
        self.out.flush()
        self.seconds += time.perf_counter() - start

    def finish(self) -> None:
        """The answer ended: print what was held back waiting for a character's last bytes, and end its line."""
        self.done = True  # first: a Ctrl-C while it writes must not have the caller write the tail again
        self.out.write(self._text()[self.shown:] + "\n")
        self.out.flush()


class CtrlC:
    """Ctrl-C during an answer: the first sets `pressed` (the decode stops after its round, the session goes on),
    a second raises KeyboardInterrupt (the session ends). Left alone where SIGINT is not Python's (ignored, as in a
    background job) or off the main thread."""

    def __enter__(self):
        self.pressed = False
        self.previous = signal.getsignal(signal.SIGINT)
        self.installed = (self.previous is signal.default_int_handler
                          and threading.current_thread() is threading.main_thread())
        if self.installed:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, self.previous)


def fit_context(tokenizer, messages: list[dict], context: int | None, room: int) -> tuple[list[int], list[dict]]:
    """(the prompt's ids, the messages it holds) so that the prompt leaves `room` tokens for an answer in the
    target's context: the oldest turns go first, each a user message with what followed it up to the next one (so
    the rest still alternates user / assistant, as strict chat templates demand), a system message stays, the last
    message (the question) always stays. So the prompt may still be too long (the last message alone: the caller
    refuses it) or leave less room (the answer is cut at the context). `messages` itself is left as it is."""
    kept = list(messages)
    first = 1 if kept and kept[0]["role"] == "system" else 0
    ids = _encode(tokenizer, kept)
    while context is not None and len(ids) + room > context and len(kept) - first > 1:
        del kept[first]
        while len(kept) - first > 1 and kept[first]["role"] != "user":
            del kept[first]
        ids = _encode(tokenizer, kept)
    return ids, kept


def run(args) -> int:
    from draftforge.decode import build_decoder, load_drafter, load_target
    from draftforge.errors import RecipeError
    from draftforge.runtime import announce, choose_threads, resolve_dtype

    options = check_args(args)
    print(f"[draftforge] {choose_threads(args.threads)}", file=sys.stderr)
    dtype = resolve_dtype(args.dtype, args.device)
    announce(dtype, "target and drafter")
    target = load_target(args.target, device=args.device, dtype=dtype.torch_dtype)
    if target.tokenizer is None:
        raise RecipeError(f"--target {args.target} has no tokenizer files; chat needs text")
    args.max_new_tokens = answer_room(args.max_new_tokens, target.max_context)
    drafter = load_drafter(args.drafter, target, device=args.device, dtype=dtype.torch_dtype)
    spec = build_decoder(args.method, target, drafter, **options)
    ar = None if args.no_ar else build_decoder("ar", target)
    totals = {"answers": 0, "tokens": 0, "seconds": 0.0, "ar_seconds": 0.0, "ar_tokens": 0, "forwards": 0}
    print(f"chat: {args.method} with {args.drafter}; an empty line or /quit ends the session", file=sys.stderr)
    session = Session(args, target, spec, ar, totals)
    try:
        session.talk()
        code = 0
    except KeyboardInterrupt:  # at the prompt, or a second Ctrl-C during an answer: the session ends
        if session.printer is not None and not session.printer.done:
            session.printer.finish()  # the answer cut short ends its line
        elif sys.stdin.isatty():
            print()  # the prompt's line
        code = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
    if totals["answers"]:
        rate = totals["tokens"] / totals["seconds"]
        answers = f"{totals['answers']} answer{'s' if totals['answers'] > 1 else ''}"
        summary = (f"chat: {answers}, {totals['tokens']} tokens, {rate:.1f} tok/s, "
                   f"τ {totals['tokens'] / max(totals['forwards'], 1):.2f}")
        if totals["ar_tokens"]:
            summary += f", {rate / (totals['ar_tokens'] / totals['ar_seconds']):.2f}× plain decoding"
        print(summary, file=sys.stderr)
    return code


class Session:
    """The conversation: questions read, answers streamed, numbers added to `totals`. `printer`: the answer being
    printed (its line ended by the caller when a KeyboardInterrupt ends the session mid-answer)."""

    def __init__(self, args, target, spec, ar, totals: dict):
        from draftforge.decode.engine import eos_set

        self.args, self.target, self.spec, self.ar, self.totals = args, target, spec, ar, totals
        self.printer = None
        self.color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        # the generation config's EOS list (end-of-turn tokens live there) and the tokenizer's own
        self.eos = sorted(eos_set(None, target) | ({target.tokenizer.eos_token_id} - {None}))
        self.messages = [{"role": "system", "content": args.system}] if args.system else []

    def talk(self) -> None:
        try:
            from jinja2.exceptions import TemplateError  # what a chat template raises (transformers uses jinja2)
        except ImportError:  # without jinja2 there are no chat templates, and nothing of theirs to catch
            TemplateError = ()  # noqa: N806

        args, target, context = self.args, self.target, self.target.max_context
        if getattr(sys.stdin, "errors", None) == "strict" and hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="surrogateescape")  # a line that is not UTF-8 is refused, not a traceback
        while True:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                return
            if not line.strip() or line.strip() == "/quit":
                return
            try:
                line.encode("utf-8")
            except UnicodeEncodeError:  # bytes that are not UTF-8, read back as lone surrogates
                print("[that line is not UTF-8 text: set your terminal or input to UTF-8 and send it again]",
                      file=sys.stderr)
                continue
            try:
                ids, kept = fit_context(target.tokenizer, self.messages + [{"role": "user", "content": line}],
                                        context, args.max_new_tokens)
            except TemplateError as e:  # a template's own rule (no system role, say): the conversation stays
                print(f"[the target's chat template refused the conversation: {e}]", file=sys.stderr)
                continue
            if context is not None and len(ids) >= context:  # refused: the conversation stays as it was
                print(f"[this message is {len(ids)} tokens with the template, the target's context is {context}: "
                      "send a shorter one]", file=sys.stderr)
                continue
            dropped, self.messages = len(self.messages) + 1 - len(kept), kept
            if dropped:
                print(f"[the conversation outgrew the target's context of {context} tokens: dropped the oldest "
                      f"{dropped} message{'s' if dropped > 1 else ''}]", file=sys.stderr)
            self.answer(ids)

    def answer(self, ids: list[int]) -> None:
        import torch

        args, totals = self.args, self.totals
        context = self.target.max_context
        max_new = args.max_new_tokens if context is None else min(args.max_new_tokens, context - len(ids))
        self.printer = printer = Printer(self.target.tokenizer, self.color)
        seed = int(torch.randint(0, 2**31 - 1, ()))
        with CtrlC() as ctrl_c:
            def on_tokens(emitted: list[int]) -> bool:
                printer.add(emitted, own_last=True)
                return ctrl_c.pressed  # True stops the decode after this round

            res = self.spec.generate(ids, max_new_tokens=max_new, temperature=args.temperature, seed=seed,
                                     eos_token_id=self.eos, on_tokens=on_tokens)
            printer.finish()
            stopped = ctrl_c.pressed
            if stopped:
                print("[answer stopped by Ctrl-C: what it said so far stays in the conversation; Ctrl-C at the "
                      "prompt ends the session]", file=sys.stderr)
            stats = res.stats
            seconds = max(stats.total_time_s - printer.seconds, 1e-9)  # decoding only: plain decoding prints nothing
            tau = stats.new_tokens / max(stats.target_forwards, 1)
            line = f"[{stats.new_tokens} tokens, {stats.new_tokens / seconds:.1f} tok/s, τ {tau:.2f}"
            totals.update(answers=totals["answers"] + 1, tokens=totals["tokens"] + stats.new_tokens,
                          seconds=totals["seconds"] + seconds, forwards=totals["forwards"] + stats.target_forwards)
            self.messages.append({"role": "assistant",
                                  "content": self.target.tokenizer.decode(res.tokens, skip_special_tokens=True)})
            if self.ar is not None and not stopped:  # a Ctrl-C while it runs stops it: its rate so far stands
                base = self.ar.generate(ids, max_new_tokens=max(stats.new_tokens, 1), temperature=args.temperature,
                                        seed=seed, eos_token_id=[],  # the same number of tokens, plainly
                                        on_tokens=lambda emitted: ctrl_c.pressed)
                ar_rate = base.stats.new_tokens / base.stats.total_time_s
                totals.update(ar_seconds=totals["ar_seconds"] + base.stats.total_time_s,
                              ar_tokens=totals["ar_tokens"] + base.stats.new_tokens)
                line += f"; plain decoding {ar_rate:.1f} tok/s: {stats.new_tokens / seconds / ar_rate:.2f}×"
            print(line + "]", file=sys.stderr)
