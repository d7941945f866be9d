"""DDTree: tree shape and order on hand-made distributions, top-N optimality against brute force,
greedy acceptance along the tree, and the verification mask."""

import itertools
import math
import random
import time

import pytest
import torch

from pipeline.decode.acceptance import accepted
from pipeline.decode.ddtree import accept, build_tree, slot_logprobs, top_k

# D = 3, V = 5; probabilities by token id. Rank order per depth:
#   depth 1: 3 (.6), 1 (.3), 0 (.05), 4 (.03), 2 (.02)
#   depth 2: 2 (.55), 0 (.35), 4 (.06), 1 (.03), 3 (.01)
#   depth 3: 1 (.9), 3 (.05), 0 (.025), 4 (.015), 2 (.01)
PROBS = [[0.05, 0.3, 0.02, 0.6, 0.03], [0.35, 0.03, 0.55, 0.01, 0.06], [0.025, 0.9, 0.01, 0.05, 0.015]]
# Path probabilities, best first: (0,) .6, (0,0) .33, (1,) .3, (0,0,0) .297, (0,1) .21,
# (0,1,0) .189, (1,0) .165, (1,0,0) .1485, (1,1) .105, ...
HAND_RANKS = [(0,), (0, 0), (1,), (0, 0, 0), (0, 1), (0, 1, 0), (1, 0), (1, 0, 0)]


def hand_logprobs() -> torch.Tensor:
    return torch.tensor(PROBS, dtype=torch.float64).log().float()  # [3, 5] fp32


