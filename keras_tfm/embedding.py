"""Token embedding plus positional information: the input of each transformer stack."""

import math

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._backend import unfused
from keras_tfm._checks import (check_positive_int, check_token_id, embed_or_nan,
                               with_quantized_dtypes)
from keras_tfm._layer_calls import call_layer, logits_against, tied_logits
from keras_tfm.positional import (SINUSOIDAL_LAYOUTS, PositionEmbedding,
                                  SinusoidalPositionalEncoding)

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")

POSITIONAL_KINDS = ("sinusoidal", "learned")


@_SERIALIZABLE
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Token embedding × √d_model (the paper) plus positional information.

    The padding mask of the model starts here: with `mask_zero=True` the token id `pad_id` (0 by
    default) is padding and the output carries the Keras mask `token_ids != pad_id`.

    A token id outside `[0, vocab_size)` gives a NaN vector on every backend (so a bad id
    in `fit` shows as a NaN loss); check ids up front with `keras_tfm.check_token_ids`.

    The same layer can also map hidden states back to vocabulary logits with its (transposed)
    token embedding matrix — `call(hidden, reverse=True)` — which is how `build_transformer`
    ties the target embedding to the output projection (plus a learned bias with
    `reverse_bias=True`, MarianMT's `final_logits_bias`).

    Args:
        vocab_size: number of token ids.
        d_model: embedding width.
        max_length: longest sequence; required for `positional="learned"` (the table size),
            ignored by the sinusoidal encoding, which takes any length.
        positional: `"sinusoidal"` (the paper's fixed encoding) or `"learned"`.
        positional_layout: channel layout of the sinusoidal encoding, `"interleaved"` (the
            paper) or `"halves"` (MarianMT); see `SinusoidalPositionalEncoding`.
        mask_zero: whether `pad_id` marks padding (and the output carries a Keras mask); named
            after the argument of `keras.layers.Embedding`.
        pad_id: the padding token id (MarianMT pads with its last id).
        scale: multiply the token embedding by √d_model before adding positions.
        reverse_bias: add a learned `(vocab_size,)` bias to the logits of `reverse=True`.
        freeze_pad: keep the `pad_id` row of the token matrix out of training (no gradient
            reaches it), as torch's `nn.Embedding(padding_idx=...)` and MarianMT do.
        embeddings_initializer: initializer of the token embedding matrix.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: int token ids `(B, T)`; or, with `reverse=True`, hidden states `(B, T, d_model)`.
        start_index: position of the first token (cached decoding feeds step t at position t).
        reverse: map hidden states to logits `(B, T, vocab_size)` instead.

    Returns:
        `(B, T, d_model)`, or logits `(B, T, vocab_size)` when `reverse`.

    Example:

    >>> emb = TokenAndPositionEmbedding(vocab_size=100, d_model=16)
    >>> emb(np.array([[5, 6, 0]])).shape
    (1, 3, 16)
    """

    def __init__(self, vocab_size, d_model, max_length=None, positional="sinusoidal",
                 mask_zero=True, scale=True, embeddings_initializer="uniform", pad_id=0,
                 positional_layout="interleaved", reverse_bias=False, freeze_pad=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = check_positive_int("vocab_size", vocab_size)
        self.d_model = check_positive_int("d_model", d_model)
        if positional not in POSITIONAL_KINDS:
            raise ValueError(f"`positional` must be one of {POSITIONAL_KINDS}; received "
                             f"positional={positional!r}.")
        if positional == "learned" and max_length is None:
            raise ValueError('`max_length` is required for positional="learned" (the size of '
                             "the learned position table); received max_length=None.")
        self.max_length = None if max_length is None else check_positive_int("max_length",
                                                                              max_length)
        if positional_layout not in SINUSOIDAL_LAYOUTS:
            raise ValueError(f"`positional_layout` must be one of {SINUSOIDAL_LAYOUTS}; "
                             f"received positional_layout={positional_layout!r}.")
        check_token_id("pad_id", pad_id, vocab_size)
        self.positional = positional
        self.positional_layout = positional_layout
        self.pad_id = pad_id
        self.reverse_bias = bool(reverse_bias)
        self.freeze_pad = bool(freeze_pad)
        self.mask_zero = bool(mask_zero)
        self.scale = bool(scale)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.supports_masking = True

    def build(self, input_shape):
        # Keras's ReversibleEmbedding: its tied reverse projection quantizes with the table.
        self.token_embedding = keras.layers.ReversibleEmbedding(
            self.vocab_size, self.d_model, tie_weights=True,
            embeddings_initializer=self.embeddings_initializer, dtype=self.dtype_policy,
            name="token_embedding")
        self.token_embedding.supports_masking = True  # reverse=True passes masked hidden states
        if self.positional == "learned":
            self.position = PositionEmbedding(self.max_length, dtype=self.dtype_policy,
                                              name="position_embedding")
        else:
            self.position = SinusoidalPositionalEncoding(layout=self.positional_layout,
                                                         dtype=self.dtype_policy,
                                                         name="position_encoding")
        if self.reverse_bias:
            self.logits_bias = self.add_weight(name="logits_bias", shape=(self.vocab_size,),
                                               initializer="zeros")
        self.token_embedding.build(input_shape[:2])
        self.position.build(tuple(input_shape[:2]) + (self.d_model,))

    def call(self, inputs, start_index=0, reverse=False):
        if reverse:
            return self._biased(call_layer(self.token_embedding, inputs, reverse=True))
        x = embed_or_nan(self.token_embedding, inputs, self.vocab_size)
        if self.freeze_pad:  # no gradient reaches the padding row (torch's padding_idx)
            is_pad = ops.equal(inputs, self.pad_id)[..., None]
            x = ops.where(is_pad, ops.stop_gradient(x), x)
        if self.scale:
            x = x * ops.cast(math.sqrt(self.d_model), x.dtype)
        return call_layer(self.position, x, start_index=start_index)

    def compute_mask(self, inputs, mask=None):
        if len(inputs.shape) == 3:  # reverse=True: hidden states keep their own mask
            return mask
        if not self.mask_zero:
            return None
        return masks_lib.padding_mask(inputs, pad_id=self.pad_id)

    def transposed_logits(self, hidden, table):
        """`call(hidden, reverse=True)` with the token table given transposed, `(d_model, V)`
        (a search's copy, `_backend.transposed_table`): the same logits `(B, T, V)`."""
        return self._biased(logits_against(hidden, table))

    def _biased(self, logits):
        if self.reverse_bias:
            logits = unfused(logits) + ops.cast(self.logits_bias, logits.dtype)
        return logits

    def compute_output_shape(self, input_shape, start_index=0, reverse=False):
        if reverse:
            return tuple(input_shape[:-1]) + (self.vocab_size,)
        return tuple(input_shape) + (self.d_model,)

    def compute_output_spec(self, inputs, start_index=0, reverse=False):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape, reverse=reverse),
                                 dtype=self.compute_dtype)

    def get_config(self):
        return with_quantized_dtypes(self, super().get_config()) | {
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "max_length": self.max_length,
            "positional": self.positional,
            "positional_layout": self.positional_layout,
            "pad_id": self.pad_id,
            "reverse_bias": self.reverse_bias,
            "freeze_pad": self.freeze_pad,
            "mask_zero": self.mask_zero,
            "scale": self.scale,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
        }


@_SERIALIZABLE
class TiedLogits(keras.layers.Layer):
    """Vocabulary logits with a token embedding's own matrix: `logits = h Eᵀ` (a tied output
    projection, as GPT-2's and tied LLaMA-family language models have; no bias).

    The layer owns no weights: it reads the matrix `E` (`(vocab, d_model)`) of the embedding
    layer it is given, so training updates one matrix through both uses and saving stores it
    once. A model that uses it rebuilds it from its own config (`LanguageModel` with
    `tie_embeddings=True`); a `TiedLogits` from `from_config` alone has no embedding to read.

    Args:
        embedding: the `keras.layers.Embedding` whose matrix is tied.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, T, d_model)`.

    Returns:
        Logits `(B, T, vocab)`.

    Example:

    >>> embedding = keras.layers.Embedding(100, 16)
    >>> hidden = embedding(np.ones((2, 5), "int32"))
    >>> TiedLogits(embedding)(hidden).shape
    (2, 5, 100)
    """

    def __init__(self, embedding=None, **kwargs):
        super().__init__(**kwargs)
        # A function, not an attribute Keras tracks: the matrix stays the embedding's alone
        # (counted, saved and trained once).
        self._embedding = lambda: embedding

    def call(self, inputs):
        embedding = self._embedding()
        if embedding is None:
            raise ValueError(f"{self.name}: a TiedLogits layer needs the embedding layer whose "
                             "matrix it uses (TiedLogits(embedding)).")
        return tied_logits(inputs, ops.cast(embedding.embeddings, inputs.dtype))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self._embedding().input_dim,)
