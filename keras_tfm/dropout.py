"""Inverted dropout with cheaper random numbers than `keras.random.dropout`.

* Under JAX, the mask comes from Threefry-2x32 (the generator behind `jax.random`, keyed by the
  layer's `SeedGenerator` as Keras keys `jax.random`), written with `keras.ops` so that XLA
  fuses it with the comparison and the scaling. Elements 2j and 2j + 1 take the two 32-bit
  words of counter j; an element is dropped when its word is below `rate · 2³²` (rounded up).
* Under torch and TensorFlow, on the CPU, one random 64-bit integer decides four elements: its
  memory, viewed as four 16-bit integers, gives the numbers of four consecutive elements, each
  compared with one threshold; the rate is rounded up to a multiple of 2⁻¹⁶ (0.1 → 0.100006).
  Torch tensors on an accelerator or under `torch.compile`, and TensorFlow with a GPU or TPU
  present, take Keras's dropout (`_split_draws_suit`), so a seeded layer's masks differ there.

Either way the kept elements are scaled by 1 / (1 − the applied rate), as in
`keras.layers.Dropout`. Timings: benchmarks/README.md ("Dropout alone").
"""

import math

import keras
import numpy as np
from keras import ops

from keras_tfm._checks import check_dropout

_FIELD = 2.0**16  # resolution of each of the four numbers taken from one 64-bit draw
_WORD = 2.0**32  # resolution of a Threefry word
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


# How `Dropout` draws on each backend, and the resolution of its rate; other backends use
# `keras.random.dropout`.
_DRAWS = {"jax": ("threefry", _WORD), "torch": ("split", _FIELD), "tensorflow": ("split", _FIELD)}


def effective_rate(rate, backend=None):
    """The drop probability `Dropout(rate)` applies on `backend` (default: Keras's): `rate`
    rounded up to a multiple of 2⁻³² under JAX, of 2⁻¹⁶ under torch and TensorFlow. The
    torch and TensorFlow value is that of the CPU (under torch: tensors run eagerly); on an
    accelerator or under `torch.compile` the layer applies `rate` itself (Keras's dropout),
    which this function, given no tensor, cannot see."""
    draws = _DRAWS.get(backend or keras.backend.backend())
    return rate if draws is None else math.ceil(rate * draws[1]) / draws[1]


def _split_draws_suit(inputs):
    """Whether the split draws are the faster choice for `inputs`: under torch, CPU tensors
    outside `torch.compile` (the one place keras_tfm asks a tensor for its device); under
    TensorFlow, a process that sees no GPU or TPU (a traced graph's tensors do not know their
    device yet, and TensorFlow places them on an accelerator where there is one).

    On CUDA, torch's one fused dropout kernel is faster than these draws' separate kernels;
    under `torch.compile`, Keras draws seeded random numbers through a `torch.Generator`
    outside the graph (one graph break per call), while its unseeded dropout
    (`torch.nn.functional.dropout`) compiles; a layer given a `seed` still breaks the graph
    (Keras's seeded dropout uses the generator too). Measurements: benchmarks/README.md."""
    if keras.backend.backend() == "tensorflow":
        return all(device.startswith("cpu") for device in keras.distribution.list_devices())
    import torch

    return inputs.device.type == "cpu" and not torch.compiler.is_compiling()


def _u32(value):
    # An explicit dtype: without one, Keras's JAX backend converts NumPy values to floats when
    # `floatx` is bfloat16.
    return ops.convert_to_tensor(np.asarray(value, "uint32"), dtype="uint32")


def _rotate_left(x, bits):
    return ops.bitwise_or(ops.left_shift(x, _u32(bits)), ops.right_shift(x, _u32(32 - bits)))


