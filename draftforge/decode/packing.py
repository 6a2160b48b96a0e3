"""Linear weights laid out once for the CPU's matrix library (oneDNN), not at every call.

On CPU, torch computes a bf16 `F.linear` with oneDNN from the plain [out, in] weight each time it is called; for
decoding (one token per forward) that costs about as much as the product itself. oneDNN can take the weight in its
own layout, prepared once (`torch.ops.mkldnn._reorder_linear_weight`, what torch's inductor CPU backend does for
frozen weights). Measured on SmolLM2-135M in bf16, 1 thread: plain decoding 34.8 -> 54.1 tokens/s, the same tokens
(docs/results/serving.md, "draftforge's AR against vLLM's plain decoding").

The contract is speed only: `pack_linears` packs a layer only where the packed product equals `F.linear`
bitwise on probe inputs of one and of several rows (checked per layer, at load), so every logit stays what the
unpacked model computes. fp32 is never packed (plain fp32 linears go through another library whose sums differ).
A packed layer keeps its `weight` parameter (state_dict, tied embeddings and code that reads `.weight` are
unchanged) and adds the packed copy: the linears' bytes once more in memory. The copy is not updated if the
weight changes afterwards, so only models loaded for inference are packed.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.bfloat16, torch.float16)
PROBE_ROWS = (1, 5)  # one decoding token; a few (a verified chain or tree)


def packing_unavailable(model: nn.Module) -> str | None:
    """Why `model` cannot be packed here (None when it can)."""
    param = next(model.parameters(), None)
    if param is None:
        return "the model has no parameters"
    if param.device.type != "cpu":
        return f"the model is on {param.device.type}, packing is for CPU"
    if param.dtype not in PACKABLE_DTYPES:
        return f"the model is {str(param.dtype).removeprefix('torch.')}, packing is for bf16/fp16"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN (mkldnn) linear ops"
    return None


class PackedLinear(nn.Module):
    """An nn.Linear whose forward multiplies by a oneDNN-packed copy of its weight (same numbers, see module doc).

    Moved to another dtype or device (`.float()`, `.to(...)`) it drops the packed copy and is a plain linear again
    (the self-check's fp32 copy relies on that); a deep copy repacks its own copied weight."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same parameters, not copies
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or self.weight.dtype != self.packed.dtype:  # (a weight converted behind our back)
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # compared with the packed copy, not with the weight before this call: a weight tied to the embedding has
        # already been converted when the embedding's module was
        if self.packed is not None and (self.weight.dtype != self.packed.dtype or self.weight.device.type != "cpu"):
            self.packed = None  # laid out for the old dtype / device
        return self

    def __deepcopy__(self, memo):
        clone = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        clone.packed = None if self.packed is None else _reorder(clone.weight.detach())  # opaque: cannot be copied
        return clone

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


@contextlib.contextmanager
def unpacked(model):
    """Within the block every PackedLinear of `model` multiplies by its plain weight (transformers' own linear),
    so a forward there runs no draftforge product (the self-check's independent evidence)."""
    mods = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed is not None]
    saved = [m.packed for m in mods]
    for m in mods:
        m.packed = None
    try:
        yield
    finally:
        for m, packed in zip(mods, saved):
            m.packed = packed


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # 1: laid out for few-row inputs (decoding)


def pack_linear(linear: nn.Linear) -> PackedLinear | None:
    """The packed layer, or None where its product would differ from F.linear on the probes."""
    weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    try:
        packed = _reorder(weight)
    except RuntimeError:
        return None
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(1, rows, linear.in_features, generator=gen).to(weight.dtype)
            try:
                same = torch.equal(torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""),
                                   F.linear(x, weight, bias))
            except RuntimeError:
                return None
            if not same:
                return None
    return PackedLinear(linear, packed)


@dataclass
class PackReport:
    packed: int = 0  # layers now PackedLinear
    unequal: int = 0  # nn.Linear layers left as they were: the packed product differed on a probe
    extra_bytes: int = 0  # memory the packed copies add
    skipped: str | None = None  # why nothing was packed

    def describe(self) -> str:
        if self.skipped:
            return f"linear weights not packed: {self.skipped}"
        left = f", {self.unequal} left unpacked (their packed product differed)" if self.unequal else ""
        return (f"linear weights packed for oneDNN: {self.packed} layers, +{self.extra_bytes / 2**20:.0f} MiB{left}")


def pack_linears(model: nn.Module) -> PackReport:
    """Replace every plain nn.Linear of an inference model by its PackedLinear where that changes no number."""
    why = packing_unavailable(model)
    if why is not None:
        return PackReport(skipped=why)
    report = PackReport()
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype not in PACKABLE_DTYPES:
                continue
            packed = pack_linear(child)
            if packed is None:
                report.unequal += 1
                continue
            setattr(module, name, packed)
            report.packed += 1
            report.extra_bytes += child.weight.numel() * child.weight.element_size()
    return report
