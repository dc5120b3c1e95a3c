"""Decoder-only and encoder-only transformers assembled with the Keras functional API.

Seed 004: a transformer "can be built using encoder, decoder, or only one of them". A language
model is a stack of decoder blocks without cross-attention (GPT, LLaMA); an encoder is a stack
of encoder blocks (BERT), with per-token features or a classifier head. Both are functional
`keras.Model` subclasses that rebuild themselves from their hyper-parameters (the pattern of
keras_hub's backbones), so a `.keras` file keeps their configuration and special ids.
"""

import functools

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._checks import (check_dropout, check_positive_int, check_special_ids,
                               embed_or_nan, model_dtype_policy)
from keras_tfm._layer_calls import call_layer, logits_against, tied_table
from keras_tfm.blocks import TransformerDecoderBlock, TransformerEncoderBlock
from keras_tfm.dropout import Dropout
from keras_tfm.embedding import TiedLogits
from keras_tfm.kv_cache import search_cache
from keras_tfm.positional import PositionEmbedding, SinusoidalPositionalEncoding
from keras_tfm.seq2seq import SPECIAL_ID_NAMES, ConfiguredModel

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")

POSITIONAL_KINDS = ("rotary", "sinusoidal", "learned")
POOLINGS = ("mean", "first")


_HYPER_PARAMETERS = ("vocab_size", "d_model", "num_heads", "ff_dim", "num_layers", "positional",
                     "num_key_value_heads", "norm_first", "dropout", "max_length", "activation",
                     "gated_feed_forward", "normalization", "layer_norm_epsilon", "use_bias",
                     "rotary_max_wavelength", "scale_embeddings", "qkv_bias") + SPECIAL_ID_NAMES


def _hyper_parameters(arguments, *extra):
    """The config of a stack model: its constructor's arguments, picked from `locals()`; the
    special ids checked."""
    config = {key: arguments[key] for key in _HYPER_PARAMETERS + extra}
    check_special_ids(config["vocab_size"], config["pad_id"], config["start_id"],
                      config["end_id"])
    return config


class _StackModel(ConfiguredModel):
    """A functional model whose config is its hyper-parameters (shared by both stacks)."""

    def _embed(self, tokens, config, segments=None):
        """Token embedding, additive positions unless rotary, segment embeddings (with
        `segments`), the embedding norm (`embedding_norm`), dropout; and the padding mask."""
        vocab_size, d_model = config["vocab_size"], config["d_model"]
        check_positive_int("vocab_size", vocab_size)
        check_positive_int("d_model", d_model)
        check_positive_int("num_layers", config["num_layers"])
        check_dropout("dropout", config["dropout"])
        positional = config["positional"]
        if positional not in POSITIONAL_KINDS:
            raise ValueError(f"`positional` must be one of {POSITIONAL_KINDS}; received "
                             f"positional={positional!r}.")
        if positional == "learned" and config["max_length"] is None:
            raise ValueError('`max_length` is required for positional="learned" (the size of '
                             "the learned position table); received max_length=None.")
        dtype = self._model_dtype
        pad_id = config["pad_id"]
        mask = None if pad_id is None else masks_lib.padding_mask(tokens, pad_id)
        embedding = keras.layers.Embedding(vocab_size, d_model, dtype=dtype,
                                           name="token_embedding")
        x = embed_or_nan(embedding, tokens, vocab_size)  # an id outside the vocabulary: NaN
        if config["scale_embeddings"]:
            x = x * (d_model ** 0.5)
        if positional == "sinusoidal":
            x = SinusoidalPositionalEncoding(dtype=dtype, name="position_encoding")(x)
        elif positional == "learned":
            x = PositionEmbedding(config["max_length"], dtype=dtype,
                                  name="position_embedding")(x)
        if segments is not None:
            segment_embedding = keras.layers.Embedding(config["segment_vocab_size"], d_model,
                                                       dtype=dtype, name="segment_embedding")
            x = x + embed_or_nan(segment_embedding, segments, config["segment_vocab_size"])
        if config.get("embedding_norm"):
            x = self._norm(config, "embedding_norm")(x)
        x = Dropout(config["dropout"], dtype=dtype, name="embedding_dropout")(x)
        return x, mask, embedding

    def _block_kwargs(self, config):
        return dict(dtype=self._model_dtype,
            num_heads=config["num_heads"], ff_dim=config["ff_dim"], dropout=config["dropout"],
            activation=config["activation"], norm_first=config["norm_first"],
            layer_norm_epsilon=config["layer_norm_epsilon"],
            num_key_value_heads=config["num_key_value_heads"],
            rotary=config["positional"] == "rotary",
            rotary_max_wavelength=config["rotary_max_wavelength"],
            normalization=config["normalization"],
            gated_feed_forward=config["gated_feed_forward"], use_bias=config["use_bias"],
            qkv_bias=config["qkv_bias"])

    def _norm(self, config, name):
        cls = (keras.layers.RMSNormalization if config["normalization"] == "rms_norm"
               else keras.layers.LayerNormalization)
        return cls(epsilon=config["layer_norm_epsilon"], dtype=self._model_dtype, name=name)

    def _final_norm(self, x, config):
        if not config["norm_first"]:
            return x
        return self._norm(config, "final_norm")(x)


