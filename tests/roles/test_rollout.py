"""Trajectories: rows of prompt batches padded to different buckets join by masked columns."""

import numpy as np

from rlpt.roles import Trajectories


def _rows(tokens, mask, tag):
    n = len(tokens)
    return Trajectories(
        prompt_tokens=np.asarray(tokens, np.int32), prompt_mask=np.asarray(mask, bool),
        tasks=[tag] * n, names=["d"] * n, texts=[tag] * n,
        tokens=np.full((n, 2), 7, np.int32), logprobs=np.zeros((n, 2), np.float32),
        mask=np.ones((n, 2), np.float32), lengths=np.full(n, 2), truncated=np.zeros(n, bool),
        loss_weight=np.ones(n, np.float32), domain_index=np.zeros(n, np.int32),
        difficulty=np.ones(n, np.int32), policy_version=np.full(n, 3, np.int32),
    )  # fmt: skip


def test_concat_left_aligns_prompts_of_different_widths_under_the_mask():
    narrow = _rows([[0, 5], [6, 7]], [[False, True], [True, True]], "a")  # bucket 2
    wide = _rows([[0, 0, 8, 9]], [[False, False, True, True]], "b")  # bucket 4
    both = Trajectories.concat([narrow, wide])
    assert both.prompt_tokens.shape == (3, 4) and both.tasks == ["a", "a", "b"]
    # Hand-worked: two masked columns before each narrow row; the real ids are unchanged.
    np.testing.assert_array_equal(
        both.prompt_mask,
        [[False, False, False, True], [False, False, True, True], [False, False, True, True]],
    )
    for row, ids in enumerate(([5], [6, 7], [8, 9])):
        assert both.prompt_tokens[row][both.prompt_mask[row]].tolist() == ids
    picked = both.take(np.array([2, 0]))
    assert picked.texts == ["b", "a"] and picked.policy_version.tolist() == [3, 3]
