"""Eval metrics computed from the harness's DecodeResults (one record per method × temperature × repeat × prompt
× turn; a prompt has one turn unless it is a multi-turn question).

Conventions (stated again in every report):
  tau            tokens emitted per target forward, bonus/correction token counted (= new_tokens / forwards)
  tau_no_bonus   draft tokens accepted per round that drafted, bonus not counted (rounds drafting nothing skipped)
  tokens_per_s   per repeat: all new tokens of all prompts / all generate() wall time; median over repeats
  speedup        ratio of medians: median-over-repeats tokens/s of the method / that of AR in the same run
  decode_*       the same without the prefill (tokens / (generate() time − prefill)): what a drafter can change
                 once the prompt is encoded; at long context the prefill is most of an answer's time
  held           context state held when a decode ended, per prompt (min / median / max bytes): the target's KV
                 cache or SSM state, the drafter's cache or state (decode/memory.py)
  gamma_total    verified candidate tokens, summed over all rounds and prompts
  v_d, r_d, hm   EESD App. D: accepted / drafted, accepted / output tokens, their harmonic mean
  memory         per timed pass: held at its start, and its peak minus that start (PassMemory)
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from draftforge.decode.base import DecodeStats


@dataclass
class RunRecord:
    """One generate() call: a prompt's turn (0-based; later turns of a multi-turn question hold the method's own
    earlier answers) decoded by one method at one temperature in one repeat."""

    method: str
    temperature: float
    repeat: int
    prompt_id: str
    prompt_len: int  # tokens of the context decoded from (this turn's, for a later turn)
    tokens: list[int]
    stats: DecodeStats
    turn: int = 0
    context: list[int] | None = field(default=None, repr=False)  # a later turn's context ids (not in to_dict)

    def to_dict(self) -> dict:
        stats = asdict(self.stats)
        stats.update(tau=self.stats.tau, tau_no_bonus=self.stats.tau_no_bonus, other_time_s=self.stats.other_time_s)
        t = self.stats.total_time_s
        stats["tokens_per_s"] = self.stats.new_tokens / t if t > 0 else None
        return dict(method=self.method, temperature=self.temperature, repeat=self.repeat,
                    prompt_id=self.prompt_id, turn=self.turn, prompt_len=self.prompt_len, tokens=self.tokens,
                    stats=stats)


def spread(values: list[float]) -> dict:
    """min / median / max of a list (None when empty), so a report shows noise next to the figure."""
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _tokens_per_s_per_repeat(records: list[RunRecord]) -> dict[int, float]:
    by_rep: dict[int, list[RunRecord]] = {}
    for r in records:
        by_rep.setdefault(r.repeat, []).append(r)
    out = {}
    for rep in sorted(by_rep):
        toks = sum(r.stats.new_tokens for r in by_rep[rep])
        secs = sum(r.stats.total_time_s for r in by_rep[rep])
        if secs > 0:
            out[rep] = toks / secs
    return out


def tokens_per_s_by_repeat(records: list[RunRecord]) -> list[float]:
    return list(_tokens_per_s_per_repeat(records).values())


def decode_tokens_per_s_by_repeat(records: list[RunRecord]) -> list[float]:
    """Per repeat: all new tokens / all generate() time after the prefill; [] where the method does not time its
    prefill apart (every record's prefill_time_s exactly 0: transformers' assisted generation prefills inside its
    own generate(), so its "decoding" would include the prefill its AR peer leaves out)."""
    if records and all(r.stats.prefill_time_s == 0.0 for r in records):
        return []
    by_rep: dict[int, list[float]] = {}
    for r in records:
        acc = by_rep.setdefault(r.repeat, [0, 0.0])
        acc[0] += r.stats.new_tokens
        acc[1] += r.stats.total_time_s - r.stats.prefill_time_s
    return [toks / secs for toks, secs in (by_rep[k] for k in sorted(by_rep)) if secs > 0]


def held_bytes(stats_list: list[DecodeStats]) -> dict:
    """min / median / max over decodes of the context state held at their end; None where none was reported."""
    out = {}
    for key in ("target_cache_bytes", "drafter_state_bytes"):
        values = [getattr(s, key) for s in stats_list if getattr(s, key, None) is not None]
        out[key] = spread(values) if values else None
    return out


def speedup_by_repeat(records: list[RunRecord], ar_records: list[RunRecord]) -> list[float]:
    """Per-repeat speedup: the method's tokens/s in repeat r / AR's tokens/s in the same repeat r."""
    mine, ar = _tokens_per_s_per_repeat(records), _tokens_per_s_per_repeat(ar_records)
    return [mine[r] / ar[r] for r in sorted(mine) if ar.get(r)]


def acceptance_by_position(stats_list: list[DecodeStats]) -> list[float | None]:
    """Rate at depth d = rounds whose accepted path reached d / rounds that proposed depth d (0-based).

    Unconditional (not "given d-1 was accepted", as in EAGLE's n-alpha): for one configuration it
    falls with depth, except that rounds cut short by the token budget propose fewer depths."""
    depth = max((len(s.proposed_by_position) for s in stats_list), default=0)
    acc, prop = [0] * depth, [0] * depth
    for s in stats_list:
        for d, n in enumerate(s.proposed_by_position):
            prop[d] += n
        for d, n in enumerate(s.accept_by_position):
            acc[d] += n
    return [_ratio(a, p) for a, p in zip(acc, prop)]


def emitted_per_round(stats: DecodeStats) -> list[int]:
    """Tokens each target forward of one decode emitted (their sum is stats.new_tokens): accepted drafts + the
    bonus/correction token, except the last round, which is what is left. It is shorter when the decode ended
    inside it: at an EOS among the drafts (the engine counts drafts up to and including the EOS as accepted, and
    no bonus token follows) or at max_new_tokens."""
    lengths = [a + 1 for a in stats.accepted_per_round]
    if lengths:
        lengths[-1] = stats.new_tokens - sum(lengths[:-1])
    return lengths


def tau_histogram(stats_list: list[DecodeStats]) -> dict[int, int]:
    """How many rounds emitted k tokens (accepted drafts + the bonus/correction token; a decode's last round what
    it emitted before an EOS or the token budget ended it)."""
    counts = Counter(k for s in stats_list for k in emitted_per_round(s))
    return dict(sorted(counts.items()))


def eesd_hm(v_d: float | None, r_d: float | None) -> float | None:
    """EESD harmonic mean HM = 2·v_d·r_d / (v_d + r_d), as a fraction (the paper prints it ×100 as %).

    Definitions from the EESD paper, App. D (Liu et al. 2024, arXiv:2406.03853), as written down in
    docs/methods/eesd.md §6; they replace an earlier guess here that took v_d for a drafting-speed ratio:
      v_d = N_right / N_all_draft  (Eq. 11: accepted draft tokens / all drafted tokens)
      r_d = N_right / L            (Eq. 12: share of the output tokens that came from the draft)
    """
    if v_d is None or r_d is None or v_d + r_d == 0:
        return None
    return 2 * v_d * r_d / (v_d + r_d)


def draft_counts(stats_list: list[DecodeStats]) -> dict:
    """Accepted and drafted tokens, and the rounds that drafted anything (a round drafting nothing,
    like a prompt's last round with one token left, cannot accept and is not a drafting round)."""
    accepted = drafted = drafting_rounds = 0
    for s in stats_list:
        for i, a in enumerate(s.accepted_per_round):
            d = s.drafted_per_round[i] if i < len(s.drafted_per_round) else None
            if d is None or d > 0:  # unknown drafted count (older stats): count the round, as before
                drafting_rounds += 1
                accepted += a
            drafted += d or 0
    return {"accepted": accepted, "drafted": drafted, "drafting_rounds": drafting_rounds}


def _time_breakdown(stats_list: list[DecodeStats]) -> dict:
    parts = {
        "prefill_s": sum(s.prefill_time_s for s in stats_list),
        "draft_s": sum(s.draft_time_s for s in stats_list),
        "verify_s": sum(s.verify_time_s for s in stats_list),
        "other_s": sum(s.other_time_s for s in stats_list),
    }
    total = sum(s.total_time_s for s in stats_list)
    parts["total_s"] = total
    parts["fractions"] = {k[:-2]: (v / total if total else None) for k, v in parts.items() if k != "total_s"}
    return parts


def summarize(records: list[RunRecord], ar_records: list[RunRecord] | None = None) -> dict:
    """Aggregate the records of one method at one temperature; ar_records (same temperature) give speedup/α."""
    stats = [r.stats for r in records]
    new_tokens = sum(s.new_tokens for s in stats)
    forwards = sum(s.target_forwards for s in stats)
    counts = draft_counts(stats)
    accepted, drafted, drafting_rounds = counts["accepted"], counts["drafted"], counts["drafting_rounds"]
    tps = tokens_per_s_by_repeat(records)
    dtps = decode_tokens_per_s_by_repeat(records)
    v_d = _ratio(accepted, drafted)
    r_d = _ratio(accepted, new_tokens) if drafted else None
    out = {
        "num_records": len(records),
        "new_tokens": new_tokens,
        "target_forwards": forwards,
        "tau": _ratio(new_tokens, forwards),
        "tau_no_bonus": _ratio(accepted, drafting_rounds),
        "tau_per_prompt": spread([s.tau for s in stats]),
        "tokens_per_s": statistics.median(tps) if tps else None,
        "tokens_per_s_spread": spread(tps),
        "tokens_per_s_by_repeat": tps,
        "decode_tokens_per_s": statistics.median(dtps) if dtps else None,
        "decode_speedup": None,
        "held": held_bytes(stats),
        "gamma_total": drafted,
        "drafting_rounds": drafting_rounds,
        "mean_draft_length": _ratio(drafted, drafting_rounds),
        "acceptance_rate": v_d,
        "acceptance_by_position": acceptance_by_position(stats),
        "tau_histogram": tau_histogram(stats),
        "time": _time_breakdown(stats),
        "per_round": round_costs(stats),
        "prompt_tokens": prompt_tokens(records),
        "speedup": None,
        "speedup_spread": spread([]),
        "speedup_by_repeat": [],
        "alpha": None,
        "v_d": v_d,
        "r_d": r_d,
        "hm": eesd_hm(v_d, r_d),
    }
    if ar_records:
        out.update(_against_ar(records, ar_records, out["time"]["draft_s"], drafted))
    return out


# summarize()'s figures repeated per category
CATEGORY_KEYS = ("num_records", "new_tokens", "target_forwards", "tau", "tau_no_bonus", "tokens_per_s",
                 "tokens_per_s_spread", "speedup", "speedup_spread", "decode_tokens_per_s", "decode_speedup",
                 "acceptance_rate", "per_round", "prompt_tokens", "held")


def by_category(records: list[RunRecord], ar_records: list[RunRecord] | None,
                category_of: dict[str, str]) -> dict[str, dict]:
    """summarize() of each category's records against AR's records of the same category (category_of:
    prompt_id -> category, in report order), so a category's τ and speedup are the overall ones computed on
    its prompts, and the categories partition the records."""
    out = {}
    for cat in dict.fromkeys(category_of.values()):
        mine = [r for r in records if category_of.get(r.prompt_id) == cat]
        if not mine:
            continue
        ar = [r for r in ar_records or [] if category_of.get(r.prompt_id) == cat]
        full = summarize(mine, ar)
        out[cat] = {"num_prompts": len({r.prompt_id for r in mine}), **{k: full[k] for k in CATEGORY_KEYS}}
    return out


def round_costs(stats_list: list[DecodeStats]) -> dict:
    """Seconds per unit where the context length shows: prefill per prompt, one verification forward, one draft,
    and the harness's own time per target forward (other_s: everything that is neither; flat in the context
    length when the harness carries no per-round cost that grows with it)."""
    times = _time_breakdown(stats_list)
    forwards = sum(s.target_forwards for s in stats_list)
    rounds = draft_counts(stats_list)["drafting_rounds"]
    return {"prefill_s_per_prompt": _ratio(times["prefill_s"], len(stats_list)),
            "verify_s_per_forward": _ratio(times["verify_s"], forwards),
            "draft_s_per_round": _ratio(times["draft_s"], rounds) if rounds else None,
            "other_s_per_forward": _ratio(times["other_s"], forwards)}


def prompt_tokens(records: list[RunRecord]) -> dict | None:
    """Context lengths in target tokens (min, median, max) that the records decoded from."""
    lengths = [r.prompt_len for r in records if r.prompt_len]
    return spread(lengths) if lengths else None


def _against_ar(records: list[RunRecord], ar_records: list[RunRecord], draft_s: float, drafted: int) -> dict:
    """Speedup (ratio of medians, plus the per-repeat spread) and EESD's α = T_d / T_t (Eq. 14)."""
    out = {}
    tps, ar_tps = tokens_per_s_by_repeat(records), tokens_per_s_by_repeat(ar_records)
    if ar_tps and tps and statistics.median(ar_tps) > 0:
        out["speedup"] = statistics.median(tps) / statistics.median(ar_tps)
    dtps, ar_dtps = decode_tokens_per_s_by_repeat(records), decode_tokens_per_s_by_repeat(ar_records)
    if dtps and ar_dtps and statistics.median(ar_dtps) > 0:
        out["decode_speedup"] = statistics.median(dtps) / statistics.median(ar_dtps)
    per_rep = speedup_by_repeat(records, ar_records)
    out["speedup_by_repeat"], out["speedup_spread"] = per_rep, spread(per_rep)
    # T_t: AR's seconds per token of decoding (its prefill left out: a drafted token is priced against a step)
    ar_time = sum(r.stats.total_time_s - r.stats.prefill_time_s for r in ar_records)
    ar_toks = sum(r.stats.new_tokens for r in ar_records)
    if ar_toks and drafted and ar_time > 0:
        out["alpha"] = (draft_s / drafted) / (ar_time / ar_toks)
    return out


SAMPLE_EVERY_S = 0.005  # the fallback RSS sampler's period (where the kernel's high-water mark cannot be reset)


def rss_bytes() -> int:
    """This process's resident set size now (psutil: /proc/self/statm on Linux)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _read_status_kib(field: str) -> int | None:
    """A `VmXXX:  N kB` line of /proc/self/status in bytes; None off Linux or when absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_rss_high_water_mark() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) to the current RSS (Linux >= 4.0: writing 5 to
    /proc/self/clear_refs); False where that is not possible (not Linux, /proc not writable)."""
    if _read_status_kib("VmHWM") is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc malloc_trim), so that memory a previous pass freed but
    the allocator kept does not hide the next pass's growth; a no-op without glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _RssSampler:
    """Fallback peak: a daemon thread reading RSS every `every_s` seconds. Measured (Linux, 2-core VM): it uses
    ~2% of a core, and its GIL hand-offs slowed a tight single-threaded torch loop by ~5% (median of 6
    alternating pairs): more than the differences between methods a report resolves, hence only a fallback
    (benchmarks/decoding/eval_memory.py --sampler-overhead measures it on real decode passes)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        import threading

        import psutil

        self.proc, self.every_s, self.peak = psutil.Process(), every_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            if self.stop.wait(self.every_s):
                return

    def start(self) -> "_RssSampler":
        self.peak = self.proc.memory_info().rss
        self.thread.start()
        return self

    def finish(self) -> int:
        self.stop.set()
        self.thread.join()
        return max(self.peak, self.proc.memory_info().rss)


class PassMemory:
    """Memory of one timed pass: `with PassMemory(device) as mem: ...`, then `mem.result` (a dict).

    result: start_bytes (at the pass's start, after a young-generation gc and a heap trim), peak_bytes (highest
    during the pass), bytes = peak - start (what the pass added on top of what was already held), kind and how.
    CUDA: torch.cuda.memory_allocated / max_memory_allocated, the peak reset per pass. CPU: process RSS;
    the peak is the kernel's high-water mark VmHWM reset at the pass's start (exact, nothing runs during
    the pass), or, where it cannot be reset, RSS sampled every SAMPLE_EVERY_S by a background thread
    (`sampler=True` forces that path, for tests and the overhead measurement). Resetting VmHWM also resets
    the ru_maxrss that getrusage reports for this process.
    """

    def __init__(self, device: str = "cpu", sampler: bool = False):
        self.device, self.force_sampler = str(device), sampler
        self.result: dict | None = None

    def _cuda(self) -> bool:
        import torch

        return self.device.startswith("cuda") and torch.cuda.is_available()

    def __enter__(self) -> "PassMemory":
        import gc

        gc.collect(1)  # the young generations (the warm-up's cyclic garbage); a full collection costs ~0.3 s
        self._sampler = None
        if self._cuda():
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.kind, self.how = "cuda_allocated", "torch.cuda.max_memory_allocated, peak reset per pass"
            self.start = int(torch.cuda.memory_allocated(self.device))
            return self
        trim_heap()
        self.kind = "cpu_rss"
        if not self.force_sampler and reset_rss_high_water_mark():
            self.how = "kernel high-water mark VmHWM, reset per pass"
            self.start = _read_status_kib("VmRSS") or rss_bytes()
        else:
            self.how = f"RSS sampled every {SAMPLE_EVERY_S * 1e3:g} ms by a background thread"
            self._sampler = _RssSampler().start()
            self.start = self._sampler.peak
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda():
            import torch

            torch.cuda.synchronize(self.device)
            peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self._sampler is not None:
            peak = self._sampler.finish()
        else:
            peak = max(_read_status_kib("VmHWM") or 0, rss_bytes())
        peak = max(peak, self.start)
        self.result = {"kind": self.kind, "how": self.how, "start_bytes": self.start, "peak_bytes": peak,
                       "bytes": peak - self.start}


def step_slope(xs: list[float], ys: list[float]) -> float | None:
    """Median of the slopes between consecutive points: a leak raises every step, while a one-time heap
    growth (the allocator taking another arena) moves one step only and leaves the median (None: < 2 points)."""
    steps = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])) if x1 != x0]
    return statistics.median(steps) if steps else None


def fmt_num(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"
