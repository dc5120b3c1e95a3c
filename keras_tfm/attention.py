"""Scaled dot-product attention and the two multi-head attention layers of the transformer.

Seed 000 ("Self-Attention", "Multi-Head Attention") and seed 003: per head,
`softmax(Q Kᵀ / √d_k) V`; heads are concatenated and projected by `W_O`.
"""

import math

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._backend import (attention_scores, dot_product_attention, filled_part,
                                reads_cache_views, update_cache)
from keras_tfm._checks import clone_initializer
from keras_tfm._checks import check_dropout, check_key_value_heads, check_positive_int
from keras_tfm._checks import check_rank, check_same_batch, with_quantized_dtypes
from keras_tfm._layer_calls import call_layer
from keras_tfm.dropout import Dropout
from keras_tfm.kv_cache import (cache_keys_values, cache_spec, fold_query_rows, heads_first,
                                unfold_query_rows)
from keras_tfm.positional import RotaryEmbedding

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    dropout=None,
    training=None,
    return_weights=False,
    fused=None,
    heads_first=False,
    causal=False,
):
    """`softmax(Q Kᵀ / √d_k) V` for every head, with masking and attention dropout.

    Two paths give the same numbers: the fused path (`keras.ops.dot_product_attention`, used
    when no weights are requested, no attention dropout is active, `d_v == d_k` and, for keys
    heads first, under PyTorch) and the explicit path
    (scores, float32 softmax, dropout, weighted sum). A query row whose mask allows no key gives
    zeros (and zero weights) on both paths, never NaN nor a uniform average.

    Args:
        query: `(B, T, H, d_k)`.
        key: `(B, S, H, d_k)`, or `(B, H, S, d_k)` with `heads_first`.
        value: `(B, S, H, d_v)`, or `(B, H, S, d_v)` with `heads_first`.
        mask: optional bool (or 0/1) `(B, T, S)` or `(T, S)`, or broadcasting to `(B, T, S)`;
            True where attention is allowed. Shape and values are checked (see `masks`).
        dropout: optional callable `dropout(weights, training=...)` applied to the weights.
        training: Python bool, whether dropout is active.
        return_weights: also return the attention weights `(B, H, T, S)`.
        fused: None picks the fused path when possible; False forces the explicit path.
        heads_first: the keys and values come heads first, `(B, H, S, d)`: the layout of the
            key/value caches, which a decoding step's products read without transposing them.
        causal: also apply `masks.causal_mask(T, S)`. With no other `mask` and `T == S`
            (uncached self-attention) no mask tensor is built: the fused kernel masks causally
            itself, and no row can be left without a key.

    Returns:
        The attention output `(B, T, H, d_v)`, and the weights when `return_weights`.
    """
    keys_like = key[:, 0] if heads_first else key  # `(B, S, ...)`: the key length on axis 1
    if mask is not None:
        mask = masks_lib.check_attention_mask(mask, query, keys_like)
    causal_only = causal and mask is None and masks_lib.same_length(query, keys_like)
    if causal and not causal_only:
        mask = masks_lib.merge_masks(query, keys_like, attention_mask=mask, causal=True)
    scale = 1.0 / math.sqrt(query.shape[-1])
    row_has_key = None
    if mask is not None:
        mask, row_has_key = open_empty_rows(mask)
    dropout_active = dropout is not None and bool(training) and getattr(dropout, "rate", 1.0) > 0
    # keras.ops.dot_product_attention needs values as wide as the keys (d_v == d_k).
    use_fused = (fused is not False and not return_weights and not dropout_active
                 and value.shape[-1] == query.shape[-1]
                 and (not heads_first or reads_cache_views()))
    weights = None
    if use_fused:
        output = dot_product_attention(query, key, value, mask, scale, heads_first,
                                       causal=causal_only)
        if row_has_key is not None:  # (the explicit path zeroes these rows' weights instead)
            output = zero_empty_rows(output, row_has_key)
    else:
        keys = "bhsd" if heads_first else "bshd"
        if heads_first and _half(key.dtype):
            # A cached step under JAX / TensorFlow: its scores in float32, as the fused path
            # accumulates them (bfloat16 scores doubled the error of a step against float32).
            # A half-precision cache's keys are read as float32 (a copy a step).
            query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
        scores = attention_scores(query, key, heads_first)
        scores = ops.cast(scores, "float32") * scale
        if causal_only:
            mask = masks_lib.causal_mask(ops.shape(query)[1], ops.shape(keys_like)[1])[None, None]
        if mask is not None:
            scores = masks_lib.apply_to_scores(scores, mask)
        weights = ops.softmax(scores, axis=-1)
        if row_has_key is not None:
            weights = ops.where(row_has_key[:, None, :, None], weights, 0.0)
        weights = ops.cast(weights, value.dtype)
        attended = dropout(weights, training=training) if dropout_active else weights
        output = ops.einsum(f"bhts,{keys}->bthd", attended, value)
    if return_weights:
        return output, weights
    return output