@_SERIALIZABLE
class LanguageModel(_StackModel):
    """A decoder-only transformer language model: token ids `(B, T)` → logits `(B, T, V)`.

    Build it with `build_language_model` (same arguments). Layers: `token_embedding`,
    `position_encoding` / `position_embedding` (unless rotary), `decoder_block_{i}` (decoder
    blocks without cross-attention), `final_norm` (pre-LN), `logits` (a `Dense` layer, or with
    `tie_embeddings=True` a `TiedLogits` layer reading `token_embedding`'s matrix: GPT-2 and
    tied LLaMA-family models; no bias). `qkv_bias` gives the attention's query, key and
    value projections biases of their own (Qwen2). As `Seq2SeqTransformer`,
    the model's config holds its hyper-parameters and special ids (`model.special_ids`), so a
    `.keras` file rebuilds it and `keras_tfm.generate` finds its ids.
    """

    def __init__(self, vocab_size, d_model=512, num_heads=8, ff_dim=2048, num_layers=6,
                 positional="rotary", num_key_value_heads=None, norm_first=True, dropout=0.0,
                 max_length=None, activation="gelu", gated_feed_forward=False,
                 normalization="layer_norm", layer_norm_epsilon=1e-5, use_bias=True,
                 rotary_max_wavelength=10000.0, scale_embeddings=False, pad_id=0, start_id=None,
                 end_id=None, tie_embeddings=False, qkv_bias=None, name="language_model",
                 dtype=None, **kwargs):
        config = _hyper_parameters(locals(), "tie_embeddings")
        self._model_dtype = model_dtype_policy(dtype)
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        x, mask, embedding = self._embed(tokens, config)
        for i in range(num_layers):
            x = TransformerDecoderBlock(name=f"decoder_block_{i}",
                                        **self._block_kwargs(config))(x, inputs_mask=mask)
        x = self._final_norm(x, config)
        if tie_embeddings:
            logits = TiedLogits(embedding, dtype=self._model_dtype, name="logits")(x)
        else:
            logits = keras.layers.Dense(vocab_size, use_bias=use_bias, dtype=self._model_dtype,
                                        name="logits")(x)
        self._model_config = config
        super().__init__(inputs=tokens, outputs=logits, name=name, **kwargs)

    @functools.cached_property
    def _parts(self):
        """The layers of a cached step, by the names `__init__` gives them."""
        names = {layer.name: layer for layer in self.layers}
        position = names.get("position_encoding", names.get("position_embedding"))
        blocks = [names[f"decoder_block_{i}"] for i in range(self._model_config["num_layers"])]
        return names["token_embedding"], position, blocks, names.get("final_norm"), names["logits"]

    def initial_cache(self, batch_size, max_length):
        """Empty key/value caches for `call_with_cache`: `{"self": [...]}`, one
        `self_attention.empty_cache(batch_size, max_length)` pair per decoder block (stacked
        into one `(1, 2, H, L, d)` array at batch 1 under JAX on the CPU, `search_cache`)."""
        return {"self": [search_cache(block.self_attention, batch_size, max_length,
                                      block.compute_dtype) for block in self._parts[2]]}

    def call_with_cache(self, tokens, cache, cache_update_index):
        """One cached step: the logits `(B, T, V)` of `tokens (B, T)` at positions
        `cache_update_index … + T - 1`, each seeing the positions before it in `cache`, and
        the cache with their keys and values written (in place under PyTorch with autograd
        off). A prompt is prefilled by one call of all its tokens at index 0. A cache entry
        `"logits_table"` (the tied table transposed, `(d_model, V)`) gives the logits against
        it.

        Example:

        >>> cache = lm.initial_cache(2, 16)  # doctest: +SKIP
        >>> logits, cache = lm.call_with_cache(prompts, cache, 0)  # doctest: +SKIP
        """
        embedding, position, blocks, final_norm, logits = self._parts
        x = call_layer(embedding, tokens)
        if self._model_config["scale_embeddings"]:
            x = x * ops.cast(self._model_config["d_model"] ** 0.5, x.dtype)
        if position is not None:
            x = call_layer(position, x, start_index=cache_update_index)
        updated = []
        for block, block_cache in zip(blocks, cache["self"]):
            x, block_cache = block.call_with_cache(x, block_cache, cache_update_index)
            updated.append(block_cache)
        if final_norm is not None:
            x = call_layer(final_norm, x)
        if "logits_table" in cache:
            return logits_against(x, cache["logits_table"]), dict(cache, self=updated)
        return call_layer(logits, x), dict(cache, self=updated)

    def tied_table(self):
        """The tied logits table variable `(V, d_model)` (`_layer_calls.tied_table`), or None."""
        embedding, *_, logits = self._parts
        return tied_table(logits, embedding) if isinstance(logits, TiedLogits) else None