def random_logprobs(seed: int, d: int, v: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return slot_logprobs(torch.randn(d, v, generator=g) * scale)  # [D, V] fp32, ties improbable


def brute_force_best(lp: torch.Tensor, n: int) -> list[tuple[int, ...]]:
    """The n best rank tuples of length 1..D over the top-K per depth (K = min(n, V))."""
    k = min(n, lp.shape[1])
    vals = lp.sort(dim=-1, descending=True).values[:, :k].tolist()  # [D, K], full sort on purpose
    scored = []
    for d in range(1, lp.shape[0] + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = 0.0
            for depth, r in enumerate(ranks):
                s += vals[depth][r]
            scored.append((-s, ranks))
    scored.sort()
    return [r for _, r in scored[:n]]


def argmax_target(lp: torch.Tensor, rng: random.Random) -> tuple[list[int], int]:
    """A target that follows the argmax drafts for m random steps, then deviates (half the time to
    the rank-1 token, which a tree may hold), then goes random. Returns (target [D], m)."""
    d, v = lp.shape
    order = lp.argsort(dim=-1, descending=True)  # [D, V]
    m = rng.randint(0, d)
    target = order[:, 0].tolist()
    for j in range(m, d):
        if j == m:
            target[j] = order[j, 1].item() if rng.random() < 0.5 else order[j, rng.randint(1, v - 1)].item()
        else:
            target[j] = rng.randrange(v)
    return target, m


def test_hand_tree_nodes_and_order():
    tree = build_tree(hand_logprobs(), 6)
    assert tree.ranks == tuple(HAND_RANKS[:6])
    assert tree.tokens.tolist() == [3, 2, 1, 1, 0, 1]
    assert tree.parents.tolist() == [-1, 0, -1, 1, 0, 4]
    assert tree.depths.tolist() == [1, 2, 1, 3, 2, 3]
    want = [0.6, 0.33, 0.3, 0.297, 0.21, 0.189]
    assert tree.scores.dtype == torch.float32
    assert torch.allclose(tree.scores, torch.tensor(want).log(), atol=1e-6)
    assert build_tree(hand_logprobs(), 8).ranks == tuple(HAND_RANKS)


def test_ties_are_deterministic_lowest_id_and_lexicographic():
    row = torch.tensor([[-1.0, -2.0, -1.0, -2.0, -1.0, -3.0]])
    assert top_k(row, 2)[1] == [[0, 2]]  # three tokens tie for the cut: lowest ids win
    assert top_k(row, 4)[1] == [[0, 2, 4, 1]]
    flat = slot_logprobs(torch.zeros(2, 3))  # uniform: every node at a depth ties
    tree = build_tree(flat, 100)
    assert len(tree) == 3 + 9  # the whole top-K tree, then the heap runs dry
    assert tree.ranks == ((0,), (1,), (2,)) + tuple(itertools.product(range(3), repeat=2))
    assert tree.tokens.tolist()[:3] == [0, 1, 2]


@pytest.mark.parametrize("seed", range(4))
def test_top_k_matches_stable_full_sort_with_many_ties(seed):
    g = torch.Generator().manual_seed(seed)
    lp = slot_logprobs(torch.randn(3, 1000, generator=g)).to(torch.bfloat16).float()  # many ties
    for k in (1, 7, 64):
        vals, ids = top_k(lp, k)
        ref = lp.sort(dim=-1, descending=True, stable=True)  # ties: ascending id
        assert ids == ref.indices[:, :k].tolist()
        assert vals == ref.values[:, :k].tolist()


@pytest.mark.parametrize("seed", range(5))
def test_tree_is_the_top_n_prefixes(seed):
    lp = random_logprobs(seed, 4, 6)  # [4, 6]
    for budget in (1, 2, 3, 5, 8, 13, 30, 60):
        tree = build_tree(lp, budget)
        best = brute_force_best(lp, budget)
        assert set(best) == set(tree.ranks) and len(tree) == budget
        assert all(r[:-1] in set(best) for r in best if len(r) > 1)  # the premise: prefix-closed
        scores = tree.scores.tolist()
        assert all(a >= b for a, b in zip(scores, scores[1:]))  # best-first pops never rise
        top = lp.sort(dim=-1, descending=True).indices  # [D, V]
        for i, r in enumerate(tree.ranks):
            assert tree.tokens[i].item() == top[len(r) - 1, r[-1]].item()
            want = sum(lp[j, top[j, rj]].item() for j, rj in enumerate(r))
            assert scores[i] == pytest.approx(want, abs=1e-5)


def test_small_vocab_gives_whole_tree():
    lp = random_logprobs(7, 2, 3)
    tree = build_tree(lp, 20)
    assert len(tree) == 12 and set(tree.ranks) == set(brute_force_best(lp, 12))


@pytest.mark.parametrize("seed", range(5))
def test_parents_precede_children_and_are_prefixes(seed):
    tree = build_tree(random_logprobs(seed, 6, 40, scale=3.0), 32)
    for i, (p, r) in enumerate(zip(tree.parents.tolist(), tree.ranks)):
        assert p < i
        assert tree.depths[i].item() == len(r)
        if len(r) == 1:
            assert p == -1
        else:
            assert tree.ranks[p] == r[:-1] and tree.depths[p].item() == len(r) - 1
    assert len(set(tree.ranks)) == len(tree)


def test_budget_one_is_the_slot1_argmax():
    rng = random.Random(0)
    for seed in range(10):
        lp = random_logprobs(seed, 5, 30)
        tree = build_tree(lp, 1)
        top1 = lp[0].argmax().item()
        assert tree.ranks == ((0,),) and tree.tokens.tolist() == [top1]
        assert tree.parents.tolist() == [-1] and tree.depths.tolist() == [1]
        for _ in range(20):
            target, _ = argmax_target(lp, rng)
            assert accept(tree, target) == int(target[0] == top1) <= 1


def test_accept_on_hand_tree():
    tree = build_tree(hand_logprobs(), 6)
    assert accept(tree, [3, 2, 1]) == 3
    assert accept(tree, torch.tensor([3, 0, 1])) == 3
    assert accept(tree, [3, 2, 3]) == 2
    assert accept(tree, [3, 4, 1]) == 1  # (0,2) is not within budget 6
    assert accept(tree, [2, 2, 1]) == 0
    assert accept(tree, [1, 2, 1]) == 1  # (1,0) is not within budget 6
    assert accept(build_tree(hand_logprobs(), 8), [1, 2, 1]) == 3


def test_accept_follows_only_children_of_the_accepted_node():
    tree = build_tree(hand_logprobs(), 8)
    depth2 = {t for t, d in zip(tree.tokens.tolist(), tree.depths.tolist()) if d == 2}
    assert 0 in depth2  # token 0 is a depth-2 node, but under node (0,) (token 3), not (1,) (token 1)
    assert accept(tree, [1, 0, 1]) == 1
    assert accept(tree, [3, 0, 1]) == 3
    assert accept(tree, [1, 2, 3]) == 2  # (1,0,0) holds token 1, not 3


def test_accept_never_exceeds_budget_or_depth():
    rng = random.Random(1)
    for seed in range(10):
        lp = random_logprobs(seed, 4, 8)
        for budget in (1, 2, 3, 6, 50):
            tree = build_tree(lp, budget)
            for _ in range(10):
                target, _ = argmax_target(lp, rng)
                assert accept(tree, target) <= min(budget, 4)


def test_chain_acceptance_takes_lists_and_tensors():
    assert accepted([5, 6, 7], [5, 6, 8]) == 2
    assert accepted(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7])) == 3
    assert accepted([1, 6, 7], [5, 6, 7]) == 0


def test_larger_budget_is_a_superset_and_accepts_no_less():
    rng = random.Random(2)
    for seed in range(6):
        lp = random_logprobs(seed, 5, 20)
        trees = [build_tree(lp, n) for n in range(1, 41)]
        for small, big in zip(trees, trees[1:]):
            assert big.ranks[: len(small)] == small.ranks  # the same pops, continued
        for _ in range(20):
            target, _ = argmax_target(lp, rng)
            got = [accept(t, target) for t in trees]
            assert got == sorted(got)


