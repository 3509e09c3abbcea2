"""A slice of our parameter read as a slice of the stored tensor (``Layout.stored_index`` /
``slice_to_ours``): the part a tensor-parallel shard holds is one contiguous block of the stored
tensor for every layout, and cut and reshaped it equals the same part of the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.model.weight_mapping import Layout, flat_range, normalize_index, permute_qk

# (layout, our shape, the axis tensor parallelism splits) as the families use them
CASES = [
    (Layout(), (16, 8), 0),  # embedding / LM head rows (vocab)
    (Layout("flatten"), (4, 6), 0),  # q bias [h, d] over heads
    (Layout("linear", 1), (8, 4, 6), 1),  # q_proj [e, h, d] over heads
    (Layout("linear", 2), (4, 6, 8), 0),  # o_proj [h, d, e] over heads
    (Layout("linear", 1), (8, 12), 1),  # gate/up [e, f] over f
    (Layout("linear", 1), (12, 8), 0),  # down [f, e] over f
    (Layout("linear", 1, permuted_heads=4), (8, 4, 6), 1),  # GGUF q rows
    (Layout("flatten", permuted_heads=4), (4, 6), 0),  # GGUF q bias
    (Layout(offset=1.0), (8,), None),  # GGUF Gemma norm, replicated
]


@pytest.mark.parametrize("layout,shape,axis", CASES)
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_every_shard_reads_one_contiguous_block_equal_to_the_whole(layout, shape, axis, shards):
    rng = np.random.default_rng(0)
    ours = rng.standard_normal(shape).astype(np.float32)
    stored = layout.to_stored(ours)
    assert stored.shape == layout.stored_shape(shape)
    np.testing.assert_allclose(layout.to_ours(stored, shape), ours, rtol=1e-6)
    n = 1 if axis is None else shards
    for k in range(n):
        index = [slice(None)] * len(shape)
        if axis is not None:
            size = shape[axis] // n
            index[axis] = slice(k * size, (k + 1) * size)
        index = tuple(index)
        where = layout.stored_index(index, shape)
        assert where is not None
        part = stored[where]
        assert part.size == ours[index].size  # no more than the shard's elements are read
        np.testing.assert_allclose(layout.slice_to_ours(part, index, shape), ours[index], rtol=1e-6)


def test_a_part_that_is_not_contiguous_is_refused():
    # head_dim split: rows of every head interleave
    assert (
        Layout("linear", 1).stored_index((slice(None), slice(None), slice(0, 3)), (8, 4, 6)) is None
    )
    # half a head of llama.cpp-permuted rows
    assert (
        Layout("flatten", permuted_heads=4).stored_index((slice(0, 1), slice(0, 3)), (4, 6)) is None
    )


def test_flat_range_and_normalize_index():
    assert flat_range((slice(1, 3), slice(None)), (4, 5)) == slice(5, 15)
    assert flat_range((slice(2, 3), slice(1, 4)), (4, 5)) == slice(11, 14)
    assert flat_range((slice(1, 3), slice(1, 4)), (4, 5)) is None
    assert normalize_index((slice(None),), (3, 2)) == (slice(0, 3), slice(0, 2))
    with pytest.raises(ValueError, match="step"):
        normalize_index((slice(0, 4, 2),), (4,))


def test_permute_is_per_head():
    x = np.arange(16, dtype=np.float32).reshape(16, 1)
    # the first two heads' rows stay within those heads
    assert set(permute_qk(x, 4)[:8, 0]) == set(range(8))
