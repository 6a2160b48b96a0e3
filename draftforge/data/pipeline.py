"""sources -> usable rows -> seeded held-out split -> tokenize (cached map) -> packed blocks.

format=tokens rows skip tokenization (their ids are checked against the vocabulary and cut
to the block) and are packed whole, like conversations.

Tokenization is a fingerprinted `datasets.map` (cached, progress bar, `num_proc` workers);
packing then runs over the whole token stream in memory (int32 arrow columns, ~8 bytes per
token for input_ids + labels). For corpora that do not fit, use `streaming: true`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc

from draftforge.data.chat import closing_token, tokenize_conversation
from draftforge.data.packing import StreamPacker, blocks_table, flatten_lists, pack_greedy, pack_stream
from draftforge.data.sources import check_overlaps, check_token_sources, load_sources
from draftforge.errors import DataError

log = logging.getLogger("draftforge.data")

STREAM_EVAL_BLOCKS = 64
"""When streaming, the eval set is the first this-many blocks of held-out documents."""


@dataclass
class BlockData:
    """Training-ready blocks: columns `input_ids`, `labels` (-100 = no loss), each block_size long."""

    train: Any
    eval: Any | None
    stats: dict = field(default_factory=dict)
    block_size: int = 0


def build_block_data(cfg, tokenizer, block_size: int, seed: int, vocab_size: int | None = None) -> BlockData:
    """Read `cfg.sources`, hold out `cfg.eval_fraction` of documents (chosen by `seed`), pack.

    With `cfg.eval_sources` every document of `cfg.sources` trains and the held-out documents are read from
    those sources instead (same format, same checks).

    vocab_size: ids of format=tokens rows must be below it (default: len(tokenizer)).
    """
    eos_id, pad_id = _special_ids(tokenizer)
    _check_config(cfg, block_size)
    vocab_size = vocab_size or len(tokenizer)
    if cfg.format == "tokens":  # ids of another tokenizer would train silently: refuse before reading a row
        check_token_sources(cfg, tokenizer)
    check_overlaps(cfg)  # a file read twice, or trained on and held out
    docs = load_sources(cfg)
    if cfg.streaming:
        return _build_streaming(docs, cfg, tokenizer, block_size, seed, eos_id, pad_id, vocab_size)
    if cfg.format == "tokens":  # before _usable_rows: its select() would hide the row index behind a mapping
        _check_vocab(docs, vocab_size)
    docs, stats = _usable_rows(docs, cfg)
    eval_read = None  # eval_sources' own rows, counted apart (they are not among rows_read)
    if cfg.eval_sources:
        train_docs, (eval_docs, eval_read) = docs, _eval_source_docs(cfg, tokenizer, vocab_size)
    else:
        train_docs, eval_docs = split_documents(docs, cfg.eval_fraction, seed)
    train, train_stats = _to_blocks(train_docs, cfg, tokenizer, block_size, eos_id, pad_id)
    stats["rows_skipped"] += train_stats.pop("truncated_away")
    refused = train_stats.pop("refused")
    stats["rows_skipped"] += sum(refused.values())
    stats["skip_reasons"] = {**stats.get("skip_reasons", {}), **refused}
    stats.update(train_stats, format=cfg.format, block_size=block_size, eval_documents=0, eval_blocks=0,
                 eval_asked=bool(cfg.eval_fraction > 0 or cfg.eval_sources))
    eval_ds = None
    if eval_docs is not None:
        eval_ds, eval_stats = _to_blocks(eval_docs, cfg, tokenizer, block_size, eos_id, pad_id)
        skipped = eval_stats["truncated_away"] + sum(eval_stats["refused"].values())
        if eval_read is None:  # held out of the rows read
            stats["rows_skipped"] += skipped
        else:
            stats.update(eval_rows_read=eval_read["rows_read"], eval_rows_skipped=eval_read["rows_skipped"] + skipped)
        stats.update(eval_documents=eval_stats["documents"], eval_blocks=eval_stats["blocks"])
        if len(eval_ds) == 0:
            eval_ds = None
    if len(train) == 0:
        raise DataError("no training blocks: every conversation lost its assistant tokens to truncation; "
                        "raise the block size or shorten the conversations")
    return BlockData(train=train, eval=eval_ds, stats=stats, block_size=block_size)


def _eval_source_docs(cfg, tokenizer, vocab_size: int) -> tuple[datasets.Dataset, dict]:
    """The usable rows of `cfg.eval_sources`, read and checked as `cfg.sources` are (max_documents not applied),
    and their counts (rows_read, rows_skipped, skip_reasons)."""
    eval_cfg = dataclasses.replace(cfg, sources=list(cfg.eval_sources), eval_sources=[], max_documents=None)
    if eval_cfg.format == "tokens":
        check_token_sources(eval_cfg, tokenizer)
    docs = load_sources(eval_cfg)
    if eval_cfg.format == "tokens":
        _check_vocab(docs, vocab_size)
    return _usable_rows(docs, eval_cfg)


MOSTLY_PADDING = 0.5  # describe() warns above this padding fraction


def describe(bd: BlockData) -> str:
    """One line for logs: blocks, tokens, loss tokens, padding, documents, skipped rows, eval."""
    s = bd.stats
    if s.get("streaming"):
        return f"data: streaming {s['format']} blocks of {bd.block_size} tokens (eval: held-out {s['eval_fraction']:.1%})"
    line = (f"data: {s['blocks']:,} blocks x {bd.block_size} = {s['tokens']:,} tokens "
            f"({s['loss_tokens']:,} with loss, padding {s['padding_fraction']:.2%}) from {s['documents']:,} "
            f"{'token rows' if s['format'] == 'tokens' else s['format'] + ' documents'}; "
            f"{s['rows_skipped']:,}/{s['rows_read']:,} rows skipped; "
            + (f"{s['rows_unused']:,} rows past data.max_documents not used; " if s.get("rows_unused") else "")
            + (f"{s['rows_cut']:,} rows cut at the block size ({s['loss_tokens_cut']:,} loss tokens lost); "
               if s.get("rows_cut") else "")
            + f"eval: {s['eval_blocks']:,} blocks from {s['eval_documents']:,} documents"
            + (f" ({s['eval_rows_skipped']:,}/{s['eval_rows_read']:,} eval rows skipped)"
               if s.get("eval_rows_skipped") else ""))
    if s.get("eval_asked") and not s["eval_blocks"]:  # trained without eval, nothing said
        line += ("\nwarning: no held-out blocks: the recipe asks for held-out data (data.eval_fraction or "
                 "data.eval_sources) but none came out of it (a single document holds nothing out; held-out rows "
                 "longer than train.block_size lose their loss tokens), so this run is not evaluated")
    if s["padding_fraction"] > MOSTLY_PADDING:  # a block size far above the data's: compute spent on padding
        line += (f"\nwarning: {s['padding_fraction']:.0%} of every training block is padding ({s['tokens']:,} tokens "
                 f"in {s['blocks']:,} blocks of {bd.block_size}); lower train.block_size or add data")
    return line


def split_documents(docs: datasets.Dataset, eval_fraction: float, seed: int):
    """Seeded document-level held-out split; both parts keep the original order."""
    n = len(docs)
    n_eval = min(max(round(n * eval_fraction), 1), n - 1) if eval_fraction > 0 and n >= 2 else 0
    if n_eval == 0:
        return docs, None
    perm = np.random.default_rng(seed).permutation(n)
    return docs.select(np.sort(perm[n_eval:])), docs.select(np.sort(perm[:n_eval]))


def _special_ids(tokenizer) -> tuple[int, int]:
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError("the tokenizer has no eos_token; set one (e.g. tokenizer.eos_token = '</s>') "
                        "so documents can be separated")
    pad_id = tokenizer.pad_token_id
    return eos_id, eos_id if pad_id is None else pad_id


def _check_config(cfg, block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 2:
        raise DataError(f"block_size must be an integer >= 2, got {block_size!r}")
    if not 0 <= cfg.eval_fraction < 1:
        raise DataError(f"data.eval_fraction must be in [0, 1), got {cfg.eval_fraction!r}")
    if cfg.max_documents is not None and cfg.max_documents < 1:
        raise DataError(f"data.max_documents must be >= 1 or null, got {cfg.max_documents!r}")


def _usable_rows(docs: datasets.Dataset, cfg):
    """Drop rows marked bad (warn with counts; fail if none is usable); apply max_documents."""
    if len(docs) == 0:
        raise DataError(f"data sources {cfg.sources} (split {cfg.split!r}) have no rows; check the paths/split")
    bad = docs.data.column("bad")
    reasons = Counter({r["values"]: r["counts"] for r in pc.value_counts(bad).to_pylist() if r["values"]})
    good_idx = np.flatnonzero(pc.equal(bad, "").to_numpy(zero_copy_only=False))
    summary = ", ".join(f"{n} x {r}" for r, n in reasons.most_common())
    if len(good_idx) == 0:
        raise DataError(f"no usable rows in {cfg.sources}: all {len(docs)} rows skipped ({summary}); "
                        f"{_no_rows_hint(cfg, reasons)}")
    if reasons:
        log.warning("skipped %d of %d data rows: %s", len(docs) - len(good_idx), len(docs), summary)
    usable = len(good_idx)
    if cfg.max_documents is not None:
        good_idx = good_idx[: cfg.max_documents]
    stats = {"rows_read": len(docs), "rows_skipped": sum(reasons.values()), "skip_reasons": dict(reasons),
             "rows_unused": usable - len(good_idx)}  # past data.max_documents
    return docs.select(good_idx), stats


def _no_rows_hint(cfg, reasons: Counter) -> str:
    """What to fix when every row was skipped: the advice follows the reasons, not only the format."""
    if cfg.format == "tokens":
        return "give each row at least one token with loss (prompt_len < len(input_ids), or a 1 in loss_mask)"
    if cfg.format != "text":
        return ("give rows ShareGPT 'conversations' (from/value) or OpenAI 'messages' (role/content) "
                "with an assistant turn")
    if any(r.startswith("missing text field") for r in reasons):
        return f"set data.text_field to the column that holds the text (now {cfg.text_field!r})"
    return "the files or rows hold no text (empty or whitespace only); point data.sources at files with text"


def _check_vocab(docs: datasets.Dataset, vocab_size: int) -> None:
    """format=tokens: every id must index the model's embedding; name the first row that does not."""
    column = docs.data.column("input_ids")
    flat = flatten_lists(column)
    if len(flat) and flat.max() >= vocab_size:
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        at = int(np.argmax(flat >= vocab_size))
        _out_of_vocab(docs[int(parents[at])]["where"], int(flat[at]), vocab_size)


