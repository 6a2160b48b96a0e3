"""Harvest full EAGLE-2 trees with acceptance labels, the training rows of C2T (C2T App. B.1; docs/methods/c2t.md §6).

For each prompt the target's greedy continuation is decoded once; then, from the true prefix at
every step, the drafter grows the whole EAGLE-2 pool T1 (no rerank) and every node becomes a row:
P (joint probability), H (entropy of the parent's softmax over its top-M tokens), d (draft layer,
0 first), label (1 on the accepted root path). Under greedy decoding the accepted path is exactly
the deepest chain of nodes matching the continuation (docs/methods/c2t.md §6), so no tree-attention verification
runs; the prefix then advances by the accepted drafts + 1, as the decoder would (the depth is
capped by the tokens left, like the engine's plan). Rows are grouped by `tree_id`; every row also
names its prompt and the target's and drafter's weight fingerprints.

A harvest is a directory: `harvest.json` (settings + fingerprints) and one parquet shard per
prompt (written through `datasets`, atomically), so a killed harvest resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Literal

from draftforge.decode.methods.c2t import parent_entropy
from draftforge.decode.methods.eagle2 import Eagle2Builder
from draftforge.decode.plan import DynamicTree
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CompatibilityError, DataError, RecipeError
from draftforge.models.c2t import DEPTH_ORIGIN
from draftforge.harvest.job import HarvestJob
from draftforge.options import add_flags, option, positive_int
from draftforge.runtime import device_name, mixed_devices_text, other_devices

COLUMNS = ("tree_id", "prompt_id", "node", "parent", "P", "H", "d", "label", "target", "drafter")
COLUMN_TYPES = ("string", "string", "int64", "int64", "float64", "float64", "int64", "int64", "string", "string")
META_FILE = "harvest.json"
KIND = "c2t-harvest"


def model_fingerprint(model) -> str:
    """16 hex digits of models.cali_ts's fingerprint: weights rounded to bf16, so a target harvested in bf16 (dtype
    auto) matches the same checkpoint loaded in fp32 for training."""
    from draftforge.models.cali_ts import model_fingerprint as full_fingerprint

    return full_fingerprint(model)[:16]


@dataclass
class HarvestSettings:
    top_k: int = 10  # K of the EAGLE-2 expansion (App. B.1: 10)
    depth: int = 10  # EAGLE's code depth: draft layers = depth + 1 (App. B.1: dmax 11, 1,010 nodes a tree)
    top_m: int = 1000  # entropy over the parent's top-M probabilities
    max_new_tokens: int = 128


class HarvestBuilder(Eagle2Builder):
    """EAGLE-2 without rerank that also records, per created node, the entropy of its parent's distribution."""

    def __init__(self, top_k: int, depth: int, top_m: int):
        super().__init__(top_k, depth, rerank=False)
        self.top_m, self.node_entropy, self.joint = top_m, [], []

    def expand(self, depth, logits_BV, joint_B):
        entropy_B, _, _ = parent_entropy(logits_BV.float().softmax(-1), self.top_m)
        children = super().expand(depth, logits_BV, joint_B)
        for h, kids in zip(entropy_B.tolist(), children):
            self.node_entropy += [h] * len(kids)  # dynamic.py creates nodes in exactly this order
        return children

    def finish(self, parents, joint):
        self.joint = list(joint)
        return super().finish(parents, joint)


