"""The device table of structured-output masks (model/mask_table.py): whatever masks a step brings — repeated,
new, more than fit, fresh arrays whose id() an evicted one had — gather returns exactly their rows, in order."""
import numpy as np

from tinyvllm.model.mask_table import MaskTable


def test_gather_gives_each_steps_masks_in_order_through_reuse_and_eviction(rng):
    table, vocab = MaskTable(rows=4), 37
    pool = [rng.random(vocab) < 0.5 for _ in range(7)]   # more masks than rows: eviction happens
    for _ in range(200):
        masks = [pool[i] for i in rng.integers(0, len(pool), rng.integers(1, 5))]   # at most 4 distinct: they fit
        np.testing.assert_array_equal(table.gather(masks, np), np.stack(masks))
    assert len(table.rows) == 4 and not table.free


def test_a_step_with_more_distinct_masks_than_rows_sends_them_whole(rng):
    table = MaskTable(rows=2)
    masks = [rng.random(11) < 0.5 for _ in range(3)]
    np.testing.assert_array_equal(table.gather(masks, np), np.stack(masks))
    np.testing.assert_array_equal(table.gather(masks[:2], np), np.stack(masks[:2]))


def test_a_fresh_array_is_never_taken_for_an_evicted_one(rng):
    """Masks made and dropped one after another: Python hands their ids out again, the table must not match them."""
    table = MaskTable(rows=2)
    for _ in range(100):
        mask = rng.random(13) < 0.5
        np.testing.assert_array_equal(table.gather([mask], np)[0], mask)
