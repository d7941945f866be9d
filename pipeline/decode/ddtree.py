"""DDTree (SPEC §2): a token tree from one DFlash draft block, no retraining.

The drafter gives slots 1..D (D = B-1) independent distributions. Keep the top-K tokens per depth
(K = min(budget, V), rank 0 = best); a node is a rank tuple (r_1, ..., r_d) naming the path
(top_1[r_1], ..., top_d[r_d]) and scores the sum of its log-probs. Best-first search from (0,):
each pop adds the node and pushes its next sibling and its first child, until `budget` nodes.
Log-probs are <= 0, so a child never outscores its parent and the pops come in non-increasing
score order: the tree is the `budget` best prefixes. It hangs from the block's slot-0 token (the
last committed token, not a node). Greedy verification walks from that root along the children
that hold the target's tokens; tokens per round = accepted + 1 <= min(budget, D) + 1.

Ties are broken deterministically: within a depth by token id (lowest first, also for who makes
the cut at the K-th value), between nodes by rank tuple (lexicographic).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [N] long, token of each node, in the order nodes were added
    parents: torch.Tensor  # [N] long, parent node index, -1 for children of the root
    depths: torch.Tensor  # [N] long, 1..D
    scores: torch.Tensor  # [N] fp32, sum of log-probs along the path
    ranks: tuple[tuple[int, ...], ...]  # the rank tuple of each node

    def __len__(self) -> int:
        return len(self.ranks)


def slot_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Draft logits [D, V] -> log-softmax at temperature 1: [D, V] fp32."""
    return torch.log_softmax(logits.float(), dim=-1)