def accepted_path(tree, continuation: list[int]) -> list[int]:
    """Tree indices of the deepest root path matching the greedy continuation (siblings are distinct)."""
    path, node = [], -1
    for tok in continuation:
        child = next((j for j in tree.children(node) if tree.tokens[j] == tok), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path


def harvest_prompt(target, drafter, prompt: list[int], prompt_id: str, settings: HarvestSettings,
                   fingerprints: tuple[str, str], eos=None) -> dict[str, list]:
    """Column lists of every node of every tree grown along this prompt's greedy continuation."""
    from draftforge.decode import build_decoder
    from draftforge.decode.tree import DraftTree

    continuation = build_decoder("ar", target).generate(prompt, max_new_tokens=settings.max_new_tokens,
                                                        eos_token_id=eos).tokens
    rows = {c: [] for c in COLUMNS}
    drafter.reset()
    seq, pos, step, params = list(prompt), 0, 0, SamplingParams()
    follow = drafter.reads_target_hidden  # it drafts from the target's states: the target reads what is committed
    if follow:
        target.prefill(seq)
    while len(continuation) - pos - 1 > 0:  # the last token of the continuation comes without drafts
        layers = min(settings.depth + 1, len(continuation) - pos - 1)
        builder = HarvestBuilder(settings.top_k, settings.depth, settings.top_m)
        tree = drafter.draft(seq, DynamicTree(builder, layers), params, None)
        # a drafter that reads the target's states drafts nothing before the target has read a token past the
        # prompt's first (a one-token prompt): no rows, and the round goes on as the decoder's AR round does
        node_ids = list(drafter.node_map) if len(tree) else []
        path = accepted_path(tree, continuation[pos:])
        on_path = set(path)
        for i, node in enumerate(node_ids):
            rows["tree_id"].append(f"{prompt_id}/{step}")
            rows["prompt_id"].append(prompt_id)
            rows["node"].append(i)
            rows["parent"].append(tree.parents[i])
            rows["P"].append(builder.joint[node])
            rows["H"].append(builder.node_entropy[node])
            rows["d"].append(tree.depths[i] - 1 + DEPTH_ORIGIN)
            rows["label"].append(int(i in on_path))
        drafter.accept(path)
        if follow:  # the accepted tokens, verified as a chain: the target commits them and keeps their states
            chain = continuation[pos: pos + len(path)]
            target.verify(seq[-1], DraftTree(chain, list(range(-1, len(chain) - 1)), list(range(1, len(chain) + 1))))
            target.commit(list(range(len(chain))))
        seq += continuation[pos: pos + len(path) + 1]
        pos, step = pos + len(path) + 1, step + 1
    n = len(rows["P"])
    rows["target"], rows["drafter"] = [fingerprints[0]] * n, [fingerprints[1]] * n
    return rows


def check_out(out: Path, resume: bool, overwrite: bool) -> None:
    """Before the models load: refuse an --out this harvest may not write into (another command's files, another
    command's harvest), or a harvest there without --resume or --overwrite."""
    from draftforge.fsutil import foreign_dir_problem

    problem = foreign_dir_problem(out, META_FILE, "a harvest")
    if problem:
        raise DataError(problem)
    if resume and overwrite:
        raise RecipeError("--resume continues a harvest and --overwrite replaces it: pass one of them")
    if (out / META_FILE).is_file():
        old = _read_meta(out / META_FILE)
        if not isinstance(old, dict):
            raise DataError(f"{out / META_FILE} is JSON but no harvest record; harvest into a new --out")
        if old.get("kind", KIND) != KIND:  # another command's harvest
            raise DataError(f"{out} holds a {old['kind']}, not a trees harvest; choose another --out")
        if not resume and not overwrite:
            raise DataError(f"{out} already holds a harvest; pass --resume to continue it, --overwrite to start again, "
                            "or choose another --out")


def open_harvest(out_dir: Path, meta: dict) -> None:
    """Start a harvest dir, or check that the one there (check_out let it be resumed) was made with the same
    target, drafter and settings."""
    meta_file = out_dir / META_FILE
    if meta_file.is_file():
        old = _read_meta(meta_file)
        # a harvest from before these were recorded lacks them: the target's weights bind it still
        later = tuple(k for k in ("tokenizer_fingerprint", "dtype", "prompts_sha256", "ignore_eos", "depth_origin")
                      if k in old)
        for key in ("target", "drafter", "settings", *later):
            if old.get(key) != meta.get(key):
                what = (f"another {key} (the harvest's {old.get(key)}, this run's {meta.get(key)})"
                        if key != "prompts_sha256" else
                        "other prompts (the --bench file, --num-prompts or --chat-template changed: their sha256 "
                        f"{str(old.get(key))[:12]}... vs {str(meta.get(key))[:12]}...)")
                raise CompatibilityError(f"{out_dir} was harvested with {what}; resume with the same ones, or "
                                         "harvest into a new --out (or --overwrite it)")
        return
    from draftforge.fsutil import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(meta_file, json.dumps(meta, indent=2))


def write_shard(rows: dict[str, list], path: Path) -> None:
    import datasets

    from draftforge.data.sources import no_datasets_bars

    tmp = path.with_name(f".{path.name}.tmp")
    # typed columns: a prompt that grew no tree (its continuation one token long) writes an empty shard, whose
    # types would otherwise be null and clash with every other shard's when they load as one dataset
    features = datasets.Features({c: datasets.Value(t) for c, t in zip(COLUMNS, COLUMN_TYPES)})
    with no_datasets_bars():  # one "Creating parquet" bar per prompt would break the harvest's own bar
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(tmp))
    tmp.replace(path)


