"""split_channels against NumPy slicing: values, gradients, static shapes, bad sizes."""

import numpy as np
import pytest
from keras import ops

from keras_avae.ops.channels import split_channels
from tests.test_case import TestCase
from tests.test_case import input_gradient
from tests.test_case import to_numpy


class TestSplitChannels(TestCase):
    def test_parts_are_numpy_slices_with_static_shapes(self):
        x = np.random.default_rng(0).normal(size=(2, 3, 4, 9)).astype("float32")
        parts = split_channels(ops.convert_to_tensor(x), [2, 0, 4, 3])
        bounds = [0, 2, 2, 6, 9]
        assert [tuple(p.shape) for p in parts] == [(2, 3, 4, 2), (2, 3, 4, 0), (2, 3, 4, 4), (2, 3, 4, 3)]
        for part, start, stop in zip(parts, bounds, bounds[1:]):
            self.assertAllClose(part, x[..., start:stop], atol=0, rtol=0)

    def test_gradient_scatters_each_part_back(self):
        x = np.random.default_rng(1).normal(size=(3, 7)).astype("float32")
        weights = np.arange(1, 4, dtype="float32")

        def weighted(t):
            # Part i scaled by i + 1; the gradient must put each factor in its columns.
            return ops.concatenate([w * p for w, p in zip(weights, split_channels(t, [3, 1, 3]))], axis=-1)

        expected = np.repeat(weights, [3, 1, 3])[None].repeat(3, axis=0)
        self.assertAllClose(to_numpy(input_gradient(weighted, x)), expected, atol=0, rtol=0)

    def test_sizes_must_add_up_to_the_axis(self):
        with pytest.raises(ValueError, match=r"sum to the last axis, 5.*sizes=\[2, 2\]"):
            split_channels(ops.zeros((2, 5)), [2, 2])
