"""How many draft tokens a step proposes (engine_core/spec/depth.py)."""

from __future__ import annotations

import numpy as np

from engine_core.spec.depth import DraftDepth


def test_positions_seldom_accepted_stop_being_proposed_and_are_tried_again():
    depth = DraftDepth(k=4, floor=0.2, alpha=0.5, explore_every=5)
    assert depth.depth() == 4  # optimistic at first
    for _ in range(6):  # first positions kept, the second never
        depth.update(np.array([4, 4, 2]), np.array([1, 1, 0]))
    assert depth.rates[0] > 0.6 and depth.rates[1] < 0.2
    assert [depth.depth() for _ in range(4)] == [1, 1, 1, 4]  # every 5th step: all of them
    for _ in range(6):  # a request in a loop: everything accepted again
        depth.update(np.array([4]), np.array([4]))
    assert depth.depth() == 4


def test_a_position_nobody_reached_keeps_its_rate():
    depth = DraftDepth(k=3, alpha=1.0)
    depth.update(np.array([3, 3]), np.array([0, 0]))  # position 0 rejected: 1 and 2 not reached
    assert depth.rates.tolist() == [0.0, 1.0, 1.0]