@_SERIALIZABLE
class EncoderModel(_StackModel):
    """An encoder-only transformer (BERT-shaped): token ids `(B, T)` → features `(B, T, d)`, or
    class logits `(B, num_classes)` with a classifier head.

    Build it with `build_encoder` (same arguments). Layers: `token_embedding`, positions,
    `segment_embedding` (with `segment_vocab_size`), `embedding_norm` (with
    `embedding_norm=True`), `encoder_block_{i}`, `final_norm` (pre-LN), and with `num_classes`
    the pooling, the `pooler` (with `pooler=True`) and the `classifier` dense layer. `pad_id`
    (in `model.special_ids`) is the padding id of the inputs.

    BERT's options: `segment_vocab_size` (token types: the model then takes
    `[token_ids (B, T), segment_ids (B, T)]` and adds a segment embedding to each token's),
    `embedding_norm` (a normalization of the summed embeddings, before the first block) and
    `pooler` (the classifier reads `tanh(W h₀ + b)` of the first token, `pooling="first"`).
    """

    def __init__(self, vocab_size, d_model=256, num_heads=4, ff_dim=1024, num_layers=4,
                 positional="sinusoidal", num_key_value_heads=None, norm_first=False,
                 dropout=0.1, max_length=None, activation="gelu", gated_feed_forward=False,
                 normalization="layer_norm", layer_norm_epsilon=1e-5, use_bias=True,
                 rotary_max_wavelength=10000.0, scale_embeddings=True, pad_id=0, start_id=None,
                 end_id=None, num_classes=None, pooling="mean", segment_vocab_size=None,
                 embedding_norm=False, pooler=False, qkv_bias=None, name="encoder", dtype=None,
                 **kwargs):
        config = _hyper_parameters(locals(), "num_classes", "pooling", "segment_vocab_size",
                                   "embedding_norm", "pooler")
        self._model_dtype = model_dtype_policy(dtype)
        if num_classes is not None:
            check_positive_int("num_classes", num_classes)
        if pooling not in POOLINGS:
            raise ValueError(f"`pooling` must be one of {POOLINGS}; received pooling={pooling!r}.")
        if pooler and pooling != "first":
            raise ValueError('`pooler=True` pools the first token: pass pooling="first"; '
                             f"received pooling={pooling!r}.")
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        inputs, segments = tokens, None
        if segment_vocab_size is not None:
            check_positive_int("segment_vocab_size", segment_vocab_size)
            segments = keras.Input((None,), dtype="int32", name="segment_ids")
            inputs = [tokens, segments]
        x, mask, _ = self._embed(tokens, config, segments)
        for i in range(num_layers):
            x = TransformerEncoderBlock(name=f"encoder_block_{i}",
                                        **self._block_kwargs(config))(x, mask=mask)
        outputs = self._final_norm(x, config)
        pooler_layer = None
        if pooler:
            pooler_layer = keras.layers.Dense(outputs.shape[-1], activation="tanh",
                                              dtype=self._model_dtype, name="pooler")
        if num_classes is not None:
            if pooling == "first":
                pooled = outputs[:, 0]
                if pooler_layer is not None:
                    pooled = pooler_layer(pooled)
            elif mask is None:  # no padding id: every token is real
                pooled = ops.mean(outputs, axis=1)
            else:  # mean over the real tokens
                weights = ops.cast(mask, outputs.dtype)[..., None]
                count = ops.maximum(ops.sum(weights, axis=1), 1.0)
                pooled = ops.sum(outputs * weights, axis=1) / count
            outputs = keras.layers.Dense(num_classes, dtype=self._model_dtype,
                                         name="classifier")(pooled)
        self._model_config = config
        super().__init__(inputs=inputs, outputs=outputs, name=name, **kwargs)
        if pooler_layer is not None and num_classes is None:
            # Not on the path to the features: kept (and saved) as an attribute, for
            # `pooled_output` and for a classifier fine-tuned later.
            pooler_layer.build((None, outputs.shape[-1]))
            self.pooler = pooler_layer

    def pooled_output(self, inputs, training=False):
        """The pooler's output `(B, d_model)`, `tanh(W h₀ + b)` of the first token's features
        (BERT's `pooler_output`), for a model built with `pooler=True`.

        Args:
            inputs: what the model takes (`token_ids`, or `[token_ids, segment_ids]`).
            training: whether dropout is active.
        """
        if not self._model_config.get("pooler"):
            raise ValueError(f"Model {self.name!r} has no pooler (built with pooler=False).")
        if self._model_config.get("num_classes") is not None:
            pooled = keras.Model(self.inputs, self.get_layer("pooler").output)
            return pooled(inputs, training=training)
        return self.pooler(self(inputs, training=training)[:, 0])


