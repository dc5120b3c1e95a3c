"""Inverted dropout that draws one random number for every two elements.

On the CPU, random numbers are a large part of a transformer's training step: with dropout
0.1 everywhere (embeddings, attention weights, feed-forward hidden units, residuals) the
small benchmark's JAX step took 229 ms against 164 ms with dropout off, most of it in the
`threefry` generator behind `keras.random.dropout` (benchmarks/README.md). A float32 uniform
number carries 23 or more random bits; its top 11 bits and the rest are independent uniform
numbers, so one draw decides two neighbouring elements. The rate is rounded up to a multiple of
1/2048 (0.1 → 0.10010) so that both numbers drop with exactly that probability, and kept
elements are scaled by 1 / (1 − that rate): the expectation is unchanged, as with
`keras.layers.Dropout`.
"""

import math

import keras
from keras import ops

from keras_tfm._checks import check_dropout

_BITS = 11  # resolution of each of the two numbers taken from one uniform draw
_STEPS = float(2**_BITS)


def effective_rate(rate):
    """The drop probability `Dropout(rate)` applies: `rate` rounded up to a multiple of 1/2048."""
    return math.ceil(rate * _STEPS) / _STEPS


@keras.saving.register_keras_serializable(package="keras_tfm")
class Dropout(keras.layers.Layer):
    """`keras.layers.Dropout` with half the random numbers.

    Each element is zeroed with probability `effective_rate(rate)` (`rate` rounded up to a
    multiple of 1/2048), independently, and the kept ones are scaled by
    `1 / (1 − effective_rate(rate))` (in the inputs' dtype, so exactly unbiased in float32, as
    `keras.layers.Dropout`). `keras.random.dropout` with `rate` itself is used instead for a
    last dimension that is odd or unknown, for rates that rounding would move by more than 1%
    (below about 0.05, or above 2047/2048), and under torch without a seed (where Keras calls
    torch's native dropout).

    Args:
        rate: in [0, 1).
        seed: optional int seed.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: any tensor; its Keras mask passes through.
        training: dropout is applied only when True.
    """

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.rate = check_dropout("rate", rate)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.rate > 0 else None
        self._effective_rate = effective_rate(self.rate)
        # Pairs only where rounding moves the rate by at most 1% (and never to 1).
        self._pairs = (self._effective_rate < 1.0
                       and self._effective_rate - self.rate <= 0.01 * self.rate)
        self.supports_masking = True
        self.built = True

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        width = inputs.shape[-1]
        if (not self._pairs or width is None or width % 2
                or (keras.backend.backend() == "torch" and self.seed is None)):
            return keras.random.dropout(inputs, self.rate, seed=self.seed_generator)
        rate = self._effective_rate
        shape = tuple(ops.shape(inputs)[:-1]) + (width // 2,)
        # float32 whatever `floatx` is: the split below needs the uniform's 23 random bits.
        scaled = keras.random.uniform(shape, dtype="float32", seed=self.seed_generator) * _STEPS
        high = ops.floor(scaled)  # the top 11 bits, as an integer 0 … 2047
        low = scaled - high  # the remaining bits, uniform in [0, 1) and independent of `high`
        # Neighbours share a draw (elements 2j and 2j + 1), so a last axis split across devices
        # (ModelParallel) keeps each pair on one device.
        keep = ops.reshape(ops.stack([high >= rate * _STEPS, low >= rate], axis=-1),
                           ops.shape(inputs))
        scale = ops.cast(1.0 / (1.0 - rate), inputs.dtype)
        return ops.where(keep, inputs * scale, ops.zeros_like(inputs))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return super().get_config() | {"rate": self.rate, "seed": self.seed}