def _check_row_vocab(row: dict, vocab_size: int) -> None:
    """The streaming twin of _check_vocab: one row at a time."""
    bad = [t for t in row["input_ids"] if t >= vocab_size]
    if bad:
        _out_of_vocab(row["where"], bad[0], vocab_size)


def _out_of_vocab(where: str, token: int, vocab_size: int):
    raise DataError(f"{where}: token id {token} is outside the vocabulary (size {vocab_size}); "
                    "were these ids made with another tokenizer?")


def _truncate_tokens(batch, block_size):
    return {"input_ids": [ids[:block_size] for ids in batch["input_ids"]],
            "labels": [labels[:block_size] for labels in batch["labels"]],
            "lost_loss_tokens": [sum(t != -100 for t in labels[block_size:]) for labels in batch["labels"]]}


def _tokenize_text(batch, tokenizer, eos_id):
    ids = tokenizer(batch["text"], add_special_tokens=False, verbose=False)["input_ids"]
    return {"input_ids": [seq + [eos_id] for seq in ids]}


def _chat_code_hash() -> str:
    """The chat module's source, hashed: a change to how conversations are rendered or masked must re-tokenize
    (`datasets` fingerprints a map by its function's own code and kwargs, not by the code that function calls)."""
    import inspect

    from draftforge.data import chat

    return hashlib.sha256(inspect.getsource(chat).encode()).hexdigest()[:16]


