"""Acceptance is one pure function; tau statistics on hand-made rounds."""

import math

import pytest

from pipeline.decode.acceptance import accepted, round_tokens, stats, summarize, tau_over_prompts

B = 5


def test_all_drafts_right_gives_the_whole_block():
    assert accepted([7, 8, 9, 10], [7, 8, 9, 10]) + 1 == B


def test_first_draft_wrong_gives_one_token():
    assert accepted([1, 8, 9, 10], [7, 8, 9, 10]) + 1 == 1


def test_cases_between():
    assert accepted([7, 8, 0, 10], [7, 8, 9, 10]) == 2  # a later match after a miss does not count
    assert accepted([7, 0, 9, 10], [7, 8, 9, 10]) == 1
    assert accepted([7, 8, 9], [7, 8]) == 2  # the target ran out (end of the completion)
    assert accepted([], [1]) == 0


def test_last_round_is_cut_to_what_is_left():
    assert round_tokens(4, 10) == 5 and round_tokens(4, 3) == 3 and round_tokens(0, 1) == 1


def test_tau_conventions():
    prompts = [[(4, 5), (0, 1)], [(1, 2), (1, 2), (1, 2), (1, 2)]]  # means 3.0 and 2.0
    s = summarize(prompts, B)
    assert s["tau"] == 2.5  # mean of per-prompt means
    assert s["tau_pooled"] == 14 / 6  # all tokens over all rounds
    assert s["histogram"] == [1, 4, 0, 0, 1] and s["rounds"] == 6 and s["tokens"] == 14
    assert s["per_slot"] == [5 / 6, 1 / 6, 1 / 6, 1 / 6]


def test_prompts_without_rounds_are_not_averaged_in():
    s = summarize([[], [(2, 3)]], B)
    assert s["tau"] == 3 and s["prompts"] == 1
    assert math.isnan(summarize([], B)["tau"])


def test_tau_interval_is_over_the_per_prompt_means():
    """mean +- 1.96 sd / sqrt(n) of the per-prompt taus (3.0 and 2.0 here: sd 0.707, half-width 0.98),
    the same figures from `stats` (the whole sample) as from `tau_over_prompts` (a group)."""
    per_prompt = [(2, 6), (4, 8)]
    s, g = stats(per_prompt, [0, 4, 0, 0, 2]), tau_over_prompts(per_prompt)
    assert s["tau_ci95"] == g["tau_ci95"] == pytest.approx([2.5 - 0.98, 2.5 + 0.98])
    assert s["tau"] == g["tau"] == 2.5 and s["prompts"] == g["prompts"] == 2
    assert tau_over_prompts([(3, 9), (0, 0)])["tau_ci95"] is None  # one prompt with rounds: no interval