def _readable(path: Path) -> bool:
    """The shard's parquet footer and schema read (a cut file has no footer)."""
    import pyarrow.parquet as pq

    try:
        return set(COLUMNS) <= set(pq.ParquetFile(path).schema_arrow.names)
    except Exception:  # pyarrow raises several kinds for a damaged file
        return False


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"prompt-{index:06d}.parquet"


_SHARD = re.compile(r"prompt-\d{6,}\.parquet")


def harvest_shards(out_dir: Path, half_written: bool = False) -> list[Path]:
    """The shards a harvest writes in `out_dir` (or its killed writes' half shards), by their exact names: a user's
    my_analysis.parquet or prompt-notes.parquet beside them is neither read nor deleted."""
    if half_written:
        return sorted(p for p in out_dir.glob(".prompt-*.parquet.tmp") if _SHARD.fullmatch(p.name[1:-len(".tmp")]))
    return sorted(p for p in out_dir.glob("prompt-*.parquet") if _SHARD.fullmatch(p.name))


def harvest_meta(target, drafter, settings: HarvestSettings, source: str) -> dict:
    from draftforge.data.provenance import tokenizer_identity

    return {"kind": KIND, "target": model_fingerprint(target.model), "drafter": model_fingerprint(drafter.model),
            "settings": asdict(settings), "depth_origin": DEPTH_ORIGIN, "source": source, "columns": list(COLUMNS),
            **tokenizer_identity(target.tokenizer)}


def _note_device(out_dir: Path, here: str) -> None:
    """A resume that harvests on another device than earlier runs (harvest.json's `devices`, absent in a harvest
    from before they were recorded) says so and adds its own to the list."""
    from draftforge.fsutil import atomic_write_text

    meta = _read_meta(out_dir / META_FILE)
    devices = meta.get("devices", [])
    others = other_devices(devices, here)
    if others:
        print(f"harvest trees: notice: {mixed_devices_text(others, here)}", file=sys.stderr)
    if devices and here not in devices:
        atomic_write_text(out_dir / META_FILE, json.dumps({**meta, "devices": [*devices, here]}, indent=2))


def _read_meta(meta_file: Path) -> dict:
    try:
        return json.loads(meta_file.read_text())
    except ValueError as e:
        raise DataError(f"{meta_file}: not readable JSON ({e}); harvest again into a new --out") from None


def check_depth_origin(sources) -> None:
    """Each harvest's recorded depth origin (its harvest.json) must be the one the classifier and its builder use:
    its d column would otherwise train a head that reads every layer one off. Harvests from before it was
    recorded counted from DEPTH_ORIGIN too (it never changed)."""
    from draftforge.models.c2t import DEPTH_ORIGIN

    for src in map(Path, sources):
        meta_file = (src if src.is_dir() else src.parent) / META_FILE
        meta = _read_meta(meta_file) if meta_file.is_file() else {}
        if meta.get("depth_origin", DEPTH_ORIGIN) != DEPTH_ORIGIN:
            raise CompatibilityError(f"harvest {src} counts draft depth d from {meta['depth_origin']!r} "
                                     f"({meta_file}), but this code's C2T classifier gives the first draft layer "
                                     f"d={DEPTH_ORIGIN}; harvest again with this version (draftforge harvest trees)")


def check_tokenizer(sources, tokenizer) -> None:
    """Each harvest's recorded tokenizer (its harvest.json) must be `tokenizer`; one notice for those that
    record none (harvested before fingerprints, by a target without tokenizer files, or loose shards)."""
    from draftforge.data.provenance import check_record, notice, tokenizer_identity

    if tokenizer is None:
        return
    ours, unchecked = tokenizer_identity(tokenizer), []
    for src in map(Path, sources):
        meta_file = (src if src.is_dir() else src.parent) / META_FILE
        meta = _read_meta(meta_file) if meta_file.is_file() else {}
        record = {k: meta.get(k) for k in ("tokenizer", "tokenizer_fingerprint")}  # its "target" is a fingerprint
        if not check_record(record, ours, str(src), "harvest again with the recipe's target, or point "
                                                    "model.target / model.tokenizer at {theirs}"):
            unchecked.append(str(src))
    if unchecked:
        notice(unchecked, "the harvest records no tokenizer fingerprint: its tokenizer cannot be checked")


