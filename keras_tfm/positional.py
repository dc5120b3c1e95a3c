"""Positional information: fixed sinusoidal encodings and learned position embeddings.

Seed 000 "Positional encoding" and seed 004 §7–8: self-attention does not know where a token
sits, so a position vector is added to each token vector.
"""

import keras
from keras import ops

from keras_tfm._checks import check_rank

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")


SINUSOIDAL_LAYOUTS = ("interleaved", "halves")


def sinusoidal_encoding(length, width, start_index=0, max_wavelength=10000.0,
                        layout="interleaved"):
    """The sinusoidal table `PE[pos, :]` for `pos = start_index … start_index + length - 1`.

    With `w_i = max_wavelength^(-2i/width)`, each pair i holds `sin(pos · w_i)` and
    `cos(pos · w_i)`. `layout="interleaved"` (the paper, the seeds) puts the sine on channel 2i
    and the cosine on 2i + 1; `layout="halves"` (MarianMT, tensor2tensor) puts every sine in the
    first `ceil(width / 2)` channels and every cosine in the rest. An odd width keeps the sine of
    the last pair. Computed in float32.

    Returns:
        float32 tensor of shape `(length, width)`.
    """
    if layout not in SINUSOIDAL_LAYOUTS:
        raise ValueError(f"`layout` must be one of {SINUSOIDAL_LAYOUTS}; received {layout!r}.")
    pairs = (width + 1) // 2
    positions = ops.cast(ops.arange(length, dtype="int32") + ops.cast(start_index, "int32"),
                         "float32")
    exponents = ops.cast(ops.arange(pairs, dtype="int32"), "float32") * (2.0 / width)
    inverse_frequencies = ops.power(ops.cast(max_wavelength, "float32"), -exponents)
    angles = positions[:, None] * inverse_frequencies[None, :]  # (length, pairs)
    if layout == "halves":
        return ops.concatenate([ops.sin(angles), ops.cos(angles)[:, :width // 2]], axis=-1)
    table = ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1)  # (length, pairs, 2)
    table = ops.reshape(table, (length, 2 * pairs))
    return table[:, :width] if width % 2 else table


@_SERIALIZABLE
class SinusoidalPositionalEncoding(keras.layers.Layer):
    """Adds the fixed sinusoidal positional encoding of the transformer to its inputs.

    `PE(pos, 2i) = sin(pos / 10000^(2i/d))`, `PE(pos, 2i+1) = cos(pos / 10000^(2i/d))`; any
    sequence length works (no table, no maximum). Angles are computed in float32 and the
    encoding is cast to the compute dtype at the end. Odd `d` is supported (the last channel is
    a sine). The Keras mask of `inputs` passes through.

    Args:
        max_wavelength: the base 10000 of the formula.
        layout: `"interleaved"` (sine on even channels, cosine on odd: the paper and the seeds)
            or `"halves"` (all sines, then all cosines: MarianMT and tensor2tensor).
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, T, d)`.
        start_index: position of the first token (int or scalar int tensor), e.g. the step
            index in cached decoding. Default 0.

    Returns:
        `inputs + PE[start_index : start_index + T]`, shape `(B, T, d)`.

    Example:

    >>> SinusoidalPositionalEncoding()(np.zeros((1, 2, 4)))[0, 1]  # doctest: +SKIP
    [0.841, 0.540, 0.010, 1.000]
    """

    def __init__(self, max_wavelength=10000.0, layout="interleaved", **kwargs):
        super().__init__(**kwargs)
        if not max_wavelength > 0:
            raise ValueError(f"`max_wavelength` must be positive; received {max_wavelength!r}.")
        if layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"`layout` must be one of {SINUSOIDAL_LAYOUTS}; received "
                             f"layout={layout!r}.")
        self.max_wavelength = float(max_wavelength)
        self.layout = layout
        self.supports_masking = True
        self.built = True

    def call(self, inputs, start_index=0):
        check_rank(self, "inputs", inputs.shape, 3)
        encoding = sinusoidal_encoding(ops.shape(inputs)[1], inputs.shape[-1], start_index,
                                       self.max_wavelength, self.layout)
        return inputs + ops.cast(encoding, inputs.dtype)[None]

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return super().get_config() | {"max_wavelength": self.max_wavelength,
                                       "layout": self.layout}


@_SERIALIZABLE
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned position vector to each token vector (seed 004 §8).

    Args:
        sequence_length: size of the table: the longest sequence the layer accepts.
        initializer: initializer of the `(sequence_length, d)` table.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, T, d)`.
        start_index: position of the first token (int or scalar int tensor). Default 0.

    Returns:
        `inputs + P[start_index : start_index + T]`, shape `(B, T, d)`.

    Raises:
        ValueError: if `start_index + T > sequence_length` (checked where T and `start_index`
            are known when the layer is called; a start index given as a tensor cannot be
            checked).

    Example:

    >>> PositionEmbedding(sequence_length=16)(np.zeros((2, 10, 8))).shape  # doctest: +SKIP
    (2, 10, 8)
    """

    def __init__(self, sequence_length, initializer="glorot_uniform", **kwargs):
        super().__init__(**kwargs)
        if isinstance(sequence_length, bool) or not isinstance(sequence_length, int) or (
                sequence_length < 1):
            raise ValueError("`sequence_length` must be a positive integer; received "
                             f"sequence_length={sequence_length!r}.")
        self.sequence_length = sequence_length
        self.initializer = keras.initializers.get(initializer)
        self.supports_masking = True

    def build(self, input_shape):
        check_rank(self, "inputs", input_shape, 3)
        self.position_embeddings = self.add_weight(
            name="embeddings",
            shape=(self.sequence_length, input_shape[-1]),
            initializer=self.initializer,
        )

    def call(self, inputs, start_index=0):
        check_rank(self, "inputs", inputs.shape, 3)
        length = inputs.shape[1]
        if length is not None and isinstance(start_index, int) and (
                start_index + length > self.sequence_length):
            raise ValueError(
                f"{self.name}: positions {start_index}…{start_index + length - 1} do not fit the "
                f"learned table of sequence_length={self.sequence_length}; received inputs of "
                f"length {length} with start_index={start_index}."
            )
        length = ops.shape(inputs)[1]
        table = ops.slice(ops.convert_to_tensor(self.position_embeddings), (start_index, 0),
                          (length, inputs.shape[-1]))
        return inputs + ops.cast(table, inputs.dtype)[None]

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return super().get_config() | {
            "sequence_length": self.sequence_length,
            "initializer": keras.initializers.serialize(self.initializer),
        }


@_SERIALIZABLE
class RotaryEmbedding(keras.layers.Layer):
    """Rotary position embedding (RoPE) of queries or keys, per head.

    Each pair of channels `(a, b)` of a head is rotated by the angle
    `position · max_wavelength^(-2i/d)` (pair `i`, head size `d`):
    `(a cos θ − b sin θ, b cos θ + a sin θ)`. The score of a query rotated at position m and a
    key rotated at position n then depends on the positions only through m − n. By default the
    pairs are the two halves of the head (channel i with channel i + d/2: GPT-NeoX, LLaMA,
    keras_hub); `interleaved=True` pairs neighbouring channels (2i, 2i + 1: RoFormer, GPT-J).
    Angles are computed in float32 and the result is cast to the input's dtype. No weights.

    Args:
        max_wavelength: the base of the angles (10000 in RoFormer and LLaMA).
        interleaved: pair neighbouring channels instead of the two halves.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, T, H, d)`, queries or keys split into heads; `d` must be even.
        start_index: position of `inputs[:, 0]` (int or scalar int tensor), e.g. the cache
            index in cached decoding. Default 0.

    Returns:
        The rotated `(B, T, H, d)`.

    Example:

    >>> RotaryEmbedding()(np.ones((1, 3, 2, 4)), start_index=5).shape  # doctest: +SKIP
    (1, 3, 2, 4)
    """

    def __init__(self, max_wavelength=10000.0, interleaved=False, **kwargs):
        super().__init__(**kwargs)
        if not max_wavelength > 0:
            raise ValueError(f"`max_wavelength` must be positive; received {max_wavelength!r}.")
        self.max_wavelength = float(max_wavelength)
        self.interleaved = bool(interleaved)
        self.built = True

    def _check(self, shape):
        if len(shape) != 4:
            raise ValueError(f"{self.name}: `inputs` must have rank 4 (batch, length, heads, "
                             f"head size); received shape {tuple(shape)}.")
        if shape[-1] is None or shape[-1] % 2:
            raise ValueError(f"{self.name}: rotary positions rotate pairs of channels, so the "
                             f"head size must be even; received head size {shape[-1]}.")

    def call(self, inputs, start_index=0):
        self._check(inputs.shape)
        width = inputs.shape[-1]
        half = width // 2
        shape = ops.shape(inputs)
        # the same angles as the sinusoidal encoding of width d: sines, then cosines
        table = sinusoidal_encoding(shape[1], width, start_index, self.max_wavelength,
                                    layout="halves")[None, :, None, :]  # (1, T, 1, d)
        sin, cos = table[..., :half], table[..., half:]
        x = ops.cast(inputs, "float32")
        if self.interleaved:
            pairs = ops.reshape(x, (shape[0], shape[1], shape[2], half, 2))
            first, second = pairs[..., 0], pairs[..., 1]
            rotated = ops.stack([first * cos - second * sin, second * cos + first * sin], axis=-1)
            rotated = ops.reshape(rotated, (shape[0], shape[1], shape[2], width))
        else:
            first, second = x[..., :half], x[..., half:]
            rotated = ops.concatenate([first * cos - second * sin, second * cos + first * sin],
                                      axis=-1)
        return ops.cast(rotated, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return super().get_config() | {"max_wavelength": self.max_wavelength,
                                       "interleaved": self.interleaved}
