"""Transformer encoder and decoder blocks (seed 000 "Transformer Architecture", seed 003
"Full Computational Pipeline", seed 004 §10–20).

Each sublayer (self-attention, cross-attention, feed-forward) is wrapped in a residual
connection and a layer normalization: post-LN by default, `LayerNorm(x + Dropout(sublayer(x)))`
as in the paper and the seeds; with `norm_first=True`, pre-LN, `x + Dropout(sublayer(LayerNorm(x)))`.
The decoder-only and LLaMA-style variants are options: a decoder block without cross-attention,
RMSNorm, a gated feed-forward, rotary positions and grouped-query attention.
"""

import keras

from keras_tfm import masks as masks_lib
from keras_tfm._checks import check_dropout, check_key_value_heads, check_positive_int
from keras_tfm._checks import check_rank, check_same_batch, with_quantized_dtypes
from keras_tfm._layer_calls import call_layer
from keras_tfm.attention import CrossAttention, MultiHeadSelfAttention
from keras_tfm.dropout import Dropout
from keras_tfm.feedforward import FeedForward, get_activation
from keras_tfm.kv_cache import cache_keys_values, cache_spec

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")

NORMALIZATIONS = ("layer_norm", "rms_norm")


class _TransformerBlockBase(keras.layers.Layer):
    """Hyper-parameters, sublayer factories and the residual rule shared by both blocks."""

    def __init__(
        self,
        num_heads,
        ff_dim,
        dropout=0.1,
        attention_dropout=None,
        activation_dropout=None,
        activation="relu",
        norm_first=False,
        layer_norm_epsilon=1e-5,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        num_key_value_heads=None,
        rotary=False,
        rotary_max_wavelength=10000.0,
        rotary_interleaved=False,
        normalization="layer_norm",
        gated_feed_forward=False,
        use_bias=True,
        qkv_bias=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.qkv_bias = None if qkv_bias is None else bool(qkv_bias)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.num_key_value_heads = check_key_value_heads(num_heads, num_key_value_heads)
        self.rotary = bool(rotary)
        self.rotary_max_wavelength = float(rotary_max_wavelength)
        self.rotary_interleaved = bool(rotary_interleaved)
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"`normalization` must be one of {NORMALIZATIONS}; received "
                             f"normalization={normalization!r}.")
        self.normalization = normalization
        self.gated_feed_forward = bool(gated_feed_forward)
        self.use_bias = bool(use_bias)
        self.ff_dim = check_positive_int("ff_dim", ff_dim)
        self.dropout = check_dropout("dropout", dropout)
        self.attention_dropout = None if attention_dropout is None else check_dropout(
            "attention_dropout", attention_dropout)
        self.activation_dropout = None if activation_dropout is None else check_dropout(
            "activation_dropout", activation_dropout)
        self.activation = get_activation(activation)
        self.norm_first = bool(norm_first)
        self.layer_norm_epsilon = float(layer_norm_epsilon)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True

    def _check_width(self, input_shape):
        d_model = input_shape[-1]
        if d_model is not None and d_model % self.num_heads:
            raise ValueError(
                f"{self.name}: d_model={d_model} is not divisible by num_heads={self.num_heads}."
            )
        return d_model

    def _common(self, name):
        return dict(kernel_initializer=self.kernel_initializer,
                    bias_initializer=self.bias_initializer, dtype=self.dtype_policy, name=name)

    def _rate(self, override):
        """A sublayer's dropout rate: its own when given, else `dropout`."""
        return self.dropout if override is None else override

    def _attention(self, cls, name, **kwargs):
        return cls(num_heads=self.num_heads, dropout=self._rate(self.attention_dropout),
                   num_key_value_heads=self.num_key_value_heads,
                   use_bias=self.use_bias if self.qkv_bias is None else self.qkv_bias,
                   output_bias=self.use_bias, **kwargs, **self._common(name))

    def _self_attention(self, input_shape, causal):
        self.self_attention = self._attention(
            MultiHeadSelfAttention, "self_attention", causal=causal, rotary=self.rotary,
            rotary_max_wavelength=self.rotary_max_wavelength,
            rotary_interleaved=self.rotary_interleaved)
        self.self_attention.build(input_shape)
        self.self_attention_norm = self._norm("self_attention_norm", input_shape)
        self.self_attention_dropout = self._dropout("self_attention_dropout")

    def _norm(self, name, input_shape):
        cls = (keras.layers.RMSNormalization if self.normalization == "rms_norm"
               else keras.layers.LayerNormalization)
        norm = cls(epsilon=self.layer_norm_epsilon, dtype=self.dtype_policy, name=name)
        norm.build(input_shape)
        return norm

    def _dropout(self, name):
        return Dropout(self.dropout, dtype=self.dtype_policy, name=name)

    def _build_feed_forward(self, input_shape):
        self.feed_forward = FeedForward(self.ff_dim, activation=self.activation,
                                        dropout=self._rate(self.activation_dropout),
                                        gated=self.gated_feed_forward, use_bias=self.use_bias,
                                        **self._common("feed_forward"))
        self.feed_forward.build(input_shape)
        self.feed_forward_norm = self._norm("feed_forward_norm", input_shape)
        self.feed_forward_dropout = self._dropout("feed_forward_dropout")

    def _residual(self, x, sublayer, norm, dropout, training):
        """Residual connection and layer normalization around `sublayer`, post- or pre-LN
        (the dropout only in training)."""
        def dropped(h):
            return call_layer(dropout, h, training=training) if training else h

        if self.norm_first:
            return x + dropped(sublayer(call_layer(norm, x)))
        return call_layer(norm, x + dropped(sublayer(x)))

    def _feed_forward_residual(self, x, training):
        return self._residual(x, lambda h: call_layer(self.feed_forward, h, training=training),
                              self.feed_forward_norm, self.feed_forward_dropout, training)

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return input_shape

    def get_config(self):
        return with_quantized_dtypes(self, super().get_config()) | {
            "num_heads": self.num_heads,
            "ff_dim": self.ff_dim,
            "dropout": self.dropout,
            "attention_dropout": self.attention_dropout,
            "activation_dropout": self.activation_dropout,
            "activation": keras.activations.serialize(self.activation),
            "norm_first": self.norm_first,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "num_key_value_heads": self.num_key_value_heads,
            "rotary": self.rotary,
            "rotary_max_wavelength": self.rotary_max_wavelength,
            "rotary_interleaved": self.rotary_interleaved,
            "normalization": self.normalization,
            "gated_feed_forward": self.gated_feed_forward,
            "use_bias": self.use_bias,
            "qkv_bias": self.qkv_bias,
        }