_CHAT_CODE = _chat_code_hash()


def _tokenize_chat(batch, tokenizer, block_size, masking=None):  # masking: _CHAT_CODE, for the cache key only
    closer = closing_token(tokenizer)  # once per batch: it renders a probe conversation
    out = [tokenize_conversation(m, tokenizer, block_size, closer) for m in batch["messages"]]
    return {"input_ids": [o["input_ids"] for o in out], "labels": [o["labels"] for o in out],
            "lost_loss_tokens": [o["lost_loss_tokens"] for o in out], "refused": [o["refused"] for o in out]}


def _tokenize(docs, cfg, tokenizer, block_size: int, eos_id: int):
    if cfg.format == "text":
        fn, kwargs = _tokenize_text, {"tokenizer": tokenizer, "eos_id": eos_id}
    elif cfg.format == "tokens":  # already ids: only cut to the block (no re-tokenization)
        fn, kwargs = _truncate_tokens, {"block_size": block_size}
    else:  # `datasets` caches by this function's code and kwargs only: the masking code's own hash goes in too
        fn, kwargs = _tokenize_chat, {"tokenizer": tokenizer, "block_size": block_size, "masking": _CHAT_CODE}
    return docs.map(fn, batched=True, fn_kwargs=kwargs, remove_columns=docs.column_names,
                    num_proc=cfg.num_proc if cfg.num_proc > 1 and len(docs) > 1 else None,
                    desc=_tokenize_desc(cfg.format, len(docs), block_size))