def build_language_model(vocab_size, d_model=512, num_heads=8, ff_dim=2048, num_layers=6,
                         positional="rotary", num_key_value_heads=None, norm_first=True,
                         **kwargs):
    """Build a decoder-only transformer language model (GPT / LLaMA shape).

    `tokens (B, T) → logits (B, T, vocab_size)`; each position sees itself and the positions
    before it (causal), and padding (`pad_id`, 0 by default) is masked as keys. With
    `pad_id=None` there is no padding: every id, 0 included, is a real token (a model trained
    on packed windows of text, where id 0 may be a character such as the newline).
    Train it with `fit` on next-token targets (`x = tokens[:, :-1]`, `y = tokens[:, 1:]`) and
    `MaskedSparseCategoricalCrossentropy`; continue prompts with `keras_tfm.generate`.

    Args:
        vocab_size: number of token ids.
        d_model: model width; must be divisible by `num_heads`.
        num_heads: attention heads.
        ff_dim: hidden width of the feed-forward networks.
        num_layers: number of decoder blocks.
        positional: `"rotary"` (in the attention, LLaMA), `"sinusoidal"` or `"learned"`
            (added to the embeddings; learned needs `max_length`).
        num_key_value_heads: grouped-query attention (None: one key/value head per head).
        norm_first: pre-LN (True, GPT-2 / LLaMA, with a final norm) or post-LN.
        **kwargs: `dropout` (0), `max_length`, `activation` ("gelu"), `gated_feed_forward`
            (SwiGLU with `activation="silu"`), `normalization` ("layer_norm" or "rms_norm"),
            `layer_norm_epsilon`, `use_bias`, `rotary_max_wavelength`, `scale_embeddings`
            (×√d_model, False), `pad_id` (0; None: no padding), `start_id`, `end_id` (the
            model's special ids, `model.special_ids`; `generate` stops at `end_id` by
            default), `tie_embeddings` (logits with the token embedding's matrix, no bias),
            `qkv_bias` (biases on the query, key and value projections only when
            `use_bias=False`: Qwen2), `name`, `dtype`.

    Returns:
        A `LanguageModel` (a functional `keras.Model`).

    Example:

    >>> lm = build_language_model(100, d_model=32, num_heads=4, ff_dim=64, num_layers=2,
    ...                           num_key_value_heads=2, end_id=2)
    >>> lm(np.ones((2, 7), "int32")).shape
    (2, 7, 100)
    """
    return LanguageModel(vocab_size, d_model=d_model, num_heads=num_heads, ff_dim=ff_dim,
                         num_layers=num_layers, positional=positional,
                         num_key_value_heads=num_key_value_heads, norm_first=norm_first,
                         **kwargs)


def build_encoder(vocab_size, d_model=256, num_heads=4, ff_dim=1024, num_layers=4,
                  num_classes=None, pooling="mean", **kwargs):
    """Build an encoder-only transformer (BERT shape): features or a sequence classifier.

    Bidirectional self-attention over the tokens, padding (`pad_id`, 0 by
    default) masked as keys. Without `num_classes` the output is the per-token features
    `(B, T, d_model)`; with it, the logits `(B, num_classes)` of a dense layer on the mean of
    the real tokens' features (`pooling="mean"`) or on the first token's (`"first"`, a [CLS]
    token).

    Args:
        vocab_size, d_model, num_heads, ff_dim, num_layers: as in `build_language_model`.
        num_classes: None for features, else the number of classes.
        pooling: `"mean"` or `"first"`.
        **kwargs: as in `build_language_model` (but `tie_embeddings`); here the defaults are
            `positional="sinusoidal"`, `norm_first=False` (post-LN, BERT), `dropout=0.1`,
            `scale_embeddings=True`; and BERT's `segment_vocab_size` (inputs
            `[token_ids, segment_ids]`), `embedding_norm`, `pooler` (see `EncoderModel`).

    Returns:
        An `EncoderModel` (a functional `keras.Model`).

    Example:

    >>> classifier = build_encoder(20, d_model=32, num_heads=4, ff_dim=64, num_layers=2,
    ...                            num_classes=3)
    >>> classifier(np.ones((2, 7), "int32")).shape
    (2, 3)
    """
    return EncoderModel(vocab_size, d_model=d_model, num_heads=num_heads, ff_dim=ff_dim,
                        num_layers=num_layers, num_classes=num_classes, pooling=pooling,
                        **kwargs)
