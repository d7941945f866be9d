"""Replay many prompts at once: what evaluation runs (replay.py is the one-prompt reference).

A slot holds one prompt. Its drafter context K/V is computed once, for every stored position, into a
preallocated cache (`ContextCache`), and every policy (chain, then DDTree-N per budget) replays it
as a lane of the slot with its own next block start. A round drafts one block for every lane of
every busy slot in a single forward: a slot is laid out as a training row whose anchors are its
lanes' starts ([context | one block per lane], each block seeing the context strictly before its
start: masks.allowed), so the cache is shared by all policies. What the host needs from a round
(chain drafts; per depth the DDTree top-K log-probs and ids) leaves the device in one copy. A slot
whose lanes are all done takes the next prompt. Per prompt only counts are kept: rounds, tokens and
the histogram of accepted drafts per policy (the chain's rounds too for the prompts asked for).

With a temperature (the samples carry their final states), each chain round also adds the tokens it
would commit in expectation under speculative sampling at that temperature, drafted from the same
block (pipeline/decode/sampled_acceptance.py): the rounds, and so the blocks' starts, stay greedy's.
A dspark drafter's slot i then has the transition bias of the reference's token at slot i-1, as the
target's p there is conditioned on the reference (the along-the-reference reading of
sampled_acceptance.py, applied to the drafter's side alike).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.decode import ddtree
from pipeline.decode.acceptance import CONTEXT_LABELS, accepted, context_bucket, round_tokens
from pipeline.decode.sampled_acceptance import (
    draft_acceptance,
    expected_tokens,
    expected_tokens_low,
    reference_acceptance,
    slot_acceptance,
)
from pipeline.drafter import masks
from pipeline.drafter.model import Drafter
from pipeline.errors import DrafterError
from store.shard_reader import Sample

# DDTree builds its tree from per-depth top-K lists independent of the path; a dspark drafter's slot k
# depends on the token chosen at slot k-1, so each branch would need its own distribution.
DDTREE_REFUSED = (
    "--ddtree: a dspark drafter drafts slot after slot (each slot's logits depend on the token before "
    "it), which DDTree's per-depth top-K tree does not model; pass --ddtree none"
)


@dataclass
class PromptCounts:
    """One prompt's replay, per policy (0: chain, 1+i: DDTree-budgets[i])."""

    shard: int
    index: int
    row_id: int
    prompt_len: int
    completion_len: int
    rounds: list[int]
    tokens: list[int]
    chain_rounds: list[tuple[int, int]] | None = None  # (accepted, committed) per round, when kept
    # per policy and context bucket (acceptance.CONTEXT_EDGES): rounds, and tokens committed in them
    context_rounds: list[list[int]] = field(default_factory=list)
    context_tokens: list[list[int]] = field(default_factory=list)
    sampled_tokens: float | None = None  # with a temperature: the chain rounds' expected tokens under sampling
    sampled_low: float | None = None  # and their lower bound (sampled_acceptance.expected_tokens_low)
    greedy_drafts: float | None = None  # and with greedy drafts verified at the temperature (draft_acceptance)

    def tau(self, lane: int) -> float:
        """Mean tokens per round of policy `lane` (NaN without a round)."""
        return self.tokens[lane] / self.rounds[lane] if self.rounds[lane] else float("nan")