def load_harvest(sources, target_fingerprint: str | None = None, tokenizer=None):
    """All shards of harvest dirs / parquet files as one `datasets.Dataset`, checked: columns, one target
    (the recipe's, when its fingerprint is given), and the tokenizer recorded in harvest.json."""
    import datasets

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from draftforge.data.sources import no_datasets_bars

    for src in map(Path, sources):  # first: what follows reads each source's harvest.json
        if not src.exists():
            raise DataError(f"harvest source {src} does not exist; point data.sources at the --out of "
                            "`draftforge harvest trees`")
        kind = _read_meta(src / META_FILE).get("kind", KIND) if (src / META_FILE).is_file() else KIND
        if kind != KIND:  # a θ harvest or a logits cache: "holds no parquet shards" said nothing of that
            raise DataError(f"{src} holds a {kind}, not a C2T trees harvest; point data.sources at the --out of "
                            "`draftforge harvest trees`")
    check_depth_origin(sources)
    check_tokenizer(sources, tokenizer)
    parts = []
    for k, src in enumerate(map(Path, sources)):
        found = harvest_shards(src) if src.is_dir() else [src] if src.is_file() else []
        if not found:
            raise DataError(f"harvest source {src} holds no parquet shards; run `draftforge harvest trees` first")
        expected = _read_meta(src / META_FILE).get("prompts") if (src / META_FILE).is_file() else None
        if isinstance(expected, int) and len(found) < expected:  # recorded since 2026-12-03; a killed harvest
            raise DataError(f"the trees harvest in {src} is incomplete ({len(found)} of {expected} prompts): finish it "
                            "with the same `draftforge harvest trees` command and --resume")
        # a prompt that grew no tree left an empty shard (untyped before the shards were typed): nothing to read
        found = [f for f in found if not _empty(f, pq)]
        if not found:
            continue
        with no_datasets_bars():  # our own shards: a "Generating train split" bar says nothing to the user
            part = datasets.Dataset.from_parquet([str(f) for f in found])
        if len(sources) > 1 and "tree_id" in part.column_names:  # "prompt/step" ids repeat across harvests
            ids = pc.binary_join_element_wise(f"{k}", part.data.column("tree_id").cast("string"), ":")
            part = datasets.Dataset(part.data.set_column(part.column_names.index("tree_id"), "tree_id", ids))
        parts.append(part)
    if not parts:
        raise DataError(f"harvest {', '.join(map(str, sources))} holds no trees: every prompt's continuation was a "
                        "single token (harvest more, or longer, prompts; --ignore-eos; a larger --max-new-tokens)")
    data = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    missing = [c for c in COLUMNS if c not in data.column_names]
    if missing:
        raise DataError(f"harvest {', '.join(map(str, sources))} lacks column(s) {missing}; expected {list(COLUMNS)} "
                        "(files written by `draftforge harvest trees`)")
    targets = sorted(set(data.unique("target")))
    if len(targets) > 1:
        raise CompatibilityError(f"the harvest mixes trees of several targets {targets}; train on one target's trees")
    if target_fingerprint is not None and targets and targets[0] != target_fingerprint:
        raise CompatibilityError(f"the harvest's trees come from target {targets[0]}, not from this recipe's target "
                                 f"({target_fingerprint}); harvest again with the right --target")
    return data


def _empty(path: Path, pq) -> bool:
    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception:  # a damaged file: let the dataset reader name it
        return False


