"""Acceptance is one pure function; tau statistics on hand-made rounds."""

import math

from pipeline.decode.acceptance import accepted, round_tokens, summarize

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