def open_empty_rows(mask):
    """`(mask (B, 1, T, S), row_has_key (B, T))` of a checked mask `(B, T, S)`: a query row
    whose mask allows no key attends everywhere instead (finite on every backend and every
    path, gradients included), and `row_has_key` says which rows must be zeroed afterwards
    (`zero_empty_rows`; the explicit path zeroes their weights). The new axis broadcasts over
    heads."""
    row_has_key = ops.any(mask, axis=-1)
    mask = ops.logical_or(mask, ops.logical_not(row_has_key)[..., None])
    return mask[:, None], row_has_key


def zero_empty_rows(output, row_has_key):
    """`output (B, T, H, d)` with the rows of the queries that see no key set to zeros."""
    return ops.where(row_has_key[:, :, None, None], output, ops.zeros_like(output))


def _half(dtype):
    return keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")


class _MultiHeadAttentionBase(keras.layers.Layer):
    """Projections, attention and output projection shared by both attention layers."""

    def __init__(
        self,
        num_heads,
        key_dim=None,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        num_key_value_heads=None,
        output_bias=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.output_bias = None if output_bias is None else bool(output_bias)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.num_key_value_heads = check_key_value_heads(num_heads, num_key_value_heads)
        self.key_dim = None if key_dim is None else check_positive_int("key_dim", key_dim)
        self.value_dim = None if value_dim is None else check_positive_int("value_dim", value_dim)
        self.dropout = check_dropout("dropout", dropout)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.supports_masking = True

    def _dense(self, name, equation, output_shape, bias_axes, use_bias=None):
        use_bias = self.use_bias if use_bias is None else use_bias
        dense = keras.layers.EinsumDense(
            equation,
            output_shape=output_shape,
            bias_axes=bias_axes if use_bias else None,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            kernel_regularizer=self.kernel_regularizer,
            bias_regularizer=self.bias_regularizer,
            kernel_constraint=self.kernel_constraint,
            bias_constraint=self.bias_constraint,
            dtype=self.dtype_policy,
            name=name,
        )
        # Projections are position-wise: the Keras mask of their input may pass through (this
        # also keeps Keras from warning that the mask is dropped).
        dense.supports_masking = True
        return dense

    def _build_projections(self, query_shape, context_shape):
        d_model = query_shape[-1]
        if d_model is None:
            raise ValueError(f"{self.name}: the last (model) dimension must be known.")
        if self.key_dim is None and d_model % self.num_heads:
            raise ValueError(
                f"{self.name}: d_model={d_model} is not divisible by num_heads={self.num_heads}; "
                "pass key_dim explicitly or choose num_heads dividing d_model."
            )
        self._d_model = d_model
        self._key_dim = self.key_dim or d_model // self.num_heads
        self._value_dim = self.value_dim or self._key_dim
        heads, kv_heads = self.num_heads, self._kv_heads
        self.query_dense = self._dense("query", "btd,dhk->bthk", (None, heads, self._key_dim), "hk")
        self.key_dense = self._dense("key", "bsd,dhk->bshk", (None, kv_heads, self._key_dim),
                                     "hk")
        self.value_dense = self._dense("value", "bsd,dhk->bshk", (None, kv_heads, self._value_dim),
                                       "hk")
        self.output_dense = self._dense("attention_output", "bthk,hkd->btd", (None, d_model), "d",
                                        use_bias=self.output_bias)
        self.query_dense.build(query_shape)
        self.key_dense.build(context_shape)
        self.value_dense.build(context_shape)
        self.output_dense.build((query_shape[0], query_shape[1], heads, self._value_dim))
        self.dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy,
                                     name="attention_dropout")

    @property
    def _kv_heads(self):
        return self.num_key_value_heads or self.num_heads

    def _rotate(self, x, start_index):
        """Rotary positions on queries or keys `(B, T, H, d)`; the identity without them."""
        rotary = getattr(self, "rotary_embedding", None)
        return x if rotary is None else call_layer(rotary, x, start_index=start_index)

    def _project_context(self, context, start_index=0):
        """Keys and values `(B, S, num_key_value_heads, d)` of `context`."""
        return (self._rotate(call_layer(self.key_dense, context), start_index),
                call_layer(self.value_dense, context))

    def _check_cacheable(self):
        if self._value_dim != self._key_dim:
            raise ValueError(f"{self.name}: a key/value cache stacks keys and values, so it "
                             f"needs value_dim == key_dim; received key_dim={self._key_dim}, "
                             f"value_dim={self._value_dim}.")

    def _attend(self, query, keys, values, mask, training, return_attention_scores,
                heads_first=False, queries=None, causal=False):
        """Attend from `query` (or its projected `queries`) over `keys` and `values` (`mask`,
        and the causal mask with `causal`), then project the heads' outputs."""
        groups = self.num_heads // self._kv_heads
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
            axis = 1 if heads_first else 2
            keys, values = ops.repeat(keys, groups, axis), ops.repeat(values, groups, axis)
        if queries is None:
            queries = self._rotate(call_layer(self.query_dense, query), 0)
        result = scaled_dot_product_attention(
            queries, keys, values, mask=mask, dropout=self.dropout_layer, training=training,
            return_weights=return_attention_scores, heads_first=heads_first, causal=causal,
        )
        if return_attention_scores:
            attended, scores = result
            return call_layer(self.output_dense, attended), scores
        return call_layer(self.output_dense, result)

    def _attend_step(self, queries, keys, values, mask):
        """A cached step's attention (no weights, no dropout) of `queries (B, T, H, d)` over
        keys and values `(B, H_kv, S, d)`, `mask` None or bool `(B|1, T|1, S)` leaving every
        row a key (no empty-row guard); the output projected."""
        groups = self.num_heads // self._kv_heads
        if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
            keys, values = ops.repeat(keys, groups, 1), ops.repeat(values, groups, 1)
        if reads_cache_views():
            output = dot_product_attention(queries, keys, values,
                                           None if mask is None else mask[:, None],
                                           1.0 / math.sqrt(self._key_dim), heads_first=True)
        else:
            output = scaled_dot_product_attention(queries, keys, values, mask=mask,
                                                  heads_first=True)
        return call_layer(self.output_dense, output)

    def _output_spec(self, query, context_length, return_attention_scores):
        out = keras.KerasTensor(query.shape[:-1] + (self._d_model,), dtype=self.compute_dtype)
        if not return_attention_scores:
            return out
        scores_shape = (query.shape[0], self.num_heads, query.shape[1], context_length)
        return out, keras.KerasTensor(scores_shape, dtype=self.compute_dtype)

    def compute_output_shape(self, input_shape, *args, **kwargs):
        return tuple(input_shape[:-1]) + (self._d_model,)

    def get_config(self):
        config = with_quantized_dtypes(self, super().get_config())
        config.update(
            num_heads=self.num_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            dropout=self.dropout,
            use_bias=self.use_bias,
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=keras.initializers.serialize(self.bias_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            bias_regularizer=keras.regularizers.serialize(self.bias_regularizer),
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            bias_constraint=keras.constraints.serialize(self.bias_constraint),
            num_key_value_heads=self.num_key_value_heads,
            output_bias=self.output_bias,
        )
        return config


@_SERIALIZABLE
class MultiHeadSelfAttention(_MultiHeadAttentionBase):
    """Multi-head self-attention: queries, keys and values all come from `inputs`.

    Each of the `num_heads` heads projects the input to queries and keys of size `key_dim` and
    values of size `value_dim`, computes `softmax(Q Kᵀ / √key_dim) V`, and the concatenated heads
    are projected back to the input width `d_model` by `W_O`.

    Args:
        num_heads: number of heads (≥ 1).
        key_dim: size of each head's queries and keys; defaults to `d_model // num_heads`
            (then `d_model` must be divisible by `num_heads`).
        value_dim: size of each head's values; defaults to `key_dim`.
        dropout: dropout rate on the attention weights, in [0, 1).
        use_bias: whether the projections have biases.
        output_bias: whether the output projection has one; None (default): `use_bias`
            (`use_bias=True, output_bias=False`: biases on the query, key and value
            projections only, as Qwen2).
        causal: if True, position i attends only to positions ≤ i.
        num_key_value_heads: heads of the keys and values (grouped-query attention): must
            divide `num_heads`, each key/value head serving `num_heads // num_key_value_heads`
            query heads; 1 is multi-query attention. None (default): `num_heads`.
        rotary: apply rotary positions (`RotaryEmbedding`) to the queries and keys; the head
            size must be even.
        rotary_max_wavelength, rotary_interleaved: the `RotaryEmbedding`'s arguments.
        kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer,
            kernel_constraint, bias_constraint: for the four projections.
        **kwargs: base `Layer` arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(B, T, d_model)`. Its Keras mask (e.g. from `Embedding(mask_zero=True)`) is the
            padding mask of the keys, and is propagated to the output.
        attention_mask: optional bool `(B, T, T)` or `(T, T)`, True where attention is allowed;
            combined (AND) with the padding and causal masks.
        training: whether attention dropout is active.
        return_attention_scores: also return the attention weights `(B, H, T, T)`.
        cache: optional key/value cache for autoregressive decoding (causal layers only), a
            preallocated tensor `(B, 2, num_key_value_heads, L, key_dim)`, heads first (keys
            at `[:, 0]`, values at `[:, 1]`; needs `value_dim == key_dim`), or its
            `(keys, values)` pair of `(B, num_key_value_heads, L, key_dim)` tensors (what
            generation passes: see `cache_keys_values`). The keys and values of `inputs` are
            written at positions `cache_update_index … cache_update_index + T - 1`, and the
            queries attend over the cache, query i seeing keys `0 … cache_update_index + i`.
            With rotary positions the cache holds rotated keys.
        cache_update_index: int or scalar int tensor, the position of `inputs[:, 0]`.
        mask: the Keras padding mask `(B, T)` of `inputs`; filled in by Keras. (With a cache
            the keys come from the cache and this mask is not used.)

    Returns:
        `(B, T, d_model)`, or `(output, scores)` when `return_attention_scores`; with a cache,
        the updated cache (in the form given) is appended: `(output, cache)` or
        `(output, scores, cache)`.

    Example:

    >>> x = keras.random.normal((2, 5, 16))
    >>> MultiHeadSelfAttention(num_heads=4, causal=True)(x).shape
    (2, 5, 16)
    """

    def __init__(self, num_heads, key_dim=None, value_dim=None, dropout=0.0, use_bias=True,
                 causal=False, kernel_initializer="glorot_uniform", rotary=False,
                 rotary_max_wavelength=10000.0, rotary_interleaved=False, **kwargs):
        super().__init__(num_heads, key_dim=key_dim, value_dim=value_dim, dropout=dropout,
                         use_bias=use_bias, kernel_initializer=kernel_initializer, **kwargs)
        self.causal = bool(causal)
        self.rotary = bool(rotary)
        self.rotary_max_wavelength = float(rotary_max_wavelength)
        self.rotary_interleaved = bool(rotary_interleaved)
        if self.rotary:  # validates the wavelength now
            RotaryEmbedding(self.rotary_max_wavelength, self.rotary_interleaved)

    def build(self, input_shape):
        check_rank(self, "inputs", input_shape, 3)
        self._build_projections(input_shape, input_shape)
        if self.rotary:
            if self._key_dim % 2:
                raise ValueError(f"{self.name}: rotary positions need an even head size; "
                                 f"received key_dim={self._key_dim}.")
            self.rotary_embedding = RotaryEmbedding(
                self.rotary_max_wavelength, self.rotary_interleaved, dtype=self.dtype_policy,
                name="rotary_embedding")

    def call(self, inputs, attention_mask=None, training=None, return_attention_scores=False,
             cache=None, cache_update_index=None, mask=None):
        check_rank(self, "inputs", inputs.shape, 3)
        if cache is not None:
            return self.call_with_cache(inputs, cache, cache_update_index, attention_mask,
                                        training, return_attention_scores)
        if mask is None:
            mask = masks_lib.keras_mask(inputs)
        merged = masks_lib.merge_masks(inputs, inputs, key_padding_mask=mask,
                                       attention_mask=attention_mask)
        keys, values = self._project_context(inputs)
        return self._attend(inputs, keys, values, merged, training, return_attention_scores,
                            causal=self.causal)

    def empty_cache(self, batch_size, length, dtype=None):
        """A zero key/value cache for `call_with_cache`: a `(keys, values)` pair of
        `(batch_size, num_key_value_heads, length, key_dim)` tensors (`dtype`: the layer's
        compute dtype by default)."""
        self._check_cacheable()
        shape = (batch_size, self._kv_heads, length, self._key_dim)
        dtype = dtype or self.compute_dtype
        return ops.zeros(shape, dtype=dtype), ops.zeros(shape, dtype=dtype)

    def call_with_cache(self, inputs, cache, cache_update_index, attention_mask=None,
                        training=None, return_attention_scores=False):
        """One cached decoding step: write the keys and values of `inputs` into `cache` at
        `cache_update_index`, and attend from `inputs` over the cache's filled positions.

        Args:
            inputs: `(B, T, d_model)`, at positions `cache_update_index … + T - 1`.
            cache: `empty_cache(B, L)` (or a stacked `(B, 2, num_key_value_heads, L, key_dim)`
                tensor), filled before `cache_update_index` (an int or scalar int tensor).
            attention_mask: optional bool `(B, T, L)` or `(T, L)`, ANDed with the causal mask
                (query i sees keys `0 … cache_update_index + i`).
            training, return_attention_scores: as in `call`.

        Returns:
            `(output (B, T, d_model), cache)`, or `(output, scores, cache)`. The cache comes
            back in the form given; under PyTorch with autograd off (generation) it is written
            in place (the same tensors), elsewhere a new one.

        Raises:
            ValueError: on a layer that is not causal, or with `value_dim != key_dim`.
        """
        if not self.causal:
            raise ValueError(f"{self.name}: a key/value cache is for causal self-attention "
                             "(autoregressive decoding); this layer has causal=False.")
        if cache_update_index is None:
            raise ValueError(f"{self.name}: `cache_update_index` is required with `cache`.")
        self._check_cacheable()
        index = ops.cast(cache_update_index, "int32")
        queries = self._rotate(call_layer(self.query_dense, inputs), index)
        keys_values = self._project_context(inputs, index)
        if isinstance(cache, (tuple, list)):
            cache = tuple(update_cache(part, index, new) for part, new in zip(cache, keys_values))
        else:  # one write (two halves written, then stacked again, would copy the cache)
            cache = update_cache(cache, index, ops.stack(keys_values, 1))
        filled = index + ops.shape(inputs)[1]
        keys, values = (filled_part(part, filled) for part in cache_keys_values(cache))
        lean = attention_mask is None and not return_attention_scores and not (
            training and self.dropout)
        if lean and inputs.shape[1] == 1 and reads_cache_views():
            return self._attend_step(queries, keys, values, None), cache  # sees every key
        # Bottom-right over the cache: query i (at position index + i) sees keys 0 … index + i.
        # (`keys[:, 0]`: a `(B, L', d)` tensor for the key length.)
        merged = masks_lib.merge_masks(inputs, keys[:, 0], attention_mask=attention_mask,
                                       causal=True, causal_offset=index)
        if lean:
            return self._attend_step(queries, keys, values, merged), cache
        result = self._attend(inputs, keys, values, merged, training, return_attention_scores,
                              heads_first=True, queries=queries)
        if return_attention_scores:
            return result[0], result[1], cache
        return result, cache

    def compute_output_spec(self, inputs, attention_mask=None, training=None,
                            return_attention_scores=False, cache=None, cache_update_index=None,
                            mask=None):
        if cache is None:
            return self._output_spec(inputs, inputs.shape[1], return_attention_scores)
        spec = self._output_spec(inputs, cache_keys_values(cache)[0].shape[2],
                                 return_attention_scores)
        if return_attention_scores:
            return (*spec, cache_spec(cache))
        return spec, cache_spec(cache)

    def get_config(self):
        return super().get_config() | {
            "causal": self.causal,
            "rotary": self.rotary,
            "rotary_max_wavelength": self.rotary_max_wavelength,
            "rotary_interleaved": self.rotary_interleaved,
        }


@_SERIALIZABLE
class CrossAttention(_MultiHeadAttentionBase):
    """Multi-head cross-attention: queries from `query`, keys and values from `context`.

    In the transformer's decoder the queries come from the decoder and the keys and values from
    the encoder output ("encoder-decoder attention", seed 003). `query` has length T, `context`
    length S; they may differ, and so may their widths. The output has the width of `query`.

    Args:
        num_heads, key_dim, value_dim, dropout, use_bias, num_key_value_heads,
            kernel_initializer, ...: as in `MultiHeadSelfAttention` (`d_model` is the width of
            `query`). Rotary positions are for self-attention only.

    Call arguments:
        query: `(B, T, d_model)`. Its Keras mask is propagated to the output.
        context: `(B, S, d_context)`. Its Keras mask is the padding mask of the keys.
        attention_mask: optional bool `(B, T, S)` or `(T, S)`, True where attention is allowed.
        training: whether attention dropout is active.
        return_attention_scores: also return the attention weights `(B, H, T, S)`.
        context_cache: optional `compute_context_cache(context)` (or its `(keys, values)`
            pair, `cache[:, 0]` and `cache[:, 1]`), used instead of `context` (cached decoding
            computes the encoder's keys and values once per source batch). It may have fewer
            rows than `query`, `R = m·B` against `B`: query rows `b·m … b·m + m - 1` then
            attend to cache row `b` (and `context_mask` row `b`), as beam search's beams of
            a source do.
        query_mask, context_mask: Keras masks `(B, T)`, `(B, S)`; filled in by Keras (pass
            `context_mask` yourself with a `context_cache`).

    Returns:
        `(B, T, d_model)`, or `(output, scores)` when `return_attention_scores`.

    Example:

    >>> q, c = keras.random.normal((2, 3, 16)), keras.random.normal((2, 7, 16))
    >>> out, scores = CrossAttention(num_heads=4)(q, c, return_attention_scores=True)
    >>> out.shape, scores.shape
    ((2, 3, 16), (2, 4, 3, 7))
    """

    def build(self, query_shape, context_shape=None):
        check_rank(self, "query", query_shape, 3)
        if context_shape is None:
            raise ValueError(f"{self.name}: build the layer with a `context` before calling it "
                             "with a `context_cache` alone.")
        check_rank(self, "context", context_shape, 3)
        check_same_batch(self, "query", query_shape, "context", context_shape)
        self._build_projections(query_shape, context_shape)

    def compute_context_cache(self, context):
        """Keys and values of `context`, computed once: `(B, 2, num_key_value_heads, S,
        key_dim)`, heads first as the self-attention's cache.

        Pass the result as `context_cache` at every decoding step instead of `context`."""
        check_rank(self, "context", context.shape, 3)
        self._check_cacheable()
        return heads_first(ops.stack(self._project_context(context), axis=1))

    def call(self, query, context=None, attention_mask=None, training=None,
             return_attention_scores=False, context_cache=None, query_mask=None,
             context_mask=None):
        check_rank(self, "query", query.shape, 3)
        if context_cache is not None:
            return self._call_cached(query, context_cache, context_mask, attention_mask,
                                     training, return_attention_scores, lean=False)
        if context is None:
            raise ValueError(f"{self.name}: pass `context` or `context_cache`.")
        check_rank(self, "context", context.shape, 3)
        check_same_batch(self, "query", query.shape, "context", context.shape)
        keys, values = self._project_context(context)
        merged = masks_lib.merge_masks(query, keys, key_padding_mask=context_mask,
                                       attention_mask=attention_mask)
        return self._attend(query, keys, values, merged, training, return_attention_scores)

    def call_with_cache(self, query, context_cache, context_mask=None, attention_mask=None,
                        training=None, return_attention_scores=False):
        """Attend from `query` over a context cache (cached decoding: the encoder's keys and
        values computed once per source batch).

        Args:
            query: `(R, T, d_model)`.
            context_cache: `compute_context_cache(context)` of `B` rows, or its `(keys,
                values)` pair; `R = m·B`: query rows `b·m … b·m + m - 1` attend to cache row
                `b` (and `context_mask` row `b`), as beam search's beams of a source do.
            context_mask: optional bool `(B, S)`, True for real context positions; every row
                needs one (`call` gives zeros for a row without).
            attention_mask, training, return_attention_scores: as in `call`.

        Returns:
            `(R, T, d_model)`, or `(output, scores)` with `return_attention_scores`.
        """
        return self._call_cached(query, context_cache, context_mask, attention_mask, training,
                                 return_attention_scores, lean=True)

    def _call_cached(self, query, context_cache, context_mask, attention_mask, training,
                     return_attention_scores, lean):
        """`call_with_cache`; `lean=False` (`call`): a context row without keys gives zeros."""
        keys, values = cache_keys_values(context_cache)  # (B, H, S, d)
        if lean and attention_mask is None and not return_attention_scores and not (
                training and self.dropout):
            folded, _ = fold_query_rows(query, keys)
            mask = None if context_mask is None else ops.cast(context_mask, "bool")[:, None, :]
            return unfold_query_rows(self._attend_step(
                call_layer(self.query_dense, folded), keys, values, mask), query)
        folded, attention_mask = fold_query_rows(query, keys, attention_mask)
        merged = masks_lib.merge_masks(folded, keys[:, 0], key_padding_mask=context_mask,
                                       attention_mask=attention_mask)
        result = self._attend(folded, keys, values, merged, training, return_attention_scores,
                              heads_first=True)
        if not return_attention_scores:
            return unfold_query_rows(result, query)
        output, scores = result  # (B, H, m·T, S) -> (m·B, H, T, S)
        heads, length, keys_length = scores.shape[1], ops.shape(query)[1], ops.shape(keys)[2]
        scores = ops.reshape(scores, (ops.shape(keys)[0], heads, -1, length, keys_length))
        scores = ops.reshape(ops.swapaxes(scores, 1, 2), (-1, heads, length, keys_length))
        return unfold_query_rows(output, query), scores

    def compute_output_spec(self, query, context=None, attention_mask=None, training=None,
                            return_attention_scores=False, context_cache=None, query_mask=None,
                            context_mask=None):
        length = (context.shape[1] if context is not None
                  else cache_keys_values(context_cache)[0].shape[2])
        return self._output_spec(query, length, return_attention_scores)
