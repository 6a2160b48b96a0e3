"""Memory of the target and the drafter apart (the long-context issue's "peak memory of drafter and target
separately"): one untimed decode per method on each context bucket's first prompt, with every call into the
target and into the drafter metered.

Per component (the target; the drafter, where the method has one):
  weights_bytes   its parameters and buffers (a target's oneDNN-packed copies are extra: the eval's log and
                  manifest give their size)
  state_bytes     the most context state it held after any call (KV cache, SSM state: its `cache_bytes()`)
  working_bytes   the largest rise of memory during one of its calls above what was held when that call began
                  (activations, attention scores, scan intermediates): CUDA, torch.cuda.max_memory_allocated
                  minus memory_allocated at the call's start, the peak reset per call; CPU, the kernel's resident
                  high-water mark (VmHWM, reset per call) minus resident memory at the call's start, after freed
                  heap pages are handed back (malloc_trim), so that pages one component freed do not hide the
                  next one's growth. Where VmHWM cannot be reset, working_bytes is None.
  calls           how many outer calls were metered (a call made inside another of the same component is
                  part of it)

The target's calls are prefill / verify / commit; the drafter's are draft / accept and the dynamic-tree calls
(begin / feed / accept_nodes, draft_levels / accept_levels). A drafter call that asks the target for something
(an EAGLE-3 head taking the verified states) counts as the drafter's. Methods that run outside draftforge's
target (transformers' assisted generation) are not metered.
"""

from __future__ import annotations

import contextlib
import gc

from draftforge.decode.memory import reported_bytes
from draftforge.eval.metrics import _read_status_kib, reset_rss_high_water_mark, trim_heap

TARGET_CALLS = ("prefill", "verify", "commit")
DRAFTER_CALLS = ("draft", "accept", "begin", "feed", "accept_nodes", "draft_levels", "accept_levels")
HOW = {"cpu": "per call: VmHWM reset at its start (after malloc_trim) minus VmRSS then",
       "cuda": "per call: torch.cuda.max_memory_allocated, reset at its start, minus memory_allocated then"}


def module_bytes(holder) -> int | None:
    """Bytes of the parameters and buffers of `holder.model` (None when it has no torch module)."""
    model = getattr(holder, "model", None)
    if model is None or not hasattr(model, "parameters"):
        return None
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # tied weights counted once
    return sum(t.numel() * t.element_size() for t in tensors.values())


class _Meter:
    """Wraps the named methods of one object; records the working rise and held state of each outer call."""

    def __init__(self, holder, names, cuda: bool, can_reset: bool):
        self.holder, self.names, self.cuda, self.can_reset = holder, names, cuda, can_reset
        self.depth, self.calls, self.working, self.state = 0, 0, None, None  # (what it holds now is the last decode's)

    def _start(self) -> int | None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return int(torch.cuda.memory_allocated())
        if not self.can_reset:
            return None
        trim_heap()
        reset_rss_high_water_mark()
        return _read_status_kib("VmRSS")

    def _rise(self, start: int | None) -> int | None:
        if start is None:
            return None
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated()) - start
        peak = _read_status_kib("VmHWM")
        return None if peak is None else max(peak - start, 0)

    def wrap(self, name):
        inner = getattr(self.holder, name)

        def metered(*args, **kwargs):
            if self.depth:  # inside another metered call of the same object: part of it
                return inner(*args, **kwargs)
            start = self._start()
            self.depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                self.depth -= 1
                rise = self._rise(start)
                self.calls += 1
                if rise is not None:
                    self.working = rise if self.working is None else max(self.working, rise)
                held = reported_bytes(self.holder)
                if held is not None:
                    self.state = held if self.state is None else max(self.state, held)

        return metered

    @contextlib.contextmanager
    def installed(self):
        wrapped = [n for n in self.names if callable(getattr(self.holder, n, None))]
        for name in wrapped:
            setattr(self.holder, name, self.wrap(name))  # an instance attribute over the class's method
        try:
            yield self
        finally:
            for name in wrapped:
                delattr(self.holder, name)

    def result(self) -> dict:
        return {"weights_bytes": module_bytes(self.holder), "state_bytes": self.state,
                "working_bytes": self.working, "calls": self.calls}


def measure(decode, target, drafter, device: str = "cpu") -> dict:
    """Run `decode()` (one prompt through a decoder built on `target` / `drafter`) with both metered:
    {"target": {...}, "drafter": {...} or None, "how": ...} (module docstring)."""
    import torch

    cuda = str(device).startswith("cuda") and torch.cuda.is_available()
    can_reset = cuda or (_read_status_kib("VmHWM") is not None and reset_rss_high_water_mark())
    gc.collect(1)
    meters = [_Meter(target, TARGET_CALLS, cuda, can_reset)]
    if drafter is not None:
        meters.append(_Meter(drafter, DRAFTER_CALLS, cuda, can_reset))
    with contextlib.ExitStack() as stack:
        for meter in meters:
            stack.enter_context(meter.installed())
        decode()
    out = {"target": meters[0].result(), "drafter": meters[1].result() if drafter is not None else None,
           "how": HOW["cuda" if cuda else "cpu"] if can_reset else "working memory not measurable here (VmHWM "
           "cannot be reset); weights and state only"}
    if out["drafter"] is not None and not out["drafter"]["calls"]:
        out["drafter"] = None  # the method never called the drafter (AR)
    return out
