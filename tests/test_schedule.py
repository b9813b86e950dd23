"""The serving scheduler's policy (``hsd_opt.runtime.schedule``), stated as properties of its pure functions; the
batch and the load predictor both run it (``tests/test_load_model.py`` checks that their ticks agree)."""

from __future__ import annotations

from hsd_opt.runtime.schedule import (
    Group,
    Occupancy,
    PrefillShare,
    level_at,
    prefill_turn,
    prompt_pass,
    served_groups,
)

OCCUPANCIES = [Occupancy(d, p, w, m) for m in (1, 2, 4, 8) for d in range(m + 1) for p in (0, 1, 2)
               for w in (0, 1, 3, 9) if d + p <= m]


def test_the_load_counts_those_in_flight_and_those_that_take_a_free_place():
    for occ in OCCUPANCIES:
        assert occ.in_flight <= occ.load <= occ.max_active, occ
        assert occ.load == min(occ.max_active, occ.in_flight + occ.waiting), occ


def test_a_prompt_may_begin_with_a_free_place_and_leaves_the_load_as_it_was():
    for occ in OCCUPANCIES:
        assert occ.admits() == (occ.waiting > 0 and occ.in_flight < occ.max_active), occ
        if occ.admits():   # the oldest waiting one begins: the level it was chosen for stays in force
            after = Occupancy(occ.decoding, occ.prefilling + 1, occ.waiting - 1, occ.max_active)
            assert after.load == occ.load, occ
            assert level_at((1, 2, 4, 8), after) == level_at((1, 2, 4, 8), occ), occ


def test_the_prompt_with_the_fewest_positions_left_takes_the_prefill_pass():
    assert prefill_turn([], None) is None
    assert prefill_turn([], 300) == 0                        # the oldest waiting one begins
    assert prefill_turn([700], 20) == 1                      # a short one goes before a long one's passes
    assert prefill_turn([700], 700) == 0 and prefill_turn([700], 900) == 0     # a tie: the one begun
    assert prefill_turn([500, 40], None) == 1 and prefill_turn([40, 40], 40) == 0


def test_the_level_in_force_is_the_nearest_on_a_log_scale():
    assert [level_at((1, 2, 4, 8), Occupancy(n, 0, 0, 8)) for n in range(1, 9)] == [1, 2, 4, 4, 4, 8, 8, 8]
    assert level_at((1, 8), Occupancy(1, 1, 5, 8)) == 8          # 2 in flight, 5 waiting for a place: 7


def _g(key, size, rank=0, waited=0, first=False):
    return Group(key, size, rank, waited, first)


def test_the_largest_group_is_served_and_a_tie_goes_to_the_lowest_engine():
    assert served_groups([_g("t", 2, 3), _g("d", 3, 0)], max_wait=3) == ["d"]
    assert served_groups([_g("t", 3, 3), _g("d", 3, 0)], max_wait=3) == ["d"]
    assert served_groups([_g("t", 4, 3), _g("d", 3, 0)], max_wait=3) == ["t"]
    assert served_groups([], max_wait=3) == []


def test_a_group_that_waited_long_enough_or_holds_a_first_token_is_served_too_in_the_order_given():
    groups = [_g("a", 1, 2, waited=3), _g("b", 5, 1), _g("c", 1, 0, waited=2), _g("d", 1, 0, first=True)]
    assert served_groups(groups, max_wait=3) == ["a", "b", "d"]
    assert served_groups(groups, max_wait=2) == ["a", "b", "c", "d"]
    assert served_groups(groups, max_wait=0) == ["a", "b", "c", "d"]     # 0: every pending pass every tick


def test_prompt_passes_take_at_most_their_share_of_the_time_while_others_decode():
    """After a pass of ``p`` seconds that left more of its prompt, with sequences decoding, a begun prompt's next
    pass is due once they have decoded ``p * (1 - share) / share`` seconds; with nothing decoding a pass is always
    due and nothing is owed; share 1 owes nothing."""
    import math

    for share in (0.25, 0.5, 0.8, 1.0):
        s = PrefillShare(share)
        assert s.due(0) and s.due(3)
        s.prefilled(2.0, decoding=3)
        owed = 2.0 * (1 - share) / share
        assert math.isclose(s.owed, owed) and s.due(3) == (share == 1.0) and s.due(0)
        s.decoded(owed * 0.75)
        assert s.due(3) == (share == 1.0)
        s.decoded(owed * 0.25 + 1e-12)
        assert s.due(3)
        s.decoded(5.0)
        assert s.owed == 0.0                               # decoding time is not saved up for later prompts
        s.prefilled(2.0, decoding=3)
        s.prefilled(1.0, decoding=0)                       # everyone else ended: nothing is owed to anyone
        assert s.owed == 0.0 and s.due(1)


def test_a_begun_prompts_next_pass_waits_while_time_is_owed_and_a_waiting_prompts_first_pass_goes_instead():
    """``prompt_pass`` is ``prefill_turn`` while nothing is owed; while time is owed, a begun prompt's next pass
    gives way to the oldest waiting sequence's first pass (never held), or to none, unless only the target's last
    pass is left of it (at most a pass's positions, more than none: none left is its other engines' passes)."""
    owing = PrefillShare(0.5)
    owing.prefilled(1.0, decoding=2)
    for left in ([], [5], [0], [40, 3], [40, 0], [300], [300, 40]):
        for nxt in (None, 1, 10, 500):
            turn = prefill_turn(left, nxt)
            assert prompt_pass(left, nxt, PrefillShare(0.5), decoding=2, chunk=8) == turn        # nothing owed
            assert prompt_pass(left, nxt, owing, decoding=0, chunk=8) == turn                    # no one decodes
            held = prompt_pass(left, nxt, owing, decoding=2, chunk=8)
            last = turn is not None and turn < len(left) and 0 < left[turn] <= 8
            assert held == (turn if turn == len(left) or last else (len(left) if nxt is not None else None))
    assert prompt_pass([3], None, owing, decoding=2, chunk=8) == 0 and prompt_pass([0], None, owing, 2, 8) is None


def test_a_share_outside_zero_to_one_is_refused_naming_the_flag():
    import pytest

    from hsd_opt.errors import HsdError

    for bad in (0, -0.5, 1.5, float("nan"), True, "0.5", None):
        with pytest.raises(HsdError, match="--prefill-share"):
            PrefillShare(bad)