def _tokenize_desc(fmt: str, n_docs: int, block_size: int) -> str:
    """The bar's label: token rows are only cut to the block, so they are not called "tokenizing"."""
    if fmt == "tokens":
        return f"cutting {n_docs:,} token rows to {block_size} tokens"
    what = ("conversation" if fmt == "chat" else "document") + ("" if n_docs == 1 else "s")
    return f"tokenizing {n_docs:,} {what}"


def own_labels(labels: list[int]) -> list[int]:
    """A row's labels with its first one dropped: nothing in the row predicts its first token, so packed after
    another row it would be scored from that row's last position (and a row whose only label it is has none)."""
    return [-100, *labels[1:]] if labels and labels[0] != -100 else list(labels)


def _to_blocks(docs, cfg, tokenizer, block_size: int, eos_id: int, pad_id: int):
    tokenized = _tokenize(docs, cfg, tokenizer, block_size, eos_id)  # map output has no indices mapping
    truncated_away, cut, lost, refused = 0, 0, 0, Counter()
    if cfg.format == "text":
        tokens_N = flatten_lists(tokenized.data.column("input_ids"))
        input_ids_BS, labels_BS = pack_stream(tokens_N, tokens_N, block_size, pad_id)
    else:
        input_ids, labels = tokenized["input_ids"], [own_labels(lab) for lab in tokenized["labels"]]
        if cfg.format == "chat":
            refused = Counter(r for r in tokenized["refused"] if r)
        if refused:  # rows the chat template raised on: skipped, by reason
            log.warning("skipped %d conversations the chat template refused: %s", sum(refused.values()),
                        ", ".join(f"{n} x {r}" for r, n in refused.most_common()))
        keep = [i for i, lab in enumerate(labels) if any(t != -100 for t in lab)]
        truncated_away = len(labels) - len(keep) - sum(refused.values())
        rows = "conversations" if cfg.format == "chat" else "token rows"
        if truncated_away:
            log.warning("skipped %d %s whose loss tokens were all truncated away (block size %d)", truncated_away,
                        rows, block_size)
        lost_per_row = tokenized["lost_loss_tokens"]  # a row longer than the block keeps its first block_size tokens
        cut, lost = sum(n > 0 for n in lost_per_row), int(sum(lost_per_row))
        if cut:
            log.warning("%d %s are longer than block size %d: cut there, %d of their loss tokens lost (raise "
                        "train.block_size to keep them)", cut, rows, block_size, lost)
        input_ids_BS, labels_BS = pack_greedy([input_ids[i] for i in keep], [labels[i] for i in keep],
                                              block_size, pad_id)
    n_tokens = len(tokens_N) if cfg.format == "text" else int(sum(len(input_ids[i]) for i in keep))
    n_slots = input_ids_BS.size
    stats = {"documents": len(docs) - truncated_away - sum(refused.values()), "tokens": n_tokens,
             "loss_tokens": int((labels_BS != -100).sum()), "blocks": int(input_ids_BS.shape[0]),
             "padding_fraction": (n_slots - n_tokens) / n_slots if n_slots else 0.0,
             "truncated_away": truncated_away, "rows_cut": cut, "loss_tokens_cut": lost,
             "refused": {f"chat template refused: {r}": n for r, n in refused.items()}}
    return datasets.Dataset(blocks_table(input_ids_BS, labels_BS)), stats