class ContextCache:
    """Per slot and layer the drafter's context K/V of every position: [slots, kv_heads, capacity, d],
    allocated once; a slot is overwritten when it takes its next prompt."""

    def __init__(self, m: Drafter, slots: int, capacity: int) -> None:
        a, w = m.layers[0].self_attn, m.fc.weight
        shape = (slots, a.kv_heads, capacity, a.head_dim)
        self.m, self.capacity = m, capacity
        # zeros, not empty: keys past a slot's length are masked, but a NaN there would still poison SDPA
        self.k = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in m.layers]
        self.v = [torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in m.layers]

    @torch.no_grad()
    def fill(self, slot: int, hidden: torch.Tensor) -> None:
        """hidden: [T, n_taps, H] bf16, the states of positions 0..T-1 (T <= capacity)."""
        T, dev = hidden.shape[0], self.m.fc.weight.device
        kv = self.m.context_kv(self.m.context(hidden[None].to(dev)), torch.arange(T, device=dev)[None])
        for layer, (k, v) in enumerate(kv):  # k, v: [1, kv_heads, T, d]
            self.k[layer][slot, :, :T] = k[0]
            self.v[layer][slot, :, :T] = v[0]

    def rows(self, slots: np.ndarray, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of the given slots' first `length` positions: [len(slots), kv_heads, length, d];
        views when every slot is asked for in order, else gathered."""
        if len(slots) == self.k[0].shape[0]:  # slots are ascending and unique: all of them
            return [(k[:, :, :length], v[:, :, :length]) for k, v in zip(self.k, self.v)]
        index = torch.as_tensor(slots, device=self.k[0].device)
        return [(k[index, :, :length], v[index, :, :length]) for k, v in zip(self.k, self.v)]


class BatchReplay:
    """Replays samples `slots` at a time under chain drafting plus one DDTree per budget."""

    def __init__(
        self,
        m: Drafter,
        budgets: tuple[int, ...],
        slots: int,
        capacity: int,
        max_rounds: int | None = None,
        temperature: float | None = None,
    ) -> None:
        """temperature: also the chain's expected tokens under speculative sampling at it (the samples
        must carry their final states)."""
        if budgets and m.config.head == "dspark":
            raise DrafterError(DDTREE_REFUSED)
        self.m, self.budgets, self.max_rounds, self.temperature = m, tuple(budgets), max_rounds, temperature
        self.B = m.config.block_size
        self.P = 1 + len(self.budgets)
        self.k = [min(b, m.config.vocab_size) for b in self.budgets]  # top-K per depth per tree
        self.cache = ContextCache(m, slots, capacity)
        self.samples: list[Sample | None] = [None] * slots
        self.start = np.zeros((slots, self.P), np.int64)  # each lane's next block start
        self.active = np.zeros((slots, self.P), bool)
        self.counts: list[PromptCounts | None] = [None] * slots
        self.histogram = [[0] * self.B for _ in range(self.P)]  # [P][B]: rounds by accepted drafts, per policy
        self.alpha: dict[int, np.ndarray] = {}  # with a temperature, per slot this round's chain acceptances [3, D]

    def run(self, samples: Iterable[Sample], keep_rounds: set[tuple[int, int]] = frozenset()) -> Iterator[PromptCounts]:
        """Each sample's counts, as its prompt finishes (not in input order). keep_rounds: (shard,
        index) of the prompts whose chain rounds are kept."""
        self.todo, self.keep = iter(samples), keep_rounds
        for slot in range(len(self.samples)):
            yield from self._fill(slot)
        while self.active.any():
            for slot in self._round():
                yield self.counts[slot]
                yield from self._fill(slot)

    def _fill(self, slot: int) -> Iterator[PromptCounts]:
        """Give the slot the next sample that needs a round; one that needs none (a one-token
        completion: the prefill made it) is done at once. The slot idles when none is left."""
        self.samples[slot], self.active[slot] = None, False
        for s in self.todo:
            self._take(slot, s)
            if self.active[slot].any():
                return
            yield self.counts[slot]
        self.samples[slot] = None

    def _take(self, slot: int, s: Sample) -> None:
        T, P = len(s.tokens), s.prompt_len
        if T > self.cache.capacity:
            raise ValueError(f"sample ({s.shard}, {s.index}) has {T} tokens, the cache holds {self.cache.capacity}")
        assert self.temperature is None or s.final_state is not None, "a temperature needs the final states"
        self.samples[slot] = s
        self.cache.fill(slot, s.hidden)
        self.start[slot] = P
        self.active[slot] = P < T - 1
        buckets = len(CONTEXT_LABELS)
        self.counts[slot] = PromptCounts(
            s.shard,
            s.index,
            s.row_id,
            P,
            T - P,
            [0] * self.P,
            [0] * self.P,
            [] if (s.shard, s.index) in self.keep else None,
            [[0] * buckets for _ in range(self.P)],
            [[0] * buckets for _ in range(self.P)],
            None if self.temperature is None else 0.0,
            None if self.temperature is None else 0.0,
            None if self.temperature is None else 0.0,
        )

    @torch.no_grad()
    def _round(self) -> list[int]:
        """One block for every live lane of every busy slot -> the slots whose prompt finished."""
        busy = np.flatnonzero(self.active.any(1))
        lanes = [np.flatnonzero(self.active[slot]) for slot in busy]  # live lanes, packed left per slot
        host = self._draft(busy, lanes)
        self.alpha = {key[0]: host.pop(key) for key in [k for k in host if k[1] == "alpha"]}  # slot -> [3, D]
        finished = []
        for slot, live in zip(busy, lanes):
            s, c = self.samples[slot], self.counts[slot]
            for lane in live:
                self._advance(slot, lane, s, c, self._accepted(host[slot, lane], lane, s, int(self.start[slot, lane])))
            if not self.active[slot].any():
                finished.append(int(slot))
        return finished

    def _advance(self, slot: int, lane: int, s: Sample, c: PromptCounts, acc: int) -> None:
        start, T = int(self.start[slot, lane]), len(s.tokens)
        n = round_tokens(acc, T - 1 - start)
        c.rounds[lane] += 1
        c.tokens[lane] += n
        c.context_rounds[lane][context_bucket(start)] += 1
        c.context_tokens[lane][context_bucket(start)] += n
        self.histogram[lane][min(acc, self.B - 1)] += 1
        if lane == 0 and c.chain_rounds is not None:
            c.chain_rounds.append((acc, n))
        if lane == 0 and c.sampled_tokens is not None:
            alpha, on_reference, greedy = self.alpha.pop(slot)
            c.sampled_tokens += expected_tokens(alpha, T - 1 - start)
            c.sampled_low += expected_tokens_low(alpha, on_reference, T - 1 - start)
            c.greedy_drafts += expected_tokens(greedy, T - 1 - start)
        self.start[slot, lane] = start + n
        if start + n >= T - 1 or (self.max_rounds is not None and c.rounds[lane] >= self.max_rounds):
            self.active[slot, lane] = False

    def _accepted(self, result, lane: int, s: Sample, start: int) -> int:
        """result: the chain's drafts [D], or a tree's per-depth (values [D, k], ids [D, k])."""
        target = s.tokens[start + 1 : start + self.B].tolist()
        if lane == 0:
            return accepted(result.tolist(), target)
        vals, ids = result
        return ddtree.accept_top(vals.tolist(), ids.tolist(), self.budgets[lane - 1], target)

    def _draft(self, busy: np.ndarray, lanes: list[np.ndarray]) -> dict:
        """The forward of one round: busy slot r drafts a block per live lane, as anchors of row r
        ([K, W] with W the most live lanes of a slot, the rest invalid); logits only for live lanes;
        then the round's one device-to-host copy -> {(slot, lane): result}, and with a temperature
        {(slot, "alpha"): each chain slot's acceptance under sampling, on the reference and of its greedy draft
        [3, D]}."""
        m, B, dev = self.m, self.B, self.m.fc.weight.device
        K, W = len(busy), max(len(live) for live in lanes)
        starts, valid = np.zeros((K, W), np.int64), np.zeros((K, W), bool)
        tokens = np.zeros((K, W), np.int64)
        for r, (slot, live) in enumerate(zip(busy, lanes)):
            starts[r, : len(live)], valid[r, : len(live)] = self.start[slot, live], True
            tokens[r, : len(live)] = self.samples[slot].tokens[starts[r, : len(live)]].numpy()
        ctx_len = int(starts[valid].max())  # keys at or past every live start are never seen
        anchors = torch.as_tensor(starts, device=dev)
        ids = torch.full((K, W, B), m.config.mask_token_id, dtype=torch.long, device=dev)
        ids[..., 0] = torch.as_tensor(tokens, device=dev)
        positions = (anchors[..., None] + torch.arange(B, device=dev)).view(K, W * B)
        mk = masks.build(m.rules, anchors, torch.as_tensor(valid, device=dev), ctx_len, B, "dense")
        h = m.run_block(self.cache.rows(busy, ctx_len), ids.view(K, W * B), positions, mk)
        h = h.view(K * W, B, -1)[:, 1:]  # [K*W, D, H]: slots 1..B-1 of each block
        where = {lane: [] for lane in range(self.P)}  # per policy: (slot, row of h)
        for r, (slot, live) in enumerate(zip(busy, lanes)):
            for j, lane in enumerate(live):
                where[lane].append((int(slot), r * W + j))
        parts = []
        for lane, k in enumerate((None, *self.k)):
            if not where[lane]:
                continue
            rows = torch.as_tensor([i for _, i in where[lane]], device=dev)
            if k is None and self.temperature is not None:
                logits = m.logits(h[rows])  # [n, D, V]
                drafts = m.drafts_of(logits, ids.view(K * W, B)[rows, 0])  # [n, D] chain drafts
                parts += [drafts, self._acceptance(logits, [slot for slot, _ in where[lane]], drafts)]  # [n, 3, D]
            elif k is None:  # [n, D] chain drafts (a dspark drafter's slot after slot, from each anchor)
                parts.append(m.chain_drafts(h[rows], ids.view(K * W, B)[rows, 0]))
            else:
                logits = m.logits(h[rows])  # [n, D, V]
                parts += ddtree.top_k_device(ddtree.slot_logprobs(logits.flatten(0, 1)), k)  # [n*D, k] twice
        flat = torch.cat([p.flatten().double() for p in parts]).cpu().numpy() if parts else np.zeros(0)  # one copy
        return self._unpack(flat, where)

    def _acceptance(self, logits: torch.Tensor, slots: list[int], drafts: torch.Tensor) -> torch.Tensor:
        """logits: [n, D, V], the chain blocks of these slots (the backbone's); drafts: [n, D] their greedy
        drafts -> [n, 3, D]: each slot's acceptance under speculative sampling at the temperature (alpha),
        its acceptance of the reference token (m), and its greedy draft's acceptance
        (sampled_acceptance.draft_acceptance). The target's distribution for slot i (token start + i) is
        from the final state at position start + i - 1 along the stored reference, and a dspark drafter's
        slot i has the bias of the reference's token there (positions clamped to the sample's last but one:
        slots past its end are cut by the round's count)."""
        D, dev = self.B - 1, logits.device
        states, before, reference = [], [], []
        for slot in slots:
            s, start = self.samples[slot], int(self.start[slot, 0])
            at = torch.arange(start, start + D).clamp(max=len(s.tokens) - 2)
            states.append(s.final_state[at])  # [D, H] bf16
            before.append(s.tokens[at])  # [D]: the token before each slot (slot 1: the anchor)
            reference.append(s.tokens[at + 1])  # [D]
        if self.m.config.head == "dspark":
            head = self.m.markov_head
            logits = logits + head.bias(head.embed(torch.stack(before).to(dev)), logits.dtype)
        target = self.m.logits(torch.stack(states).to(dev))  # [n, D, V]: lm_head(final state)
        on_reference = reference_acceptance(target, logits, torch.stack(reference).to(dev), self.temperature)
        greedy = draft_acceptance(target, drafts, self.temperature)
        return torch.stack([slot_acceptance(target, logits, self.temperature), on_reference, greedy], dim=1)

    def _unpack(self, flat: np.ndarray, where: dict) -> dict:
        D, at, out = self.B - 1, 0, {}
        for lane, k in enumerate((None, *self.k)):
            n = len(where[lane])
            if not n:
                continue
            if k is None:
                drafts, at = flat[at : at + n * D].reshape(n, D).astype(np.int64), at + n * D
                out.update({(slot, 0): drafts[i] for i, (slot, _) in enumerate(where[lane])})
                if self.temperature is not None:
                    alpha, at = flat[at : at + n * 3 * D].reshape(n, 3, D), at + n * 3 * D
                    out.update({(slot, "alpha"): alpha[i] for i, (slot, _) in enumerate(where[lane])})
                continue
            vals = flat[at : at + n * D * k].reshape(n, D, k)
            ids = flat[at + n * D * k : at + 2 * n * D * k].reshape(n, D, k).astype(np.int64)
            at += 2 * n * D * k
            out.update({(slot, lane): (vals[i], ids[i]) for i, (slot, _) in enumerate(where[lane])})
        return out