def peaked_logprobs(seed: int, d: int, v: int) -> torch.Tensor:
    """Random distributions whose argmax gets a random boost: from flat-ish to near-certain."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(d, v, generator=g)
    boost = torch.rand(d, generator=g) * 10.0
    logits[torch.arange(d), torch.randint(v, (d,), generator=g)] += boost
    return slot_logprobs(logits)


def zero_chain_depth(tree) -> int:
    """Depth of the longest argmax chain (0, ..., 0) in the tree."""
    return max((len(r) for r in tree.ranks if not any(r)), default=0)


def test_tree_accepts_at_least_the_argmax_chain():
    """Budget >= D beats chain drafting whenever the whole argmax chain made it into the tree (here:
    whenever every rank-1 log-prob is below the chain's score, which forces it in); in every case
    up to the depth the argmax chain reaches in the tree."""
    rng = random.Random(3)
    d, forced, beaten = 6, 0, 0
    for seed in range(40):
        lp = peaked_logprobs(seed, d, 12)
        vals = lp.sort(dim=-1, descending=True).values  # [D, V]
        chain_in = bool((vals[:, 1] < vals[:, 0].sum()).all())
        drafts = lp.argmax(dim=-1)  # [D]
        for budget in (d, 2 * d, 64):
            tree = build_tree(lp, budget)
            if chain_in:
                assert zero_chain_depth(tree) == d
            for _ in range(20):
                target, m = argmax_target(lp, rng)
                chain = accepted(drafts, target)
                assert chain == m
                got = accept(tree, target)
                assert got >= min(chain, zero_chain_depth(tree))
                if chain_in:
                    forced += 1
                    assert got >= chain
                beaten += got > chain
    assert forced > 0 and beaten > 0  # both the forced case and a tree win happened


def test_budget_d_can_fall_below_chain_when_slot1_is_flat():
    """Not a guarantee: with a flat slot 1 the budget goes to depth-1 siblings."""
    probs = [[0.21, 0.2, 0.2, 0.2, 0.19], [0.5, 0.2, 0.1, 0.1, 0.1], [0.5, 0.2, 0.1, 0.1, 0.1]]
    lp = torch.tensor(probs).log()
    tree = build_tree(lp, 3)
    assert tree.ranks == ((0,), (1,), (2,))
    assert accepted([0, 0, 0], [0, 0, 0]) == 3 and accept(tree, [0, 0, 0]) == 1


@pytest.mark.parametrize("budget", [0, -3, 2.5, True, "8"])
def test_bad_budget_raises(budget):
    with pytest.raises(ValueError):
        build_tree(hand_logprobs(), budget)


def test_bad_logprobs_raise():
    with pytest.raises(ValueError):
        build_tree(torch.tensor([[0.0, float("nan")]]), 2)
    with pytest.raises(ValueError):
        build_tree(torch.zeros(5), 2)


def test_masked_tokens_at_minus_inf_are_fine():
    lp = torch.full((2, 4), -math.inf)
    lp[:, 0] = 0.0  # one certain token per depth, the rest impossible
    tree = build_tree(lp, 3)
    assert tree.ranks == ((0,), (0, 0), (0, 1))  # -inf ties: lexicographic
    assert tree.scores[2].item() == -math.inf
    assert accept(tree, [0, 0]) == 2


def test_full_vocab_budget_64_is_fast():
    lp = random_logprobs(0, 15, 248_000)  # [15, 248000]
    start = time.perf_counter()
    tree = build_tree(lp, 64)
    took = time.perf_counter() - start
    assert len(tree) == 64 and took < 5.0
    assert tree.tokens[0].item() == lp[0].argmax().item()


def test_a_large_enough_budget_is_never_below_chain():
    """Once the budget covers every node scoring at least the full argmax chain, the chain is in the
    tree and the tree accepts at least what the chain accepts, on every round."""
    g = torch.Generator().manual_seed(11)
    for _ in range(30):
        lp = torch.log_softmax(torch.randn(4, 6, generator=g) * 2, -1)  # [D=4, V=6]
        chain_score = float(lp.max(-1).values.sum())
        vals = lp.sort(-1, descending=True).values
        # nodes at least as good as the chain: count prefixes by brute force over all rank tuples
        budget = sum(
            1
            for d in range(1, 5)
            for r in itertools.product(range(6), repeat=d)
            if float(sum(vals[i, r[i]] for i in range(d))) >= chain_score
        )
        tree = build_tree(lp, budget)
        drafts = lp.argmax(-1)
        for _ in range(10):
            target = torch.where(torch.rand(4, generator=g) < 0.7, drafts, torch.randint(0, 6, (4,), generator=g))
            assert accept(tree, target) >= accepted(drafts, target)
