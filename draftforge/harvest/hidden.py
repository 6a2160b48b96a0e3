"""`draftforge harvest hidden`: a target's states at chosen layers over token rows, for task eagle3 offline.

The logits harvest (harvest/logits.py) with one more output: the same plan, shards, resume, process split and
merge, the same top-k entries at every position a loss uses, and per row the concat of HF `hidden_states[i]`
for i in --layers (the states entering those layers, what an EAGLE-3 head fuses: models/eagle3.py) at every one
of its first --max-len positions, prompt included (a head's anchors attend to them). States are stored in the
dtype the target ran in (bfloat16 where the device computes it natively: `--dtype auto`), so they are the bits
task eagle3's online loss computes. The format: data/hidden_cache.py; training from it: train/eagle3_cache.py.

Padding: every batch is right-padded to --max-len tokens, as training right-pads its blocks to
train.block_size. Causal attention keeps padding out of every earlier position, but not out of the last bits:
SDPA's kernels split the keys by the padded length, so the same row read at another padded length can differ by
an ulp, and in bfloat16 such flips travel through the layers (SmolLM2: a few % of a state's norm at worst). With
--max-len = train.block_size a row is read exactly as in a block of its own; --pad-to-longest reads each batch
only as long as its longest row (faster on short rows, the states then differ by that rounding).
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

from draftforge.harvest.logits import LogitsHarvestJob, States, harvest_logits, run_harvest
from draftforge.options import option, positive_int

def harvest_hidden(target, rows, out, *, layers=None, pad_to_longest=False, **settings) -> dict:
    """Write (or continue) a hidden-state cache in `out` (harvest_logits' settings, plus the layers); its manifest.
    Shards default to the command's 32 rows: a shard of states is held in memory until written."""
    settings.setdefault("shard_rows", HiddenHarvestJob.shard_rows)
    return harvest_logits(target, rows, out, states=States(None if layers is None else list(layers), pad_to_longest),
                          **settings)


def layer_ids(text: str) -> tuple[int, ...]:
    """--layers 2,15,27 -> (2, 15, 27); ValueError for anything but integers (an empty item, as in 1,,2, too)."""
    return tuple(int(part) for part in text.split(","))


# ---------------------------------------------------------------- command line

DESCRIPTION = """\
Store a target's hidden states over token rows, so task eagle3 trains without running the target (recipe key
eagle3.hidden_cache: OUT; the target is then never loaded, only its config and input embedding are read).
For every row of --data (format: tokens) it keeps the states entering the --layers target layers (HF
hidden_states[i]) at each of its first --max-len positions, and, at each position a loss uses, the target's
--top-k log-probabilities, the log of the remaining mass and the argmax, as `draftforge harvest logits` does.
States are stored in the dtype the target ran in (--dtype auto: bfloat16 where native, else float32).

Storage: per token, len(layers) x hidden_size values (2 bytes each in bfloat16); per loss position, 8K + 12
bytes. SmolLM2-135M (hidden 576, 3 layers): 3,456 B per token in bfloat16. It is printed before the harvest
starts, and a disk without that room is refused before anything is written.

OUT holds safetensors shards of --shard-rows rows and harvest.json (the target's, tokenizer's and rows file's
fingerprints, the layer ids, the stored dtype, k, shards). An interrupted harvest continues with --resume; a
missing, truncated or corrupt shard is harvested again. Under `accelerate launch` each process harvests its
own shards and process 0 writes the index."""

EPILOG = """examples:
  draftforge harvest hidden --target TARGET --data rows.jsonl --max-len 2048 --out runs/hidden
  draftforge harvest hidden ... --layers 2,15,27 --draft-vocab 32000 --top-k 64
  draftforge harvest hidden ... --resume                              # continue a killed harvest
  accelerate launch -m draftforge harvest hidden --device cuda ...    # one shard subset per GPU
then: draftforge train RECIPE (task: eagle3, eagle3.hidden_cache: runs/hidden, data.sources: [rows.jsonl],
data.format: tokens, train.block_size: the --max-len)
"""


@dataclass(frozen=True, kw_only=True)
class HiddenHarvestJob(LogitsHarvestJob):
    """`draftforge harvest hidden`: the logits harvest's settings, plus which layers and how batches are padded."""

    layers: tuple[int, ...] | None = option(None, "target layers whose input states are kept, comma separated (id i "
                                            "= HF hidden_states[i], the state entering layer i; default: EAGLE-3's "
                                            "low / middle / high choice for the target's depth, [2, L // 2, L - 3])",
                                            parse=layer_ids, metavar="I,J,K")
    pad_to_longest: bool = option(False, "pad each batch to its longest row, not to --max-len: faster on short "
                                  "rows, but the states then differ from the online run's by rounding (in bfloat16, "
                                  "carried through the layers)")
    data: str = option(MISSING, "one file of token rows (format: tokens), the one eagle3 trains on", metavar="ROWS")
    max_len: int = option(2048, "keep the first N tokens of a row; every batch is padded to N as training pads its "
                          "blocks (give train.block_size)", check=positive_int)
    shard_rows: int = option(32, "rows per shard (a shard is held in memory before it is written: rows x --max-len "
                             "x the state bytes per token)", check=positive_int)


def configure(p: argparse.ArgumentParser) -> None:
    from draftforge.options import add_flags

    p.description, p.epilog = DESCRIPTION, EPILOG
    add_flags(p, HiddenHarvestJob)


def run_job(job: HiddenHarvestJob) -> int:
    return run_harvest(job, States(None if job.layers is None else list(job.layers), job.pad_to_longest))