def threefry2x32(key0, key1, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al., 2011; as `jax.random`) on uint32 tensors:
    the two output words for counters `(x0, x1)` under key `(key0, key1)`. uint32 arithmetic
    wraps, as Threefry needs, under JAX and TensorFlow (torch has no uint32 arithmetic)."""
    keys = (key0, key1, ops.bitwise_xor(ops.bitwise_xor(key0, key1), _u32(_PARITY)))
    x0, x1 = x0 + keys[0], x1 + keys[1]
    for i in range(5):
        for bits in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ops.bitwise_xor(_rotate_left(x1, bits), x0)
        x0 = x0 + keys[(i + 1) % 3]
        x1 = x1 + keys[(i + 2) % 3] + _u32(i + 1)
    return x0, x1


@keras.saving.register_keras_serializable(package="keras_tfm")
class Dropout(keras.layers.Layer):
    """`keras.layers.Dropout` with cheaper random numbers.

    Each element is zeroed with probability `effective_rate(rate)` (`rate` itself wherever
    Keras's dropout is used, below), independently, and the kept ones are scaled by
    `1 / (1 − that rate)` (in the inputs' dtype, so exactly unbiased in float32, as
    `keras.layers.Dropout`). Under JAX the random bits are Threefry-2x32 (see the module
    docstring), for any static shape up to 2³² elements. Under torch and TensorFlow, on the
    CPU, one 64-bit random integer decides four consecutive elements, 16 bits each (the rate
    rounded up to a multiple of 2⁻¹⁶), for any shape, also one not known when traced.
    `keras.random.dropout` with `rate` itself is used instead for shapes not known when traced
    (JAX), torch tensors on an accelerator or under `torch.compile`, TensorFlow with a GPU or
    TPU present, and rates that rounding would move by more than 1% (torch and TensorFlow:
    below about 0.0015, or above 65535/65536). Our own masks are applied by multiplication:
    as with torch's dropout, a dropped inf or nan gives nan.

    Args:
        rate: in [0, 1).
        seed: optional int seed.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: any tensor; its Keras mask passes through.
        training: dropout is applied only when True.

    Returns:
        A tensor of the inputs' shape and dtype.

    Example:

    >>> Dropout(0.1, seed=0)(np.ones((2, 8), "float32"), training=True).shape
    (2, 8)
    """

    def __init__(self, rate, seed=None, **kwargs):
        super().__init__(**kwargs)
        self.rate = check_dropout("rate", rate)
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed) if self.rate > 0 else None
        self._effective_rate = effective_rate(self.rate)
        draws = _DRAWS.get(keras.backend.backend(), (None,))[0]
        # Our own draws only where rounding moves the rate by at most 1% (and never to 1).
        own = self._effective_rate < 1.0 and self._effective_rate - self.rate <= 0.01 * self.rate
        self._draws = draws if own else None
        self.supports_masking = True
        self.built = True

    def call(self, inputs, training=False):
        if not training or self.rate == 0:
            return inputs
        if self._draws == "split" and _split_draws_suit(inputs):
            # A CPU tensor: draw there, whatever Keras's device (torch on a GPU machine: CUDA).
            with keras.device("cpu"):
                return self._masked(inputs, self._split_keep(inputs))
        keep = self._threefry_keep(inputs) if self._draws == "threefry" else None
        if keep is None:
            return keras.random.dropout(inputs, self.rate, seed=self.seed_generator)
        return self._masked(inputs, keep)

    def _masked(self, inputs, keep):
        # A multiplication by the scaled mask, not a select: one tensor op less forward and
        # backward, which eager torch pays (as torch's own dropout, a dropped inf gives nan).
        scale = ops.cast(1.0 / (1.0 - self._effective_rate), inputs.dtype)
        return inputs * (ops.cast(keep, inputs.dtype) * scale)

    def _threefry_keep(self, inputs):
        shape = tuple(inputs.shape)
        if not all(isinstance(d, int) for d in shape):
            return None
        size = math.prod(shape)
        if size > 2**32:
            return None
        key = self.seed_generator.next()  # uint32 (2,), the key Keras gives jax.random
        index = ops.reshape(ops.arange(size, dtype="uint32"), shape)
        # One counter per neighbouring pair, computed per element so that XLA fuses it all
        # (and a sharded tensor computes its own elements' bits).
        counter = ops.right_shift(index, _u32(1))
        high, low = threefry2x32(key[0], key[1], ops.zeros_like(counter), counter)
        bits = ops.where(ops.equal(ops.bitwise_and(index, _u32(1)), _u32(0)), high, low)
        return ops.greater_equal(bits, _u32(self._effective_rate * _WORD))

    def _split_keep(self, inputs):
        shape = ops.shape(inputs)  # under TensorFlow, unknown dimensions are tensors
        size = math.prod(shape)
        # Four 16-bit numbers from each 64-bit integer (torch and TensorFlow make one from two
        # 32-bit outputs of their generators, so every bit is random; the range
        # [-2⁶³, 2⁶³ - 1) leaves out one of the 2⁶⁴ values, a bias of 2⁻⁶⁴).
        words = keras.random.randint((-(-size // 4), 1), -(2**63), 2**63 - 1, dtype="int64",
                                     seed=self.seed_generator)
        # (n, 1) int64 -> (n, 4) int16: a static last axis, as Keras's TensorFlow `view` needs.
        fields = ops.reshape(ops.reshape(ops.view(words, "int16"), (-1,))[:size], shape)
        # As int16 the numbers run over [-2¹⁵, 2¹⁵), each value once: the lowest k = rate · 2¹⁶
        # of them drop.
        threshold = int(self._effective_rate * _FIELD) - 2**15
        return ops.greater_equal(fields, ops.convert_to_tensor(threshold, dtype="int16"))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return super().get_config() | {"rate": self.rate, "seed": self.seed}