def _held_out(index: int, seed: int, fraction: float) -> bool:
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def _stream_blocks(docs, cfg, tokenizer, block_size, eos_id, pad_id, seed, want_eval, max_blocks, vocab_size):
    """Generator behind the streaming datasets: filter, split by seeded hash, tokenize, pack."""
    packer, emitted, used = StreamPacker(block_size, pad_id), 0, 0
    for index, row in enumerate(docs):
        if cfg.max_documents is not None and used >= cfg.max_documents:
            break
        if row["bad"]:
            continue
        used += 1
        if _held_out(index, seed, cfg.eval_fraction) != want_eval:
            continue
        if cfg.format == "text":
            ids = _tokenize_text({"text": [row["text"]]}, tokenizer, eos_id)["input_ids"][0]
            blocks = packer.add(ids, ids)
        else:
            if cfg.format == "tokens":
                _check_row_vocab(row, vocab_size)
                enc = _truncate_tokens({"input_ids": [row["input_ids"]], "labels": [row["labels"]]}, block_size)
                enc = {k: v[0] for k, v in enc.items()}
            else:
                enc = tokenize_conversation(row["messages"], tokenizer, block_size)
            labels = own_labels(enc["labels"])
            blocks = packer.add_whole(enc["input_ids"], labels) if any(t != -100 for t in labels) else ()
        for block in blocks:
            yield block
            emitted += 1
            if max_blocks is not None and emitted >= max_blocks:
                return
    yield from packer.flush()


def _build_streaming(docs, cfg, tokenizer, block_size, seed, eos_id, pad_id, vocab_size) -> BlockData:
    common = {"docs": docs, "cfg": cfg, "tokenizer": tokenizer, "block_size": block_size,
              "eos_id": eos_id, "pad_id": pad_id, "seed": seed, "vocab_size": vocab_size}
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "labels": datasets.List(datasets.Value("int32"))})
    train = datasets.IterableDataset.from_generator(
        _stream_blocks, features=features, gen_kwargs={**common, "want_eval": False, "max_blocks": None})
    eval_ds = None
    if cfg.eval_fraction > 0:
        eval_ds = datasets.IterableDataset.from_generator(
            _stream_blocks, features=features,
            gen_kwargs={**common, "want_eval": True, "max_blocks": STREAM_EVAL_BLOCKS})
    stats = {"streaming": True, "format": cfg.format, "block_size": block_size, "eval_fraction": cfg.eval_fraction}
    return BlockData(train=train, eval=eval_ds, stats=stats, block_size=block_size)