def harvest_top_m(sources) -> int:
    """The M of H's top-M entropy the harvests in `sources` used (their harvest.json settings; the default for loose
    shards without one); harvests with different M are refused (H would mean two things in one training set)."""
    from draftforge.models.c2t import ENTROPY_TOP_M

    found = {}
    for src in map(Path, sources):
        meta_file = (src if src.is_dir() else src.parent) / META_FILE
        if meta_file.is_file():
            found[str(src)] = int(_read_meta(meta_file).get("settings", {}).get("top_m", ENTROPY_TOP_M))
    if len(set(found.values())) > 1:
        raise CompatibilityError(f"the harvests compute H over different top-M ({found}); train on harvests made with "
                                 "one --top-m")
    return next(iter(found.values()), ENTROPY_TOP_M)


def summarize(data) -> dict:
    """Rows, trees, accepted nodes, their rate, and τ (accepted drafts per tree), read from the arrow columns."""
    labels = data.data.column("label").to_numpy()  # column access by row would format 1M+ rows one by one
    trees, positives = len(data.unique("tree_id")), int(labels.sum())
    return {"rows": len(labels), "trees": trees, "positives": positives,
            "positive_rate": positives / len(labels) if len(labels) else 0.0, "tau": positives / max(trees, 1)}


# ---------------------------------------------------------------- `draftforge harvest trees`

@dataclass(frozen=True, kw_only=True)
class TreeHarvestJob(HarvestJob):
    """`draftforge harvest trees`: its flags are these settings."""

    target: str = option(MISSING, "target model dir (HF decoder-only Transformer)")
    drafter: str = option(MISSING, "drafter dir (Mamba, Mamba2 or Transformer)")
    bench: str = option(MISSING, "prompt file or named set (testbed, humaneval, instructions); use training "
                        "prompts, disjoint from the ones you evaluate on")
    num_prompts: int | None = option(None, "use only the first N prompts (default: all)", check=positive_int)
    max_new_tokens: int = option(128, "greedy tokens per prompt", check=positive_int)
    top_k: int = option(10, "EAGLE-2 k: children per node and frontier width", check=positive_int)
    depth: int = option(10, "EAGLE-2 code depth: draft layers = depth + 1 (the paper's dmax 11)", check=positive_int)
    top_m: int = option(1000, "entropy over the parent's top-M tokens", check=positive_int)
    chat_template: Literal["auto", "always", "never"] = option(
        "auto", "auto: chat prompts use the target's chat template if it has one; always / never force it on or off")
    ignore_eos: bool = option(False, "always generate --max-new-tokens tokens (default: stop at the target's eos)")
    overwrite: bool = option(False, "replace the trees harvest in --out: its shards and harvest.json, once the models "
                             "and prompts have loaded (nothing else there is touched)")


def harvest_trees(job: TreeHarvestJob) -> dict:
    """Harvest every prompt of `job.bench` into `job.out` (resumable); the harvest's summary. One harvest per --out
    at a time (two wrote the same shard's temp file)."""
    from draftforge.fsutil import shared_lock

    with shared_lock(job.out, "draftforge harvest trees"):
        return _harvest_trees(job)


