"""Static-buffer decode steps for SSM drafters, replayed as CUDA graphs on CUDA (Mamba Drafters §4.1).

A CUDA graph replays recorded kernels on the exact addresses they touched at capture, so a graphed
step must read and write only tensors that never move. transformers (5.x) Mamba/Mamba2 single-token
steps qualify: they read `cache.layers[i].conv_states[0]` / `recurrent_states[0]` and update both
in place (`causal_conv1d_update` and `selective_state_update` `copy_` into the state, on the torch
path and in the causal-conv1d / mamba-ssm kernels alike). A `StaticStep` therefore owns, for one
batch size, fixed input ids, fixed per-layer state tensors (a private cache points at them once) and,
when graphed, the fixed logits the graph writes. Tree drafting by batch expansion knows its batch
sizes B_i = N1·…·N_i in advance, so each (configuration, depth) gets one StaticStep, captured once.

The eager mode runs the very same static-buffer code without a graph, and `graph_factory` lets a
test substitute a CPU stand-in whose replay re-executes the captured call.

Off CUDA, a Mamba2's step is models.mamba2_step.Mamba2Step (same states, stepped in place) instead of
transformers' forward, whose torch path is mostly op overhead at drafter sizes; CUDA keeps
transformers (its kernels, and the graphs above).

Legend: B batch (tree nodes at one depth), V vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import Mamba2ForCausalLM

from draftforge.errors import DraftforgeError
from draftforge.hfcompat import cache_kwargs
from draftforge.models.mamba2_step import Mamba2Step, States, cache_over

MODES = ("auto", "on", "off")


def use_cuda_graphs(mode: str, device: torch.device) -> bool:
    """Resolve a cuda_graphs mode for a model on `device`: auto = on exactly when it is on CUDA."""
    if mode not in MODES:
        raise DraftforgeError(f"cuda_graphs must be one of {', '.join(MODES)}, got {mode!r}")
    on_cuda = torch.device(device).type == "cuda"
    if mode == "on" and not on_cuda:
        raise DraftforgeError(
            f"cuda_graphs='on' needs the drafter on a CUDA device, but it is on {device}; "
            "use cuda_graphs='auto' or 'off' (--cuda-graphs auto|off), or load the drafter with device='cuda'"
        )
    return mode == "on" or (mode == "auto" and on_cuda)


class CudaGraph:
    """torch.cuda.CUDAGraph behind the two calls StaticStep needs: capture(fn) -> output, replay()."""

    def __init__(self, warmup_iters: int = 3):
        self.warmup_iters, self.graph = warmup_iters, None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm-up on a side stream before capture, as the PyTorch CUDA-graph docs require (lazy
        # initialisation, cuBLAS workspaces and autotuning must not happen inside the capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


def lean_step_for(model) -> Mamba2Step | None:
    """The lean step for a Mamba2 off CUDA; None (transformers' forward) for anything else."""
    if isinstance(model, Mamba2ForCausalLM) and model.device.type != "cuda":
        return Mamba2Step(model)
    return None


class StaticStep:
    """One batch size's single-token step: ids [B,1] in, logits [B,V] out, `states` stepped in place.

    lean: "auto" (lean_step_for(model)), a Mamba2Step to share, or None to force transformers' forward.
    """

    def __init__(self, model, states: States, graph=None, lean: Mamba2Step | str | None = "auto"):
        self.model, self.states, self.graph = model, states, graph
        self.lean = lean_step_for(model) if lean == "auto" else lean
        batch = states[0][0].shape[0]
        self.ids_B1 = torch.zeros((batch, 1), dtype=torch.long, device=states[0][0].device)
        self.cache = cache_over(model.config, states)
        self.logits_BV = None  # the graph's static output, set at capture

    def static_tensors(self) -> list[torch.Tensor]:
        return [self.ids_B1] + [t for pair in self.states for t in pair]

    def _run(self, hidden: bool = False):
        """logits [B,V]; with `hidden`, (logits, final-normed hidden state [B,D])."""
        if self.lean is not None:
            return self.lean(self.ids_B1, self.states, return_hidden=hidden)
        out = self.model(input_ids=self.ids_B1, use_cache=True, output_hidden_states=hidden,
                         **cache_kwargs(self.model, self.cache))
        return (out.logits[:, -1], out.hidden_states[-1][:, -1]) if hidden else out.logits[:, -1]

    @torch.inference_mode()
    def _capture(self) -> None:
        # warm-up runs really step the states: keep the caller's values and put them back afterwards
        saved = [(conv.clone(), ssm.clone()) for conv, ssm in self.states]
        self.logits_BV = self.graph.capture(self._run)
        for (conv, ssm), (conv0, ssm0) in zip(self.states, saved):
            conv.copy_(conv0)
            ssm.copy_(ssm0)

    @torch.inference_mode()
    def __call__(self, tokens_B1: torch.Tensor | int, hidden: bool = False):
        """Step every row with its token; graphed, the result is the static output (valid until the next call).

        With `hidden`, (logits, hidden [B,D]), run eagerly on the same static states (the graph records logits only)."""
        if isinstance(tokens_B1, int):
            self.ids_B1.fill_(tokens_B1)  # no host tensor, no host-to-device copy for committed tokens
        else:
            self.ids_B1.copy_(tokens_B1)
        if self.graph is None or hidden:
            return self._run(hidden)
        if self.logits_BV is None:
            self._capture()
        self.graph.replay()
        return self.logits_BV


class StepRunner:
    """Makes the StaticSteps of one drafter, all eager or all graphed."""

    def __init__(self, model, graphed: bool, graph_factory: Callable[[], object] | None = None):
        self.model, self.graphed = model, graphed
        self.graph_factory = graph_factory or CudaGraph
        self.steps: list[StaticStep] = []  # every step made, for inspection
        self.lean = lean_step_for(model)  # packed once, shared by every step

    def step_over(self, states: States) -> StaticStep:
        step = StaticStep(self.model, states, self.graph_factory() if self.graphed else None, lean=self.lean)
        self.steps.append(step)
        return step
