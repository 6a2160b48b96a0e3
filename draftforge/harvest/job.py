"""What every harvest job declares: where it writes, where and in which dtype it runs, how it resumes."""

from __future__ import annotations

from dataclasses import MISSING, dataclass

from draftforge.options import check_fields, option, positive_int
from draftforge.runtime import PRECISIONS


@dataclass(frozen=True, kw_only=True)
class HarvestJob:
    """The settings every `draftforge harvest` job has; a job's own come first in its dataclass."""

    out: str = option(MISSING, "harvest directory (harvest.json + shards)", metavar="DIR")
    device: str = option("cpu", "where the models run: cpu, cuda or cuda:N")
    dtype: PRECISIONS = option("auto", "model dtype: auto = bfloat16 where the device computes it natively, else "
                               "float32; recorded in harvest.json, and a resume must use the same")
    resume: bool = option(False, "continue the harvest in --out (same models and settings); finished work is "
                          "skipped")
    threads: int | None = option(None, "torch intra-op threads on CPU (default 1, or OMP_NUM_THREADS: batch-1 "
                                 "model passes lose several-fold when a core is busy)", check=positive_int)

    def __post_init__(self):
        check_fields(self)
