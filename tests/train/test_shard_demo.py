"""``fastpar shard-demo``'s pieces that need no processes: the rule its data follow and the input it refuses.
(The whole demo runs in the slow suite, from docs/guide/planner.md.)"""

from __future__ import annotations

import pytest
import torch

from fastpar.train.shard_demo import main, rule_sequences
from fastpar.user_errors import UserError


def test_each_token_fixes_the_next():
    ids = rule_sequences(5, 12, vocab=64, seed=3)
    assert ids.shape == (5, 12) and ids.dtype == torch.long
    assert torch.equal(ids[:, 1:], (7 * ids[:, :-1] + 3) % 64)
    assert torch.equal(ids, rule_sequences(5, 12, vocab=64, seed=3))
    assert len(set(ids[:, 0].tolist())) > 1  # the starts differ


@pytest.mark.parametrize(
    "argv, message",
    [(["--layers", "0"], "--layers must be at least 1"), (["--vocab", "70"], "--vocab 70 is a multiple of 7")],
)
def test_bad_input_is_refused_before_anything_runs(argv, message):
    with pytest.raises(UserError, match=message):
        main(argv)