def _lowest_id_cut(row: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Top-k ids of row [V] where ties at the k-th value go to the lowest ids: [k] long."""
    edge = vals[-1]
    above = ids[vals > edge]
    tied = torch.nonzero(row == edge).flatten()[: len(ids) - len(above)]
    return torch.cat([above, tied])


def top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Per-depth top-k as Python lists (values, token ids), ordered by log-prob desc, then id asc.

    logprobs: [D, V]; never sorts the whole vocabulary (torch.topk, plus one pass per depth only
    where ties straddle the k-th value).
    """
    lp = logprobs.float()  # [D, V] fp32
    vals, ids = torch.topk(lp, k, dim=-1)  # [D, k]
    edge = vals[:, -1:]  # [D, 1]
    cut = ((lp == edge).sum(-1) > (vals == edge).sum(-1)).tolist()  # [D] ties cut at the edge
    out_v, out_i = [], []
    for d, is_cut in enumerate(cut):
        row_ids = _lowest_id_cut(lp[d], vals[d], ids[d]) if is_cut else ids[d]
        pairs = sorted(zip(lp[d, row_ids].tolist(), row_ids.tolist()), key=lambda p: (-p[0], p[1]))
        out_v.append([v for v, _ in pairs])
        out_i.append([i for _, i in pairs])
    return out_v, out_i


def _check(logprobs: torch.Tensor, budget: int) -> None:
    """Reject a bad budget or a log-prob table that cannot be searched."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {budget!r}")
    if logprobs.dim() != 2 or logprobs.shape[1] < 1:
        raise ValueError(f"logprobs must be [D, V] with V >= 1, got {tuple(logprobs.shape)}")
    if (torch.isnan(logprobs) | torch.isposinf(logprobs)).any():
        raise ValueError("logprobs contain NaN or +inf")


def _search(vals: list[list[float]], budget: int) -> list[tuple[tuple[int, ...], int, float]]:
    """Best-first search over rank tuples: (ranks, parent index, score) per node, in pop order.

    vals: [D][K] log-probs per depth, sorted desc. Heap key (-score, ranks) is unique, so ties pop
    in lexicographic rank order; the heap never holds more than budget + 1 entries.
    """
    depth_max, k = len(vals), len(vals[0]) if vals else 0
    heap = [(-vals[0][0], (0,), -1, 0.0)] if depth_max and k else []
    nodes: list[tuple[tuple[int, ...], int, float]] = []
    while heap and len(nodes) < budget:
        neg, ranks, parent, base = heapq.heappop(heap)  # base: the parent's score
        me, d = len(nodes), len(ranks)
        nodes.append((ranks, parent, -neg))
        if ranks[-1] + 1 < k:
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-(base + vals[d - 1][sib[-1]]), sib, parent, base))
        if d < depth_max:
            heapq.heappush(heap, (neg - vals[d][0], ranks + (0,), me, -neg))
    return nodes


def build_tree(logprobs: torch.Tensor, budget: int) -> Tree:
    """The DDTree of `budget` nodes (fewer if the whole top-K tree is smaller) from logprobs: [D, V]
    (log-softmax of each slot's draft logits, see slot_logprobs). Tensors live on logprobs.device."""
    _check(logprobs, budget)
    k = min(budget, logprobs.shape[1])
    vals, ids = top_k(logprobs, k) if logprobs.shape[0] else ([], [])
    nodes = _search(vals, budget)
    dev = logprobs.device
    ranks = tuple(r for r, _, _ in nodes)
    return Tree(
        tokens=torch.tensor(_node_tokens(nodes, ids), dtype=torch.long, device=dev),
        parents=torch.tensor([p for _, p, _ in nodes], dtype=torch.long, device=dev),
        depths=torch.tensor([len(r) for r in ranks], dtype=torch.long, device=dev),
        scores=torch.tensor([s for _, _, s in nodes], dtype=torch.float32, device=dev),
        ranks=ranks,
    )


def _node_tokens(nodes, ids: list[list[int]]) -> list[int]:
    return [ids[len(r) - 1][r[-1]] for r, _, _ in nodes]


def top_k_device(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k` for many rows at once, on their device, without a host sync: logprobs [R, V] fp32 ->
    (values [R, k] fp32, ids [R, k] long), each row ordered by log-prob desc, then id asc, the ties
    at the k-th value going to the lowest ids. Temporaries: two [R, V] tensors (bool and long)."""
    R, V = logprobs.shape
    vals, ids = torch.topk(logprobs, k, dim=-1)  # [R, k] desc; which tied ids is unspecified
    edge = vals[:, -1:]  # [R, 1]
    n_above = (vals > edge).sum(-1, keepdim=True)  # [R, 1]: they lead `vals`
    iota = torch.arange(V, device=logprobs.device)
    tied = torch.where(logprobs == edge, iota, V).topk(k, dim=-1, largest=False).values  # [R, k] lowest ids first
    j = torch.arange(k, device=logprobs.device)[None]
    above = j < n_above
    ids = torch.where(above, ids, tied.gather(1, (j - n_above).clamp_min(0)))
    vals = torch.where(above, vals, edge)
    order = torch.sort(ids, dim=-1, stable=True).indices  # id asc, then value desc (stable): (-v, id)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def accept_top(vals: list[list[float]], ids: list[list[int]], budget: int, target) -> int:
    """`accept(build_tree(...), target)` from the per-depth top-k lists (as `top_k` gives them), with
    no tensor made: what batched replay runs on the host for each tree round."""
    nodes = _search(vals, budget)
    return len(_walk([p for _, p, _ in nodes], _node_tokens(nodes, ids), target))


def _as_list(seq) -> list[int]:
    """A token sequence (tensor or list) as a list of ints."""
    return seq.tolist() if isinstance(seq, torch.Tensor) else [int(t) for t in seq]


def accepted_path(tree: Tree, target) -> list[int]:
    """Node indices walked from the root following target: [<=D] (the target's greedy tokens for
    depths 1..D); at depth d only children of the node accepted at depth d-1 are followed."""
    return _walk(tree.parents.tolist(), tree.tokens.tolist(), target)


def _walk(parents: list[int], tokens: list[int], target) -> list[int]:
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    path, at = [], -1
    for tok in _as_list(target):
        at = child.get((at, tok))
        if at is None:
            break
        path.append(at)
    return path


def accept(tree: Tree, target: torch.Tensor | list[int]) -> int:
    """Accepted draft tokens for the target's greedy tokens target: [D]; tokens/round = this + 1."""
    return len(accepted_path(tree, target))