def _harvest_trees(job: TreeHarvestJob) -> dict:
    from tqdm import tqdm

    from draftforge.data.prompts import load_prompts
    from draftforge.decode import load_drafter, load_target
    from draftforge.decode.methods.eagle2 import check_eagle2
    from draftforge.runtime import announce, resolve_dtype

    out = Path(job.out)
    check_out(out, job.resume, job.overwrite)
    bench = Path(str(job.bench)).expanduser()
    if not bench.exists() and (bench.suffix or "/" in str(job.bench)):  # a prompts file, not a bench's name: found
        raise DataError(f"--bench {job.bench} does not exist")  # missing only after both models had loaded
    dtype = resolve_dtype(job.dtype, job.device)
    announce(dtype, "target and drafter")
    target = load_target(job.target, device=job.device, dtype=dtype.torch_dtype)
    drafter = load_drafter(job.drafter, target, device=job.device, dtype=dtype.torch_dtype)
    check_eagle2(job.top_k, job.depth, 2, target, drafter, top_k_flag="--top-k")
    settings = HarvestSettings(job.top_k, job.depth, job.top_m, job.max_new_tokens)
    prompts = load_prompts(job.bench, target.tokenizer, num_prompts=job.num_prompts, chat=job.chat_template,
                           context_length=target.max_context, max_new_tokens=job.max_new_tokens)
    # the prompts as the target reads them (the bench file's text, --num-prompts, --chat-template): a resume over
    # other prompts would put other prompts' trees under the same shard numbers
    prompts_sha = hashlib.sha256(json.dumps([[str(p.prompt_id), list(p.input_ids)] for p in prompts]).encode())
    meta = {**harvest_meta(target, drafter, settings, str(job.bench)), "dtype": dtype.name,
            "prompts_sha256": prompts_sha.hexdigest(), "prompts": len(prompts), "ignore_eos": bool(job.ignore_eos),
            "devices": [device_name(job.device)]}
    if job.overwrite and (out / META_FILE).is_file():  # only now: a load or prompt error above leaves it whole
        replaced = harvest_shards(out)
        for shard in replaced:
            shard.unlink()
        (out / META_FILE).unlink()
        print(f"harvest trees: --overwrite: removed the harvest in {out} ({len(replaced)} shard(s) and {META_FILE})",
              file=sys.stderr)
    open_harvest(out, meta)
    for tmp in harvest_shards(out, half_written=True):  # a killed write's half shard (the lock keeps out live ones)
        tmp.unlink()
    unreadable = [i for i in range(len(prompts)) if shard_path(out, i).is_file() and not _readable(shard_path(out, i))]
    for i in unreadable:  # a shard is written whole and renamed: one that cannot be read was damaged since
        shard_path(out, i).unlink()
    if unreadable:
        print(f"harvest trees: {len(unreadable)} kept shard(s) could not be read ({shard_path(out, unreadable[0]).name}"
              f"{' ...' if len(unreadable) > 1 else ''}): harvested again", file=sys.stderr)
    fingerprints, eos = (meta["target"], meta["drafter"]), ([] if job.ignore_eos else None)
    done = sum(shard_path(out, i).is_file() for i in range(len(prompts)))
    if done < len(prompts):
        _note_device(out, meta["devices"][0])
    totals = {"trees": 0, "rows": 0, "positives": 0}
    bar = tqdm(total=len(prompts), initial=done, desc="harvest trees", file=sys.stderr, dynamic_ncols=True)
    for i, prompt in enumerate(prompts):
        shard = shard_path(out, i)
        if shard.is_file():
            continue
        rows = harvest_prompt(target, drafter, list(prompt.input_ids), str(prompt.prompt_id), settings,
                              fingerprints, eos)
        write_shard(rows, shard)
        totals["trees"] += len(set(rows["tree_id"]))
        totals["rows"] += len(rows["label"])
        totals["positives"] += sum(rows["label"])
        bar.update(1)
        bar.set_postfix(trees=totals["trees"], tau=f"{totals['positives'] / max(totals['trees'], 1):.2f}")
    bar.close()
    return {"prompts": len(prompts), **summarize(load_harvest([out]))}


TREES_EPILOG = f"""writes:
  OUT/harvest.json              the settings, the target's and drafter's fingerprints, the columns
  OUT/prompt-NNNNNN.parquet     one per prompt, a row per node: {", ".join(COLUMNS)}
                                (P joint probability, H entropy of the parent's top-M, d draft layer from 0,
                                label 1 on the accepted path; a tree's nodes share tree_id)
each prompt's file is written whole: a killed harvest continues with --resume
examples:
  draftforge harvest trees --target TARGET --drafter DRAFTER --bench TRAIN_PROMPTS --out runs/c2t-harvest
then train the classifier: draftforge train recipes/c2t.yaml (data.sources: [runs/c2t-harvest]), and decode with
  draftforge eval ... --methods eagle2,c2t --c2t runs/c2t/export
"""


def configure(p) -> None:
    p.description = ("Grow the whole EAGLE-2 pool T1 at every step of each prompt's greedy continuation and label "
                     "each node (1 = on the path the target accepts). Labels are exact under greedy decoding: they "
                     "come from the target's own greedy continuation, with no tree verification.")
    p.epilog = TREES_EPILOG
    add_flags(p, TreeHarvestJob)


def run_job(job: TreeHarvestJob) -> int:
    summary = harvest_trees(job)
    print(f"harvest: {summary['prompts']:,} prompts, {summary['trees']:,} trees, {summary['rows']:,} nodes, "
          f"{summary['positives']:,} accepted ({summary['positive_rate']:.3%}), τ {summary['tau']:.2f} accepted "
          f"drafts per tree; in {job.out}")
    return 0
