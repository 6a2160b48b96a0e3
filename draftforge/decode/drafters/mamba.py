"""Mamba / Mamba2 drafter: O(1) recurrent state, chain and tree drafting by batch expansion.

The prompt is encoded once; afterwards every committed token is fed with the single-token
recurrent step (transformers' Mamba1 multi-token path does not continue from a cached SSM state,
so single steps are also the only correct choice there). Rollback restores the saved state of the
deepest accepted draft node: the prefix is never re-encoded (Mamba Drafters §4.1).

Every single-token step (committed tokens at batch 1, draft depth i at batch B_i) runs on fixed
tensors through a StaticStep (cuda_graphs.py), captured as a CUDA graph when `cuda_graphs` resolves
to on. The live batch-1 state is therefore one persistent buffer: each prompt is encoded eagerly
with a throw-away cache and its states are copied into that buffer.

A Mamba2 drafter encodes a long prompt ssm_state.PROMPT_CHUNK[device] tokens at a time, each forward continuing from
the cache the last one left (transformers' Mamba2 chunk scan takes the cached state as its initial state):
without a fused kernel the scan's intermediates grow with the tokens of one forward. On CPU small chunks
cost less memory and less time (an 8k prompt, bf16: +514 MiB and 972 ms in one forward, +32 MiB and 619 ms
in chunks of 512). On a GPU each chunk is a train of small kernel launches, so chunks are large there (a
4x256 drafter on an H100, bf16: 32k tokens in one forward 25 ms and +1.6 GiB, in chunks of 512 473 ms and
+26 MiB; chunks of 8,192 cost about 4 x 9 ms and +0.4 GiB). Mamba1's multi-token path starts from a zero
state, so a Mamba1 prompt is one forward.

Legend: B nodes at one depth, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftforge.decode.drafters.cuda_graphs import MODES, StaticStep, StepRunner, use_cuda_graphs
from draftforge.decode.drafters.base import Drafter, chain_stops, draft_map, propose_children, stack_q, wants_hidden
from draftforge.decode.memory import tensor_bytes
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.drafters.ssm_state import StateBank, copy_states, layer_states, prompt_chunk
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape
from draftforge.errors import DraftforgeError
from draftforge.hfcompat import cache_kwargs


class MambaDrafter(Drafter):
    kind = "mamba"
    follows_dynamic_trees = True

    def __init__(self, model, vocab_size: int, tokenizer=None, cuda_graphs: str = "auto", graph_factory=None):
        """cuda_graphs: "auto" (graphs when the model is on CUDA), "on" (CUDA required) or "off".

        graph_factory replaces cuda_graphs.CudaGraph on any device (tests replay a CPU stand-in); with
        it, every mode but "off" graphs.
        """
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.d2t = draft_map(model, vocab_size)
        if graph_factory is None:
            self.cuda_graphs = use_cuda_graphs(cuda_graphs, model.device)  # True/False: graphs in use
        else:  # a stand-in graph runs on any device: every mode but "off" graphs
            if cuda_graphs not in MODES:
                raise DraftforgeError(f"cuda_graphs must be one of {', '.join(MODES)}, got {cuda_graphs!r}")
            self.cuda_graphs = cuda_graphs != "off"
        self.runner = StepRunner(model, self.cuda_graphs, graph_factory)
        self.live_step: StaticStep | None = None  # batch-1 step over the persistent live state
        # per tree shape (keyed by its widths, else its parent lists), kept across prompts: its state
        # buffers and one step per fed depth (1..γ-1)
        self.banks: dict[tuple, StateBank] = {}
        self.depth_steps: dict[tuple, list[StaticStep | None]] = {}
        self.dyn_steps: dict[tuple[int, int], StaticStep] = {}  # dynamic trees: one step per (depth, batch)
        # tokens per forward of a prompt's encode (None: one forward; see the module docstring)
        self.prompt_chunk = prompt_chunk(model.device) if model.config.model_type == "mamba2" else None
        self.reset()

    def reset(self) -> None:
        self.encoded = False
        self.consumed = 0  # committed tokens folded into the live state
        self.last_logits_V = self.last_hidden_D = None

    def cache_bytes(self) -> int:
        """The live batch-1 state (conv + SSM per layer): the same at any context. The tree banks, kept across
        prompts per tree shape, are not counted."""
        return 0 if self.live_step is None else tensor_bytes(self.live)

    @property
    def cache(self):
        """The cache over the live batch-1 state (what the model would read for the next committed token)."""
        return None if self.live_step is None else self.live_step.cache

    @property
    def live(self):
        return self.live_step.states

    def _encode_prompt(self, seq: list[int], hidden: bool = False) -> torch.Tensor:
        """Multi-token encode with a throw-away cache (eager; in forwards of `prompt_chunk` tokens when set), then
        copy its states into the live buffer."""
        prompt_cache = DynamicCache(config=self.model.config)
        ids_1T = torch.tensor([seq], device=self.model.device)
        step = self.prompt_chunk or len(seq)
        for start in range(0, len(seq), step):
            out = self.model(input_ids=ids_1T[:, start : start + step], use_cache=True, logits_to_keep=1,
                             output_hidden_states=hidden and start + step >= len(seq),
                             **cache_kwargs(self.model, prompt_cache))
        logits_V = out.logits[0, -1]
        self.last_hidden_D = out.hidden_states[-1][0, -1] if hidden else None
        states = layer_states(prompt_cache)
        if self.live_step is None:  # allocated once, so a graph captured over it stays valid
            self.live_step = self.runner.step_over([(conv.clone(), ssm.clone()) for conv, ssm in states])
        else:
            copy_states(self.live_step.states, states)
        return logits_V

    @torch.inference_mode()
    def _sync(self, seq: list[int], hidden: bool = False) -> torch.Tensor:
        """Fold unseen committed tokens into the live state; return logits after seq[-1] (with `hidden`,
        the final-normed hidden state there is kept in `last_hidden_D`)."""
        if not self.encoded:
            self.last_logits_V, self.encoded = self._encode_prompt(seq, hidden), True
        else:
            for tok in seq[self.consumed :]:
                out = self.live_step(int(tok), hidden=hidden)
                self.last_logits_V, self.last_hidden_D = (out[0][0], out[1][0]) if hidden else (out[0], None)
        self.consumed = len(seq)
        return self.last_logits_V

    def _bank(self, shape: TreeShape) -> tuple[StateBank, list[StaticStep | None]]:
        """Buffers and steps for `shape`. A prefix of a shape already seen (the engine cuts the last
        rounds of a prompt short) reuses its buffers: depth i only depends on layers 1..i+1, and no
        new graph gets captured inside a timed run."""
        key = shape.widths or shape.layers
        if key not in self.banks:
            key = next((k for k, bank in self.banks.items() if bank.shape.layers[: shape.depth] == shape.layers), key)
        if key not in self.banks:
            bank = self.banks[key] = StateBank(shape, self.live)
            self.depth_steps[key] = [None] + [self.runner.step_over(buf) for buf in bank.buffers[1:]]
        return self.banks[key], self.depth_steps[key]

    @torch.inference_mode()
    def draft_levels(self, seq, shape: TreeShape, params: SamplingParams, generator, stop=None) -> DraftTree:
        hidden = wants_hidden(stop)  # chains only: a stop rule that reads the hidden state
        logits_BV = self._sync(seq, hidden)[None]
        hidden_D = self.last_hidden_D if hidden else None
        self.bank, steps = self._bank(shape)
        self.bank.save_root(self.live)
        device, levels, q_rows = logits_BV.device, [], []
        for depth in range(1, shape.depth + 1):
            children_BW, q_BV = propose_children(logits_BV, shape.branch[depth - 1], params, self.vocab_size,
                                                 generator, self.d2t)
            take = shape.index("take", depth, device)
            levels.append(children_BW.flatten() if take is None else children_BW.flatten()[take])
            q_rows.append(q_BV)
            if depth == shape.depth or chain_stops(stop, depth, children_BW, logits_BV, q_BV, hidden_D,
                                                   self.vocab_size, self.d2t):
                break
            self.bank.expand(depth)
            feed = shape.index("feed", depth, device)
            logits_BV = steps[depth]((levels[-1] if feed is None else levels[-1][feed]).reshape(-1, 1), hidden=hidden)
            if hidden:
                logits_BV, hidden_D = logits_BV[0], logits_BV[1][0]
        self.shape = shape.capped(len(levels))  # what accept() rolls back over (a stop rule may end early)
        # Tokens stay on the device while drafting, so the steps queue without waiting; read them once here.
        tokens, parents, depths = shape.flatten([level.tolist() for level in levels])
        q_probs = None if params.greedy else stack_q(q_rows, len(tokens), shape)
        return DraftTree(tokens, parents, depths, q_probs, is_chain=shape.is_chain)

    @torch.inference_mode()
    def accept_levels(self, path: list[int]) -> None:
        """Restore the state after the deepest accepted node that was fed (one with children)."""
        fed = self.shape.fed_prefix(path)
        if fed > 0:  # fed == 0: the live state was not stepped while drafting, nothing to restore
            self.bank.restore(self.live, fed, self.shape.fed_row(path[fed - 1], fed))
        self.consumed = self.consumed + fed

    # ---- node interface (dynamic trees): per-(depth, batch) state buffers, allocated once and reused

    @torch.inference_mode()
    def begin(self, seq: list[int]) -> torch.Tensor:
        logits_1V = self._sync(seq)[None]
        self.node_slot: dict[int, tuple[tuple[int, int], int]] = {}  # node -> ((depth, batch) buffer, row)
        self.depth_of: dict[int, int] = {}
        return logits_1V

    def _dyn_step(self, depth: int, batch: int) -> StaticStep:
        key = (depth, batch)
        if key not in self.dyn_steps:
            self.dyn_steps[key] = self.runner.step_over(
                [(conv.new_zeros((batch, *conv.shape[1:])), ssm.new_zeros((batch, *ssm.shape[1:])))
                 for conv, ssm in self.live])
        return self.dyn_steps[key]

    @torch.inference_mode()
    def feed(self, parents: list[int], tokens: list[int], nodes: list[int]) -> torch.Tensor:
        """Step the new nodes (all at one depth) from copies of their parents' states."""
        depth = 1 if parents[0] == -1 else self.depth_of[parents[0]] + 1
        step = self._dyn_step(depth, len(nodes))
        if depth == 1:
            source, rows = self.live, [0] * len(nodes)
        else:
            key = self.node_slot[parents[0]][0]
            source, rows = self.dyn_steps[key].states, [self.node_slot[p][1] for p in parents]
        index_B = torch.tensor(rows, device=self.model.device)
        for (conv_buf, ssm_buf), (conv_src, ssm_src) in zip(step.states, source):
            torch.index_select(conv_src, 0, index_B, out=conv_buf)
            torch.index_select(ssm_src, 0, index_B, out=ssm_buf)
        for row, node in enumerate(nodes):
            self.node_slot[node], self.depth_of[node] = ((depth, len(nodes)), row), depth
        return step(torch.tensor(tokens, device=self.model.device).reshape(-1, 1))

    @torch.inference_mode()
    def accept_nodes(self, nodes: list[int]) -> None:
        fed = [n for n in nodes if n in self.node_slot]
        if fed:
            key, row = self.node_slot[fed[-1]]
            copy_states(self.live, [(c[row : row + 1], s[row : row + 1]) for c, s in self.dyn_steps[key].states])
        self.consumed += len(fed)
