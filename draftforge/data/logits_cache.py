"""A target's top-k next-token distributions over token rows, stored once (`draftforge harvest logits`).

Length (~490 lines): one on-disk format, its writer's shards and its reader's checks (target, tokenizer, rows,
vocabulary) kept together so they cannot drift apart. A hidden-state cache (data/hidden_cache.py, `draftforge
harvest hidden`) is this format with the target's states added per token; its reader extends LogitsCache.

With a cache, `distill` trains without a teacher forward (distill.logits_cache; the loss forms and their
truncation bounds: train/divergences.py). A cache directory holds:
  harvest.json              the manifest: the target (path, weights fingerprint, stored-files fingerprint), its
                            tokenizer (fingerprint), the rows file (path, bytes, mtime, sha256, rows,
                            positions), k, max_len, the draft vocabulary if any, the dtype, and the shards
                            (rows, positions, bytes, sha256); "complete" once every shard is written
  draft_vocab.json          with --draft-vocab: the target ids of the draft vocabulary
  shard-NNNNN.safetensors   rows [a, b) of the rows file:
      row_ptr   [R+1] int64    row a+i owns entries row_ptr[i]:row_ptr[i+1]
      position  [E]   int32    t: the entry is the target's distribution of the token after input_ids[t]
      ids       [E,K] int32    the K most probable target ids, descending (over the draft ids with --draft-vocab)
      logp      [E,K] float32  their log-probabilities under the target at T=1, over the whole vocabulary V
      rest_logp [E]   float32  log of the target's remaining mass on the same vocabulary (V or the draft ids)
      top1      [E]   int32    the target's argmax over all of V (top-1 agreement compares with it)
Entries exist for exactly the positions a loss uses: t with labels[t+1] != -100 and t + 1 < min(len, max_len).
Log-probs are stored as float32 whatever --dtype computed them: bfloat16 keeps 8 bits of mantissa, so a
log-prob near -8 would be off by up to 0.03 (3% of the probability) and the K probabilities and the tail
would stop summing to 1 at the precision the losses and their bounds are compared at; float32 costs 2 bytes
more per entry than bfloat16 would (the int32 ids cost 4 either way).
Legend: E entries (positions) of a shard, K top-k, R rows, B blocks, S block size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from pathlib import Path

import numpy as np

from draftforge.errors import CompatibilityError, DataError

MANIFEST = "harvest.json"
KIND = "logits-cache"
FORMAT_VERSION = 1
DRAFT_VOCAB_FILE = "draft_vocab.json"
TENSORS = {"ids": "<i4", "logp": "<f4", "rest_logp": "<f4", "top1": "<i4"}  # per entry, gathered per batch
_NUMPY = {"I32": "<i4", "I64": "<i8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # bf16: its bits, as uint16
HIDDEN_KIND = "hidden-cache"  # `draftforge harvest hidden`: this format plus states (data/hidden_cache.py)
KINDS = {KIND: ("a logits cache", "draftforge harvest logits"),
         HIDDEN_KIND: ("a hidden-state cache", "draftforge harvest hidden")}


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


SHARD_FILE = re.compile(r"shard-(\d{5,})\.(safetensors|json)")  # a shard, or the record a harvest writes beside it


def shard_index(path: Path) -> int | None:
    """The index in a shard's or shard record's name (shard-00012.json: 12); None for any other name."""
    found = SHARD_FILE.fullmatch(Path(path).name)
    return int(found.group(1)) if found else None


# ---------------------------------------------------------------- rows

def read_token_rows(path, tokenizer=None, fix: str | None = None) -> list[dict]:
    """The rows of one format=tokens file as {input_ids, labels, where}; its sidecar's tokenizer is checked first."""
    from draftforge.data.provenance import TRAIN_FIX, check_row_files
    from draftforge.data.sources import ROW_FILE_SUFFIXES, iter_located_rows, normalize_tokens

    path = Path(path)
    if not path.is_file():
        what = "is a directory; give the JSONL file" if path.is_dir() else "does not exist"
        raise DataError(f"token rows file {path} {what}")
    if path.suffix.lower() not in ROW_FILE_SUFFIXES:
        raise DataError(f"{path}: token rows are .jsonl/.json/.parquet rows of input_ids (format: tokens)")
    check_row_files([path], tokenizer, fix or TRAIN_FIX)
    rows = [normalize_tokens(row if isinstance(row, dict) else {}, where) for where, row in iter_located_rows(path)]
    if not rows:
        raise DataError(f"token rows file {path} has no rows")
    return rows