@_SERIALIZABLE
class TransformerEncoderBlock(_TransformerBlockBase):
    """One encoder layer: self-attention → add & norm → feed-forward → add & norm.

    Args:
        num_heads: attention heads; must divide `d_model`.
        ff_dim: hidden width of the feed-forward network.
        dropout: rate of the residual dropout and, unless given separately below, of the
            attention weights and of the feed-forward's hidden units (as in
            `torch.nn.TransformerEncoderLayer`).
        attention_dropout: rate on the attention weights; defaults to `dropout`.
        activation_dropout: rate on the feed-forward's hidden units; defaults to `dropout`
            (0 gives the paper's and keras_hub's placement: residuals and embeddings only,
            plus the attention weights unless `attention_dropout=0`).
        activation: feed-forward activation (ReLU in the paper; any Keras activation, or
            `"gelu_approximate"`, the tanh approximation of GPT-2's `gelu_new`).
        norm_first: False for post-LN (the paper), True for pre-LN.
        layer_norm_epsilon: epsilon of the layer normalizations.
        kernel_initializer, bias_initializer: for every dense projection.
        num_key_value_heads: key/value heads of the attention (grouped-query attention, see
            `MultiHeadSelfAttention`); None: `num_heads`.
        rotary, rotary_max_wavelength, rotary_interleaved: rotary positions in the
            self-attention (see `RotaryEmbedding`).
        normalization: `"layer_norm"` (`keras.layers.LayerNormalization`, the paper) or
            `"rms_norm"` (`keras.layers.RMSNormalization`, LLaMA); both use
            `layer_norm_epsilon`.
        gated_feed_forward: a gated feed-forward (`FeedForward(gated=True)`: SwiGLU with
            `activation="silu"`, GeGLU with `"gelu"`).
        use_bias: whether the attention and feed-forward projections have biases.
        qkv_bias: whether the query, key and value projections have biases, when that differs
            from `use_bias` (Qwen2: `use_bias=False, qkv_bias=True`); None: `use_bias`.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, S, d_model)`. Its Keras mask pads the self-attention keys and is
            propagated to the output.
        attention_mask: optional bool `(B, S, S)` or `(S, S)`, True where attention is allowed.
        training: whether dropout is active.
        mask: the Keras padding mask `(B, S)` of `inputs`; filled in by Keras.

    Returns:
        `(B, S, d_model)`.

    Example:

    >>> TransformerEncoderBlock(num_heads=2, ff_dim=32)(keras.random.normal((2, 5, 8))).shape
    (2, 5, 8)
    """

    def build(self, input_shape):
        check_rank(self, "inputs", input_shape, 3)
        self._check_width(input_shape)
        self._self_attention(input_shape, causal=False)
        self._build_feed_forward(input_shape)

    def call(self, inputs, attention_mask=None, training=None, mask=None):
        check_rank(self, "inputs", inputs.shape, 3)
        if mask is None:
            mask = masks_lib.keras_mask(inputs)
        x = self._residual(
            inputs,
            lambda h: call_layer(self.self_attention, h, attention_mask=attention_mask,
                                 training=training, mask=mask),
            self.self_attention_norm, self.self_attention_dropout, training)
        return self._feed_forward_residual(x, training)


