"""The Drafter contract and what every drafter shares: child proposal, q rows, the stop check.

A drafter returns a DraftTree for the committed sequence and a draft plan (plan.py), then is told which root
path the target accepted. It is bound to the target that verifies it when it is loaded (`bind`; `target` then
names that target, which `build_decoder` uses). What a drafter can do beyond static trees and chains is declared
as a capability flag on its class (`follows_dynamic_trees`, `reads_target_hidden`), never probed with hasattr.

Legend: B rows (tree nodes at one depth), W children per node, V vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from draftforge.decode.plan import DraftStep, DynamicTree, StaticTree, StopRule, StoppableChain, as_plan
from draftforge.decode.sampling import SamplingParams, match_vocab, probs_from_logits, sample
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape


class Drafter(ABC):
    """Base class: `draft` proposes a tree for `seq`, `accept(path)` rolls state to the accepted prefix.

    Required: `reset`, `draft_levels`, `accept_levels`. Capabilities (class flags the harness reads):
    - `follows_dynamic_trees`: implements `begin` / `feed` / `accept_nodes`, so any TreeBuilder (EAGLE-2, C2T)
      can grow its trees node by node;
    - `reads_target_hidden`: reads the target's hidden states of the verified positions (`bind` sets
      `target.want_hidden`; the verification then carries them in `target.last`).
    """

    kind = "abstract"  # "mamba", "transformer", ... (hf_assisted needs "transformer")
    follows_dynamic_trees: ClassVar[bool] = False
    reads_target_hidden: ClassVar[bool] = False
    cuda_graphs: bool | None = None  # decode steps captured as CUDA graphs (Mamba drafters; None: not applicable)
    model = None
    tokenizer = None
    target = None  # the Target this drafter serves, once bound
    vocab_size: int  # the target's vocabulary width that drafts and q distributions use
    node_map: list[int] | None = None  # after a dynamic draft: tree index -> the drafter's own node id
    d2t = None  # reduced draft vocabulary: target ids of the head's rows (LongTensor on the model's device)
    # hidden_D a chain's stop rule gets at depth i: False = the state whose logits chose draft i; True = the
    # state after consuming draft i (the early-exit drafter; docs/methods/cali-ts.md §4). The θ harvest reads it
    # the same way.
    hidden_after_token = False

    def bind(self, target) -> None:
        """Serve `target`: the target whose verification this drafter's drafts get (load_drafter calls this)."""
        self.target = target
        if self.reads_target_hidden:
            target.want_hidden = True

    def attach(self, target):
        """Pair with `target` and return the Target that verifies this drafter's drafts (bound): `target` itself
        for most drafters; an EESD head verifies through the early-exit split of the same model."""
        self.bind(target)
        return target

    @abstractmethod
    def reset(self) -> None:
        """Forget all state (a new prompt starts)."""

    def check_context(self, positions: int) -> None:
        """Called before a decode that may reach `positions` tokens of context (prompt + max_new_tokens): raise a
        DraftforgeError where this drafter cannot run that far. Default: no limit (state-space drafters, lookup)."""

    def cache_bytes(self) -> int | None:
        """Bytes of the committed context's cache or state held now (not a round's tree); None where a drafter
        keeps none worth counting (prompt lookup) or does not say."""
        return None

    def draft(self, seq: list[int], plan, params: SamplingParams, generator) -> DraftTree:
        """Propose a tree continuing `seq` (prompt + committed tokens) as `plan` says (a plan of plan.py, or
        widths / a TreeShape = a static tree)."""
        plan = as_plan(plan)
        self.node_map = None
        if isinstance(plan, StaticTree):
            return self.draft_levels(seq, plan.tree, params, generator)
        if isinstance(plan, StoppableChain):
            plan.stop.start_round()
            return self.draft_levels(seq, TreeShape.from_widths((1,) * plan.max_len), params, generator,
                                     stop=plan.stop)
        if isinstance(plan, DynamicTree):
            from draftforge.decode.dynamic import draft_dynamic

            return draft_dynamic(self, seq, plan, params, generator)
        raise TypeError(f"unknown draft plan {plan!r}")

    @abstractmethod
    def draft_levels(self, seq: list[int], shape: TreeShape, params: SamplingParams, generator,
                     stop: StopRule | None = None) -> DraftTree:
        """A static tree of that shape (the r-th child of a node takes its r-th ranked token); with `stop`
        (chains), end after any token it says."""

    def accept(self, path: list[int]) -> None:
        """The target accepted these nodes (root path, depth 1 first) of the last draft."""
        if self.node_map is not None:
            nodes, self.node_map = [self.node_map[j] for j in path], None
            self.accept_nodes(nodes)
        else:
            self.accept_levels(path)

    @abstractmethod
    def accept_levels(self, path: list[int]) -> None:
        """accept() after draft_levels."""

    # ---- dynamic trees (decode/dynamic.py): implemented where follows_dynamic_trees is True

    def begin(self, seq: list[int]) -> torch.Tensor:
        """The root's next-token logits [1, V'] after syncing to `seq`."""
        raise NotImplementedError(f"the {self.kind} drafter does not follow dynamic trees")

    def feed(self, parents: list[int], tokens: list[int], nodes: list[int]) -> torch.Tensor:
        """Feed new nodes (their parents were fed before; -1 = root) -> their next-token logits [B, V']."""
        raise NotImplementedError(f"the {self.kind} drafter does not follow dynamic trees")

    def accept_nodes(self, nodes: list[int]) -> None:
        """Roll back to the accepted root path, given as this drafter's own node ids."""
        raise NotImplementedError(f"the {self.kind} drafter does not follow dynamic trees")

    @property
    def steps_per_draft(self) -> str:
        return "one drafter forward per depth"

    @torch.inference_mode()
    def teacher_forced(self, ids_1S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the target's vocabulary [S, V], final-normed hidden states [S, D]) at every position of
        a whole sequence in one pass: what drafting sees when all earlier tokens were accepted (the θ harvest).
        The default runs `model` as a HF causal LM; a drafter built otherwise overrides it."""
        out = self.model(input_ids=ids_1S.to(self.model.device), output_hidden_states=True)
        return match_vocab(out.logits[0].float(), self.vocab_size, self.d2t), out.hidden_states[-1][0].float()


def propose_children(logits_BV: torch.Tensor, width: int, params: SamplingParams, vocab: int, generator,
                     d2t=None):
    """Children tokens [B, width] and, at T>0, the distribution q [B, V] they were drawn from.

    Greedy: the `width` most likely distinct tokens. T>0: draws from q, distinct (without replacement,
    STree's and SpecExec's sampling) or i.i.d. (SpecInfer §4.2) as `params.tree_draws` says; the tree
    verifier applies the matching rule, so both stay lossless. A reduced draft head's logits are first
    scattered into the target's vocabulary (q is zero outside the draft vocabulary).
    """
    logits_BV = match_vocab(logits_BV, vocab, d2t)
    if params.greedy:
        return torch.topk(logits_BV, width, dim=-1).indices, None
    q_BV = probs_from_logits(logits_BV, params)
    children_BW = sample(q_BV.to(generator.device), generator, width, distinct=params.tree_draws == "distinct")
    return children_BW.to(logits_BV.device), q_BV


def propose_level(shape: TreeShape, depth: int, logits_BV: torch.Tensor, params: SamplingParams, vocab: int,
                  generator, d2t=None):
    """One depth of a static tree: (children [B, W] of the fed nodes at depth - 1, their q [B, V] at T > 0, the
    depth's tokens in breadth-first order: the r-th child of a node takes its r-th ranked token)."""
    children_BW, q_BV = propose_children(logits_BV, shape.branch[depth - 1], params, vocab, generator, d2t)
    flat, take = children_BW.flatten().tolist(), shape.take_list(depth)
    return children_BW, q_BV, flat if take is None else [flat[i] for i in take]


def draft_map(model, target_vocab: int):
    """The d2t map of a reduced-vocabulary drafter on its device (checked against the target), else None."""
    from draftforge.models.draft_vocab import check_map, d2t_of

    d2t = d2t_of(model)
    if d2t is None:
        return None
    check_map(d2t.tolist(), target_vocab)
    return d2t.to(model.device)


def wants_hidden(stop: StopRule | None) -> bool:
    """Whether a chain's stop rule reads the drafter's hidden state (else the drafter skips computing it)."""
    return stop is not None and stop.wants_hidden


def chain_stops(stop: StopRule | None, depth: int, children_BW: torch.Tensor, logits_BV: torch.Tensor,
                q_BV: torch.Tensor | None, hidden_D: torch.Tensor | None = None, vocab: int | None = None,
                d2t=None) -> bool:
    """Ask a chain's stop rule about the token just drafted at `depth` (no rule: never stop).

    Give `vocab` (and a reduced head's `d2t`): the token is a target id, so the logits the rule sees are
    mapped into the target's vocabulary first, as propose_children did."""
    if stop is None:
        return False
    token = int(children_BW[0, 0])
    if vocab is not None:
        logits_BV = match_vocab(logits_BV, vocab, d2t)
    probs_V = q_BV[0] if q_BV is not None else logits_BV[0].float().softmax(-1)
    return stop.should_stop(DraftStep(depth, token, logits_BV[0], float(probs_V[token]), hidden_D))


def stack_q(q_rows: list[torch.Tensor], n_nodes: int, shape: TreeShape | None = None) -> torch.Tensor:
    """Rows: root then node j's child distribution at 1+j (leaves left zero). Depth d's q_BV holds one row
    per node at depth d (every node has children), or, given the TreeShape, one per fed node only."""
    vocab = q_rows[0].shape[-1]
    q_probs = q_rows[0].new_zeros(1 + n_nodes, vocab)
    row = 0  # q row of the first node at this depth
    for depth, q_BV in enumerate(q_rows):
        fed = shape.feed_list(depth) if shape is not None and depth > 0 else None
        if fed is None:
            q_probs[row : row + q_BV.shape[0]] = q_BV
            row += q_BV.shape[0]
        else:
            q_probs[torch.tensor([row + k for k in fed], device=q_probs.device)] = q_BV
            row += shape.nodes_at(depth)
    return q_probs