def loss_positions(labels: list[int], limit: int) -> list[int]:
    """Positions t whose next token carries a loss, within the first `limit` tokens."""
    n = min(len(labels), limit)
    return [t for t in range(n - 1) if labels[t + 1] != -100]


def check_ids_below(rows: list[dict], vocab_size: int) -> None:
    for row in rows:
        top = max(row["input_ids"])
        if top >= vocab_size:
            raise DataError(f"{row['where']}: token id {top} is outside the target's vocabulary (size {vocab_size}); "
                            "were these ids made with another tokenizer?")


def sha256_file(path) -> str:
    from draftforge.fsutil import sha256_file as digest

    return digest(Path(path))


def rows_identity(path) -> dict:
    """What names a rows file: where it was, its size and mtime (a quick check) and its sha256 (the real one)."""
    path = Path(path).resolve()
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


# ---------------------------------------------------------------- the target, without loading it

def stored_weights_fingerprint(model_dir) -> str | None:
    """sha256 over each stored tensor's name, dtype, shape and 16 evenly spaced 16-byte samples of its bytes,
    read from the *.safetensors files without building the model (None: no local safetensors). Another copy
    of the same files matches; the same weights saved in another dtype do not (models.cali_ts's fingerprint,
    which needs the model loaded, decides then)."""
    path = Path(str(model_dir))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for file in files:
        header, base = _safetensors_header(file)
        with open(file, "rb") as f:
            for name in sorted(k for k in header if k != "__metadata__"):
                info = header[name]
                begin, end = info["data_offsets"]
                h.update(f"{name}:{info['dtype']}:{info['shape']}:".encode())
                for offset in _sample_offsets(begin, end):
                    f.seek(base + offset)
                    h.update(f.read(16))
    return h.hexdigest()


CONFIG_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache")