@_SERIALIZABLE
class TransformerDecoderBlock(_TransformerBlockBase):
    """One decoder layer: causal self-attention → add & norm → cross-attention → add & norm →
    feed-forward → add & norm.

    The cross-attention takes its queries from the decoder and its keys and values from
    `encoder_outputs` ("encoder-decoder attention"). Source length S and target length T may
    differ; the widths of `inputs` and `encoder_outputs` must be equal. A block first called
    (built) without `encoder_outputs` has no cross-attention: the block of a decoder-only
    model (causal self-attention → feed-forward), as keras_hub's `TransformerDecoder`.

    Args:
        As `TransformerEncoderBlock`.

    Call arguments:
        inputs: `(B, T, d_model)`, the decoder stream. Its Keras mask pads the self-attention
            keys and is propagated to the output.
        encoder_outputs: `(B, S, d_model)`. Its Keras mask pads the cross-attention keys.
            Leave it out for a decoder-only block.
        self_attention_mask: optional bool `(B, T, T)` or `(T, T)`, ANDed with the causal mask.
        cross_attention_mask: optional bool `(B, T, S)` or `(T, S)`.
        training: whether dropout is active.
        return_attention_scores: also return the self- and cross-attention weights,
            `(B, H, T, T)` and `(B, H, T, S)`.
        self_attention_cache: key/value cache of the self-attention for cached decoding,
            `(B, 2, num_key_value_heads, L, key_dim)` or its `(keys, values)` pair; see
            `MultiHeadSelfAttention`.
        self_attention_cache_update_index: position of `inputs[:, 0]` in the cache.
        cross_attention_cache: `block.cross_attention.compute_context_cache(encoder_outputs)`
            (or its `(keys, values)` pair), computed once per source batch and used instead of
            `encoder_outputs` (then pass `encoder_outputs_mask` yourself). It may have one row
            per `m` rows of `inputs` (beams of a source; see `CrossAttention`).
        inputs_mask, encoder_outputs_mask: Keras masks `(B, T)`, `(B, S)`; filled in by Keras.

    Returns:
        `(B, T, d_model)`; `(output, self_scores, cross_scores)` with
        `return_attention_scores` (`(output, self_scores)` without cross-attention);
        `(output, updated_self_attention_cache)` with a cache.

    Example:

    >>> block = TransformerDecoderBlock(num_heads=2, ff_dim=32)
    >>> block(keras.random.normal((2, 4, 8)), keras.random.normal((2, 7, 8))).shape
    (2, 4, 8)
    >>> TransformerDecoderBlock(num_heads=2, ff_dim=32)(keras.random.normal((2, 4, 8))).shape
    (2, 4, 8)
    """

    def build(self, inputs_shape, encoder_outputs_shape=None):
        check_rank(self, "inputs", inputs_shape, 3)
        self._check_width(inputs_shape)
        self._self_attention(inputs_shape, causal=True)
        self.cross_attention = None
        if encoder_outputs_shape is not None:
            check_rank(self, "encoder_outputs", encoder_outputs_shape, 3)
            self._check_matching(inputs_shape, encoder_outputs_shape)
            self.cross_attention = self._attention(CrossAttention, "cross_attention")
            self.cross_attention.build(inputs_shape, encoder_outputs_shape)
            self.cross_attention_norm = self._norm("cross_attention_norm", inputs_shape)
            self.cross_attention_dropout = self._dropout("cross_attention_dropout")
        self._build_feed_forward(inputs_shape)

    def _check_matching(self, inputs_shape, encoder_outputs_shape):
        check_same_batch(self, "inputs", inputs_shape, "encoder_outputs", encoder_outputs_shape)
        d_dec, d_enc = inputs_shape[-1], encoder_outputs_shape[-1]
        if d_dec is not None and d_enc is not None and d_dec != d_enc:
            raise ValueError(
                f"{self.name}: the decoder width ({d_dec}) and the encoder output width "
                f"({d_enc}) must be equal; received inputs {tuple(inputs_shape)} and "
                f"encoder_outputs {tuple(encoder_outputs_shape)}."
            )

    def call(self, inputs, encoder_outputs=None, self_attention_mask=None,
             cross_attention_mask=None, training=None, return_attention_scores=False,
             self_attention_cache=None, self_attention_cache_update_index=None,
             cross_attention_cache=None, inputs_mask=None, encoder_outputs_mask=None):
        check_rank(self, "inputs", inputs.shape, 3)
        has_context = encoder_outputs is not None or cross_attention_cache is not None
        if self.cross_attention is None and has_context:
            raise ValueError(f"{self.name}: this block was built without `encoder_outputs` "
                             "(decoder-only: no cross-attention), so it takes no "
                             "`encoder_outputs` or `cross_attention_cache`.")
        if encoder_outputs is not None:
            check_rank(self, "encoder_outputs", encoder_outputs.shape, 3)
            self._check_matching(inputs.shape, encoder_outputs.shape)
        elif self.cross_attention is not None and cross_attention_cache is None:
            raise ValueError(f"{self.name}: pass `encoder_outputs` or `cross_attention_cache`.")
        if self_attention_cache is not None and return_attention_scores:
            raise ValueError(f"{self.name}: `return_attention_scores` is not available with a "
                             "cache.")
        scores = {}

        def self_attention(h):
            result = call_layer(
                self.self_attention, h, attention_mask=self_attention_mask, training=training,
                mask=inputs_mask, return_attention_scores=return_attention_scores,
                cache=self_attention_cache,
                cache_update_index=self_attention_cache_update_index)
            if self_attention_cache is not None:
                result, scores["cache"] = result
            elif return_attention_scores:
                result, scores["self"] = result
            return result

        def cross_attention(h):
            result = call_layer(
                self.cross_attention, h, encoder_outputs, attention_mask=cross_attention_mask,
                training=training, return_attention_scores=return_attention_scores,
                context_cache=cross_attention_cache, query_mask=inputs_mask,
                context_mask=encoder_outputs_mask)
            if return_attention_scores:
                result, scores["cross"] = result
            return result

        x = self._residual(inputs, self_attention, self.self_attention_norm,
                           self.self_attention_dropout, training)
        if self.cross_attention is not None:
            x = self._residual(x, cross_attention, self.cross_attention_norm,
                               self.cross_attention_dropout, training)
        x = self._feed_forward_residual(x, training)
        if self_attention_cache is not None:
            return x, scores["cache"]
        if return_attention_scores:
            if self.cross_attention is None:
                return x, scores["self"]
            return x, scores["self"], scores["cross"]
        return x

    def call_with_cache(self, inputs, self_attention_cache, cache_update_index,
                        cross_attention_cache=None, encoder_outputs_mask=None):
        """One cached decoding step (inference: no dropout, no attention weights).

        Args:
            inputs: `(R, T, d_model)` at positions `cache_update_index … + T - 1`.
            self_attention_cache: `self_attention.empty_cache(R, L)`, filled before
                `cache_update_index` (see `MultiHeadSelfAttention.call_with_cache`).
            cache_update_index: int or scalar int tensor.
            cross_attention_cache: `cross_attention.compute_context_cache(encoder_outputs)` or
                its `(keys, values)` pair, of `B` rows with `R = m·B` (see
                `CrossAttention.call_with_cache`); required with cross-attention.
            encoder_outputs_mask: bool `(B, S)`, True for real source positions; every row
                needs one.

        Returns:
            `(output (R, T, d_model), self_attention_cache)`, the cache updated (in place under
            PyTorch with autograd off).
        """
        if self.cross_attention is not None and cross_attention_cache is None:
            raise ValueError(f"{self.name}: pass `cross_attention_cache` (this block has "
                             "cross-attention).")
        updated = []

        def self_attention(h):
            h, cache = self.self_attention.call_with_cache(h, self_attention_cache,
                                                           cache_update_index)
            updated.append(cache)
            return h

        x = self._residual(inputs, self_attention, self.self_attention_norm,
                           self.self_attention_dropout, False)
        if self.cross_attention is not None:
            x = self._residual(
                x, lambda h: self.cross_attention.call_with_cache(h, cross_attention_cache,
                                                                  encoder_outputs_mask),
                self.cross_attention_norm, self.cross_attention_dropout, False)
        return self._feed_forward_residual(x, False), updated[0]

    def compute_output_spec(self, inputs, encoder_outputs=None, *args,
                            return_attention_scores=False, self_attention_cache=None,
                            cross_attention_cache=None, **kwargs):
        output = keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)
        if self_attention_cache is not None:
            return output, cache_spec(self_attention_cache)
        if return_attention_scores:
            batch, length = inputs.shape[0], inputs.shape[1]
            self_scores = keras.KerasTensor((batch, self.num_heads, length, length),
                                            dtype=self.compute_dtype)
            if encoder_outputs is None and cross_attention_cache is None:
                return output, self_scores
            source_length = (encoder_outputs.shape[1] if encoder_outputs is not None
                             else cache_keys_values(cross_attention_cache)[0].shape[2])
            return (output, self_scores,
                    keras.KerasTensor((batch, self.num_heads, length, source_length),
                                      dtype=self.compute_dtype))
        return output