def config_fingerprint(model_dir) -> str | None:
    """sha256 of the target's config.json as stored (keys that change no logit or state left out; None without
    one): the weights alone miss a config edit, such as RoPE scaling added for long context, which changes every
    cached logit and state."""
    path = Path(str(model_dir)) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    kept = {k: v for k, v in config.items() if k not in CONFIG_VOLATILE} if isinstance(config, dict) else config
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def _sample_offsets(begin: int, end: int, n: int = 16, width: int = 16) -> list[int]:
    span = end - begin
    if span <= n * width:
        return list(range(begin, end, width))
    return [begin + i * (span - width) // (n - 1) for i in range(n)]


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """(header, byte offset of the data) of a safetensors file; DataError when the header is unreadable."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > os.path.getsize(path) - 8:
                raise ValueError("header runs past the end of the file")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise DataError(f"{path}: not a readable safetensors file ({e})") from None
    return header, 8 + length


# ---------------------------------------------------------------- shards

def write_shard(path: Path, tensors: dict, metadata: dict) -> dict:
    """Save tensors atomically (temp file + rename); the manifest entry: file, bytes, sha256."""
    from safetensors.torch import save_file

    from draftforge.fsutil import usual_permissions

    tmp = path.with_name(f".{path.name}.tmp")
    # one metadata key: safetensors stores the metadata map in hash order, and a resumed harvest must
    # write the same bytes as an uninterrupted one
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"draftforge": json.dumps(metadata, sort_keys=True)})
    usual_permissions(tmp)
    os.replace(tmp, path)
    st = path.stat()
    return {"file": path.name, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def shard_problem(cache_dir: Path, entry: dict, quick: bool = False) -> str | None:
    """Why the shard an entry names cannot be used (missing, truncated, corrupt), or None. `quick` (a training
    start): a shard with the size and modification time recorded when it was written is taken as it was (the rows
    files' rule), so a start does not read a cache of terabytes once per process; any other is hashed."""
    path = Path(cache_dir) / entry["file"]
    if not path.is_file():
        return f"{path} is missing"
    st = path.stat()
    size = st.st_size
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "longer than written"
        return f"{path} is {what} ({size:,} of {entry['bytes']:,} bytes)"
    if quick and entry.get("mtime_ns") == st.st_mtime_ns:
        return None
    if sha256_file(path) != entry["sha256"]:
        return f"{path} is corrupt (its sha256 differs from the one recorded when it was written)"
    return None


def _memmaps(path: Path) -> dict[str, np.ndarray]:
    """Each tensor of a shard as a read-only view of the file (pages are read when indexed)."""
    header, base = _safetensors_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype, shape = np.dtype(_NUMPY[info["dtype"]]), tuple(info["shape"])
        out[name] = (np.memmap(path, dtype=dtype, mode="r", offset=base + begin, shape=shape) if end > begin
                     else np.zeros(shape, dtype=dtype))
    return out


# ---------------------------------------------------------------- reading a cache

def resume_fix(kind: str = KIND) -> str:
    return f"rerun `{KINDS[kind][1]}` with the same arguments and --resume to harvest it again"


def read_manifest(cache_dir: Path, kind: str = KIND) -> dict:
    """The manifest of a cache of `kind` (KINDS); DataError for none, an unreadable one or another kind."""
    path = Path(cache_dir) / MANIFEST
    what, command = KINDS[kind]
    if not path.is_file():
        raise DataError(f"{cache_dir} is not {what} (no {MANIFEST}); make one with `{command}`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not readable JSON ({e}); harvest again into a new --out") from None
    found = manifest.get("kind") if isinstance(manifest, dict) else None
    if found != kind:
        made_by = f" (made by `{KINDS[found][1]}`)" if found in KINDS else ""
        raise DataError(f"{path} is not {what} manifest: its kind is {found!r}{made_by}; give a `{command}` "
                        "directory")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise DataError(f"{path} has format_version {manifest['format_version']}, newer than this draftforge reads "
                        f"({FORMAT_VERSION}); upgrade draftforge")
    return manifest


def _chained(manifest: dict, key: str):
    value = manifest.get(key)
    if key == "draft_vocab" and isinstance(value, dict):  # the ids, not where they were counted
        return value.get("size"), value.get("sha256")
    return value


class LogitsCache:
    """A complete, verified cache: per-row positions and per-entry gathers, read through memory maps.

    Several cache directories, one per rows file of data.sources, read as one cache over those files' rows in
    order (rows added later get a cache of their own instead of a harvest of everything again); they must share
    the target (its weights and config.json), the tokenizer, k, max_len and the draft vocabulary.

    A kind of cache that stores more per row (data/hidden_cache.py) names itself in KIND / WHAT / RECIPE_KEY, adds
    its columns to COLUMNS and checks its own tensors in `_check_layout` and its rows in `check_rows`."""

    KIND, WHAT, RECIPE_KEY = KIND, "logits cache", "distill.logits_cache"
    COLUMNS = ("cache",)  # the per-token columns `block_columns` gives a block (packed as the labels are)
    # what every cache of a chain must share (the target's weights and config, its tokenizer, the stored
    # distribution's shape); check_target compares the recipe's target with the first cache's
    CHAIN_KEYS = ("target_fingerprint", "target_config", "tokenizer_fingerprint", "top_k", "max_len", "vocab_size",
                  "draft_vocab")

    def __init__(self, cache_dirs):
        dirs = [Path(d) for d in (cache_dirs if isinstance(cache_dirs, (list, tuple)) else [cache_dirs])]
        if not dirs:
            raise DataError(f"no {self.WHAT} given")
        self.fix = resume_fix(self.KIND)
        self.dirs, self.manifests = dirs, [read_manifest(d, self.KIND) for d in dirs]
        self.dir, self.manifest = dirs[0], self.manifests[0]
        self.name = " + ".join(str(d) for d in dirs)
        self.maps, row_starts, offset = [], [], 0
        for cache_dir, m in zip(dirs, self.manifests):
            if not m.get("complete"):
                done = {e.get("index") for e in m.get("shards", []) if isinstance(e, dict)}
                # records written since, by a run that did not finish
                done |= {shard_index(p) for p in cache_dir.glob("shard-*.json") if shard_index(p) is not None}
                raise DataError(f"the {self.WHAT} in {cache_dir} is incomplete ({len(done)} of "
                                f"{m.get('num_shards', '?')} shards written): {self.fix}")
            for entry in m["shards"]:  # sizes and hashes: a damaged shard is named before training starts
                problem = shard_problem(cache_dir, entry, quick=True)
                if problem:
                    raise DataError(f"{self.WHAT} shard {problem}; {self.fix}")
            with self._blaming_damage([cache_dir]):
                maps = [_memmaps(cache_dir / e["file"]) for e in m["shards"]]
                self._check_layout(cache_dir, m, maps)
            self.maps += maps
            row_starts += [offset + e["rows"][0] for e in m["shards"]]
            offset += m["rows"]["count"]
        self._check_chain()
        m = self.manifest
        self.k, self.max_len, self.vocab_size = m["top_k"], m["max_len"], m["vocab_size"]
        self.num_rows = offset
        self.positions = sum(m["rows"]["positions"] for m in self.manifests)
        self.row_starts = np.array(row_starts + [self.num_rows], dtype=np.int64)
        sizes = [len(mm["position"]) for mm in self.maps]
        self.entry_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _check_layout(self, cache_dir: Path, m: dict, maps: list[dict]) -> None:
        k = m["top_k"]
        for entry, mm in zip(m["shards"], maps):
            a, b = entry["rows"]
            ok = len(mm["row_ptr"]) == b - a + 1 and int(mm["row_ptr"][-1]) == len(mm["position"])
            ok = ok and mm["ids"].shape == (len(mm["position"]), k)
            if not ok:
                raise DataError(f"{self.WHAT} shard {cache_dir / entry['file']} does not hold rows {a}..{b} with "
                                f"top-{k} entries as its manifest says; {self.fix}")
        starts = [e["rows"][0] for e in m["shards"]] + [m["rows"]["count"]]
        if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
            raise DataError(f"the shards of {cache_dir} do not cover rows 0..{m['rows']['count']} in order; "
                            "harvest again")

    def _check_chain(self) -> None:
        first = self.manifest
        for cache_dir, m in zip(self.dirs[1:], self.manifests[1:]):
            differ = [key for key in self.CHAIN_KEYS if _chained(m, key) != _chained(first, key)]
            if differ:
                def value(manifest, key):
                    v = _chained(manifest, key)
                    return str(v)[:12] if key.endswith(("fingerprint", "config")) else v

                differ = [f"{key} ({value(first, key)} vs {value(m, key)})" for key in differ]
                raise CompatibilityError(f"{self.WHAT}s {self.dirs[0]} and {cache_dir} differ in {', '.join(differ)}; "
                                         "the caches of one run must come from one target and tokenizer, with one "
                                         "--top-k, --max-len and --draft-vocab: harvest the odd one again with the "
                                         "first one's settings")

    @property
    def draft_vocab(self) -> list[int] | None:
        if not self.manifest.get("draft_vocab"):
            return None
        return json.loads((self.dir / DRAFT_VOCAB_FILE).read_text())

    def row_span(self, row: int, ptr: str = "row_ptr") -> tuple[int, int, int]:
        """(shard, first, end): `row`'s items in its shard under the per-row pointer `ptr` (row_ptr: entries)."""
        s = int(np.searchsorted(self.row_starts, row, side="right") - 1)
        local = row - int(self.row_starts[s])
        at = self.maps[s][ptr]
        return s, int(at[local]), int(at[local + 1])

    def row_positions(self, row: int) -> tuple[np.ndarray, int]:
        """(positions t of `row`, global index of its first entry)."""
        s, a, b = self.row_span(row)
        return np.asarray(self.maps[s]["position"][a:b]), int(self.entry_starts[s]) + a

    def block_columns(self, row: int, n_tokens: int) -> dict[str, list[int]]:
        """The COLUMNS of `row`'s first n_tokens tokens in a block: `cache`, the global entry of each position whose
        next token is inside the block (-100: none)."""
        positions, start = self.row_positions(row)
        entry = [-100] * n_tokens
        for j, t in enumerate(positions.tolist()):
            if t + 1 < n_tokens:
                entry[t] = start + j
        return {"cache": entry}

    def check_rows(self, rows: list[dict], block_size: int) -> None:
        """The rows files' rows are the cache's (DataError naming the first that is not)."""
        with self._blaming_damage(self.dirs):
            check_rows_match(self, rows, block_size)

    @contextlib.contextmanager
    def _blaming_damage(self, dirs):
        """A DataError in the block becomes "shard ... is corrupt" where a shard of `dirs` no longer hashes as written:
        the start's quick check trusts a shard with its recorded size and mtime, which damage under a restored mtime
        (a copy with cp -p, then bit rot) keeps, and the layout or rows check that trips on it would blame the rows."""
        try:
            yield
        except DataError:
            for cache_dir, m in zip(self.dirs, self.manifests):
                for entry in m["shards"] if cache_dir in dirs else []:
                    problem = shard_problem(cache_dir, entry)
                    if problem:
                        raise DataError(f"{self.WHAT} shard {problem}; {self.fix}") from None
            raise

    def gather(self, index_E: np.ndarray) -> dict[str, np.ndarray]:
        """The TENSORS entries at global indices index_E (any order)."""
        return self.take(index_E, self.entry_starts, TENSORS)

    def take(self, index_E: np.ndarray, starts: np.ndarray, names) -> dict[str, np.ndarray]:
        """Items index_E (global, any order) of the shard tensors `names`, whose shard s begins at item starts[s]."""
        index_E = np.asarray(index_E, dtype=np.int64)
        shard_E = np.searchsorted(starts, index_E, side="right") - 1
        first = self.maps[0]
        out = {name: np.empty((len(index_E), *first[name].shape[1:]), dtype=first[name].dtype) for name in names}
        for s in np.unique(shard_E):
            sel_E = shard_E == s
            local_E = index_E[sel_E] - starts[s]
            for name in names:
                out[name][sel_E] = self.maps[s][name][local_E]
        return out

    # ---------------------------------------------------------------- what it must match

    def check_tokenizer(self, tokenizer) -> None:
        """CompatibilityError when the cache was harvested with another tokenizer than the run's."""
        from draftforge.data.provenance import describe, notice, tokenizer_identity

        ours, theirs = tokenizer_identity(tokenizer), self.manifest.get("tokenizer_fingerprint")
        if not theirs or not ours["tokenizer_fingerprint"]:
            notice([str(self.dir)], f"the {self.WHAT} or this run has no tokenizer fingerprint: not checked")
            return
        if theirs != ours["tokenizer_fingerprint"]:
            raise CompatibilityError(f"{self.WHAT} {self.dir} was harvested with {describe(self.manifest)}, but this "
                                     f"run uses {describe(ours)}; harvest again with this run's target, or point "
                                     f"model.target / model.tokenizer at {self.manifest.get('target')}")

    def check_target(self, target) -> str:
        """How the recipe's target was matched with the harvest's; CompatibilityError for another target (other
        weights, or the same weights under another config.json)."""
        config = self.manifest.get("target_config")  # caches from before it was recorded: weights only
        if config is not None and config_fingerprint(target) not in (None, config):
            raise CompatibilityError(f"{self.WHAT} {self.dir} was harvested from target {self.manifest.get('target')} "
                                     f"with another config.json than model.target {target} has now (another "
                                     "model, or its config edited since, e.g. RoPE scaling): its logits and states "
                                     "are another model's; harvest again with this target, or restore the old "
                                     "config")
        recorded = self.manifest.get("target_files")
        if recorded is not None and stored_weights_fingerprint(target) == recorded:
            return "its stored weight files match"
        from draftforge.loading import load_causal_lm
        from draftforge.models.cali_ts import model_fingerprint

        theirs = self.manifest.get("target_fingerprint")
        ours = model_fingerprint(load_causal_lm(target, what=f"target (to compare with the {self.WHAT})"))
        if ours != theirs:
            raise CompatibilityError(f"{self.WHAT} {self.dir} was harvested from target {self.manifest.get('target')} "
                                     f"(weights fingerprint {str(theirs)[:12]}), not from model.target {target} "
                                     f"(weights fingerprint {ours[:12]}); harvest again with --target {target}, or "
                                     f"train against {self.manifest.get('target')}")
        return "its files differ, but its weights match (loaded once to compare)"

    def check_rows_files(self, paths) -> None:
        """DataError unless each of `paths` holds the bytes its cache was harvested from (size + mtime, else sha256)."""
        if len(paths) != len(self.dirs):
            raise DataError(f"{len(paths)} rows files in data.sources but {len(self.dirs)} {self.WHAT}s in "
                            f"{self.RECIPE_KEY}: give one cache per rows file, in the same order")
        for cache_dir, m, path in zip(self.dirs, self.manifests, paths):
            want, path = m["rows"], Path(path).expanduser().resolve()
            if not path.is_file():
                raise DataError(f"data source {path} does not exist; it should be the rows file {self.WHAT} "
                                f"{cache_dir} was harvested from ({want['path']}, {want['count']:,} rows)")
            st = path.stat()
            if st.st_size == want["bytes"] and st.st_mtime_ns == want["mtime_ns"] and str(path) == want["path"]:
                continue
            if st.st_size != want["bytes"] or sha256_file(path) != want["sha256"]:
                raise DataError(f"data source {path} is not the rows file {self.WHAT} {cache_dir} was harvested "
                                f"from ({want['path']}, {want['bytes']:,} bytes, sha256 {want['sha256'][:12]}; this "
                                f"one has {st.st_size:,} bytes): train on those rows, or harvest again on these")


def open_cache(paths, kind: type = LogitsCache):
    """One cache directory, or a list of them (one per rows file) read as one `kind` of cache."""
    paths = paths if isinstance(paths, (list, tuple)) else [paths]
    return kind([Path(os.path.expanduser(str(p))) for p in paths])


# ---------------------------------------------------------------- blocks for distill

def cached_block_data(cfg, tokenizer, block_size: int, seed: int, vocab_size: int, cache: LogitsCache):
    """Like pipeline.build_block_data for format=tokens (same usable rows, same seeded split, cut to the block,
    packed greedily), plus the cache's COLUMNS: for a logits cache `cache`, the global entry of each position
    (-100: none)."""
    import datasets

    from draftforge.data.pipeline import BlockData, _special_ids, split_documents

    if cfg.eval_sources:
        raise DataError(f"data.eval_sources {cfg.eval_sources}: a cache holds the rows of data.sources only, so "
                        "held-out rows from other files have nothing cached; use data.eval_fraction with a cache")
    cache.check_rows_files(cfg.sources)
    rows = [row for source in cfg.sources for row in read_token_rows(source, tokenizer)]
    check_ids_below(rows, vocab_size)
    cache.check_rows(rows, block_size)
    usable = [i for i, row in enumerate(rows) if not row["bad"]]
    if not usable:
        raise DataError(f"no usable rows in {', '.join(cfg.sources)}: give each row at least one token with loss")
    if cfg.max_documents is not None:
        usable = usable[: cfg.max_documents]
    train_idx, eval_idx = split_documents(datasets.Dataset.from_dict({"row": usable}), cfg.eval_fraction, seed)
    _, pad_id = _special_ids(tokenizer)
    train, stats = _cached_blocks(rows, train_idx["row"], cache, block_size, pad_id)
    stats.update(format="tokens", block_size=block_size, rows_read=len(rows), rows_skipped=len(rows) - len(usable),
                 skip_reasons={"no loss tokens": len(rows) - len(usable)} if len(rows) > len(usable) else {},
                 eval_documents=0, eval_blocks=0)
    eval_ds = None
    if eval_idx is not None:
        eval_ds, eval_stats = _cached_blocks(rows, eval_idx["row"], cache, block_size, pad_id)
        stats.update(eval_documents=eval_stats["documents"], eval_blocks=eval_stats["blocks"])
        eval_ds = eval_ds if len(eval_ds) else None
    if len(train) == 0:
        raise DataError(f"no training blocks from {', '.join(cfg.sources)}: every row lost its loss tokens to the "
                        "block size")
    return BlockData(train=train, eval=eval_ds, stats=stats, block_size=block_size)


def check_rows_match(cache: LogitsCache, rows: list[dict], block_size: int) -> None:
    """The same rows, the same loss positions, and a cache long enough for the block (else DataError)."""
    if len(rows) != cache.num_rows:
        raise DataError(f"the rows files have {len(rows):,} rows but {cache.WHAT} {cache.name} holds "
                        f"{cache.num_rows:,}; train on the rows it was harvested from")
    for i, row in enumerate(rows):
        have, _ = cache.row_positions(i)
        want = loss_positions(row["labels"], cache.max_len)
        if len(have) != len(want) or not np.array_equal(have, want):
            j = None if len(have) != len(want) else int(np.flatnonzero(np.asarray(have) != np.asarray(want))[0])
            how = (f"{len(want)} positions vs {len(have)}" if j is None else
                   f"{len(want)} each; entry {j} is position {want[j]} here, {int(have[j])} in the cache")
            raise DataError(f"{row['where']}: its loss positions are not those {cache.WHAT} {cache.name} holds for "
                            f"row {i} ({how}); the rows changed since the harvest: harvest again")
        if block_size > cache.max_len and len(loss_positions(row["labels"], block_size)) > len(want):
            raise DataError(f"{cache.WHAT} {cache.name} was harvested with --max-len {cache.max_len}, but "
                            f"train.block_size is {block_size} and {row['where']} has loss positions past "
                            f"{cache.max_len - 1}; harvest with --max-len {block_size} or lower train.block_size")


def _cached_blocks(rows: list[dict], idx: list[int], cache: LogitsCache, block_size: int, pad_id: int):
    """Rows `idx` cut to the block and packed greedily, with the cache's columns; (Dataset, stats)."""
    import datasets
    import pyarrow as pa

    from draftforge.data.packing import pack_greedy
    from draftforge.data.pipeline import own_labels

    ids, labels, extra = [], [], {name: [] for name in cache.COLUMNS}
    for i in idx:
        row_ids = rows[i]["input_ids"][:block_size]
        columns = cache.block_columns(i, len(row_ids))
        if max(columns["cache"]) < 0:  # every loss token lies past the block
            continue
        ids.append(row_ids)
        labels.append(own_labels(rows[i]["labels"][:block_size]))  # as the online blocks have them
        for name, values in columns.items():
            extra[name].append(values)
    ids_BS, labels_BS = pack_greedy(ids, labels, block_size, pad_id)
    packed = {name: pack_greedy(ids, values, block_size, pad_id)[1] for name, values in extra.items()}  # pad: -100
    entries_BS = packed["cache"]

    def column(a_BS, dtype):
        return pa.FixedSizeListArray.from_arrays(pa.array(a_BS.reshape(-1).astype(dtype)), block_size)

    table = pa.table({"input_ids": column(ids_BS, np.int32), "labels": column(labels_BS, np.int32),
                      **{name: column(a_BS, np.int64) for name, a_BS in packed.items()}})
    n_tokens = int(sum(len(x) for x in ids))
    n_slots = ids_BS.size
    stats = {"documents": len(ids), "tokens": n_tokens, "loss_tokens": int((entries_BS >= 0).sum()),
             "blocks": int(ids_BS.shape[0]), "padding_fraction": (n_slots - n_tokens) / n_slots if n_slots else 0.0}
    return datasets.Dataset(table), stats
