"""The encoder-decoder transformer assembled with the Keras functional API (seed 000's block
diagram: embeddings + positional encoding → N encoder blocks; embeddings + positional encoding →
N decoder blocks attending to the encoder output → linear → softmax).

`Seq2SeqTransformer` is a functional `keras.Model` subclass (as keras_hub's backbones): it stays
a functional graph of keras_tfm layers, and its config holds the hyper-parameters and the
special token ids, so a `.keras` file rebuilds it and `generate` finds its ids.
"""

import dataclasses
import functools

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._checks import (check_dropout, check_positive_int, check_special_ids,
                               model_dtype_policy, with_quantized_dtypes)
from keras_tfm._layer_calls import call_layer, tied_table
from keras_tfm.blocks import TransformerDecoderBlock, TransformerEncoderBlock
from keras_tfm.dropout import Dropout
from keras_tfm.embedding import TokenAndPositionEmbedding
from keras_tfm.kv_cache import cache_keys_values, search_cache

SPECIAL_ID_NAMES = ("pad_id", "start_id", "end_id")


class ConfiguredModel(keras.Model):
    """A functional model whose config is the arguments it was built from (the pattern of
    keras_hub's backbones): a subclass sets `_model_config` and `_model_dtype` (the policy given
    to its layers) in `__init__` before building the graph; `from_config` builds it again."""

    @property
    def special_ids(self):
        """The model's special token ids, `{"pad_id": …, "start_id": …, "end_id": …}` (the ids
        that were given)."""
        return {key: self._model_config[key] for key in SPECIAL_ID_NAMES
                if self._model_config.get(key) is not None}

    def get_config(self):
        config = dict(self._model_config, name=self.name, trainable=self.trainable,
                      dtype=keras.dtype_policies.serialize(self._model_dtype))
        # After `quantize`: a DTypePolicyMap of the quantized layers, which `__init__` passes
        # to every layer, so that a file rebuilds them quantized (as keras_hub's backbones).
        return with_quantized_dtypes(self, config)

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config.get("dtype"), dict):
            config["dtype"] = keras.dtype_policies.get(config["dtype"])
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_tfm")
class Seq2SeqTransformer(ConfiguredModel):
    """The encoder-decoder transformer: `[encoder_tokens, decoder_tokens] → logits`.

    A functional model (the graph of keras_tfm layers of seed 000's diagram) that remembers its
    hyper-parameters and special token ids: `generate(model, source, max_length=...)` reads
    `model.special_ids`, and a `.keras` file rebuilds the model from its config. Build it with
    `build_transformer` (same arguments) or `keras_tfm.from_marian`.

    Inputs `encoder_tokens` `(B, S)` and `decoder_tokens` `(B, T)` are int token ids, right-padded
    with `pad_id`; the output is the logits `(B, T, tgt_vocab_size)` (the softmax is left to the
    loss). Layer names follow the diagram: `encoder_embedding`, `encoder_block_{i}`,
    `decoder_embedding`, `decoder_block_{i}`, `logits` (one `shared_embedding` instead of the two
    embeddings with `share_embeddings=True`); with `norm_first=True` (pre-LN) each stack ends in
    a layer normalization (`encoder_norm`, `decoder_norm`), as in `torch.nn.Transformer`.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes.
        d_model: model width; must be divisible by `num_heads`.
        num_heads: attention heads.
        ff_dim: hidden width of the feed-forward networks.
        num_encoder_layers, num_decoder_layers: N of each stack (≥ 1).
        dropout: dropout rate (embeddings, residuals, attention weights, feed-forward).
        attention_dropout, activation_dropout: rates on the attention weights and on the
            feed-forward's hidden units, when they should differ from `dropout` (see
            `TransformerEncoderBlock`).
        norm_first: False for post-LN (the paper), True for pre-LN.
        max_length: longest sequence; required for `positional="learned"`.
        positional: `"sinusoidal"` or `"learned"`.
        tie_embeddings: share the *target* embedding matrix with the output projection
            (`logits = h Eᵀ`, no separate output kernel).
        share_embeddings: one embedding layer (token matrix and positions) for the source, the
            target and, with `tie_embeddings`, the output projection; needs equal vocabularies.
        positional_layout: `"interleaved"` (the paper) or `"halves"` (MarianMT) sinusoids.
        activation: the feed-forward activation (`"relu"`, `"gelu"`, `"swish"`, ...).
        scale_embeddings: multiply token embeddings by √d_model (the paper).
        logits_bias: with `tie_embeddings`, add a learned bias to the tied projection (an
            untied `logits` Dense layer always has one).
        layer_norm_epsilon: epsilon of every layer normalization.
        freeze_pad_embedding: keep the padding id's embedding row out of training, as torch's
            `padding_idx` does (MarianMT; `from_marian` sets it).
        dtype: the dtype policy of every layer (a `DTypePolicyMap` rebuilds quantized layers).
        pad_id: the padding id of both vocabularies (masks; pass it to the loss and metric as
            `ignore_class`).
        start_id, end_id: the decoder's start and end ids (`generate` uses them by default).
            A `start_id` equal to `pad_id` (MarianMT) is attended all the same.
        name: the model's name.

    Example:

    >>> model = Seq2SeqTransformer(100, 120, d_model=32, num_heads=4, ff_dim=64,
    ...                            num_encoder_layers=2, num_decoder_layers=2)
    >>> model([np.ones((2, 7)), np.ones((2, 5))]).shape
    (2, 5, 120)
    """

    def __init__(
        self,
        src_vocab_size,
        tgt_vocab_size,
        d_model=512,
        num_heads=8,
        ff_dim=2048,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout=0.1,
        attention_dropout=None,
        activation_dropout=None,
        norm_first=False,
        max_length=None,
        positional="sinusoidal",
        tie_embeddings=False,
        name="transformer",
        share_embeddings=False,
        positional_layout="interleaved",
        activation="relu",
        scale_embeddings=True,
        logits_bias=False,
        layer_norm_epsilon=1e-5,
        freeze_pad_embedding=False,
        pad_id=0,
        start_id=None,
        end_id=None,
        dtype=None,
        **kwargs,
    ):
        check_positive_int("src_vocab_size", src_vocab_size)
        check_positive_int("tgt_vocab_size", tgt_vocab_size)
        check_positive_int("num_encoder_layers", num_encoder_layers)
        check_positive_int("num_decoder_layers", num_decoder_layers)
        check_positive_int("d_model", d_model)
        check_positive_int("num_heads", num_heads)
        check_dropout("dropout", dropout)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}.")
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError("`share_embeddings=True` needs one vocabulary; received "
                             f"src_vocab_size={src_vocab_size}, tgt_vocab_size={tgt_vocab_size}.")
        if pad_id is None:
            raise ValueError("An encoder-decoder pads its batches of sentences: `pad_id` must "
                             "be a token id; received pad_id=None.")
        check_special_ids(min(src_vocab_size, tgt_vocab_size), pad_id)  # pads both inputs
        check_special_ids(tgt_vocab_size, pad_id, start_id, end_id)
        dtype = self._model_dtype = model_dtype_policy(dtype)
        self._model_config = dict(
            src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model,
            num_heads=num_heads, ff_dim=ff_dim, num_encoder_layers=num_encoder_layers,
            num_decoder_layers=num_decoder_layers, dropout=dropout,
            attention_dropout=attention_dropout, activation_dropout=activation_dropout,
            norm_first=norm_first, max_length=max_length, positional=positional,
            tie_embeddings=tie_embeddings, share_embeddings=share_embeddings,
            positional_layout=positional_layout, activation=activation,
            scale_embeddings=scale_embeddings, logits_bias=logits_bias,
            layer_norm_epsilon=layer_norm_epsilon, pad_id=pad_id, start_id=start_id,
            end_id=end_id, freeze_pad_embedding=freeze_pad_embedding,
        )
        embedding_kwargs = dict(d_model=d_model, max_length=max_length, positional=positional,
                                positional_layout=positional_layout, pad_id=pad_id,
                                scale=scale_embeddings, freeze_pad=freeze_pad_embedding,
                                dtype=dtype)
        block_kwargs = dict(num_heads=num_heads, ff_dim=ff_dim, dropout=dropout,
                            attention_dropout=attention_dropout,
                            activation_dropout=activation_dropout, activation=activation,
                            norm_first=norm_first, layer_norm_epsilon=layer_norm_epsilon,
                            dtype=dtype)
        reverse_bias = bool(tie_embeddings and logits_bias)

        encoder_tokens = keras.Input((None,), dtype="int32", name="encoder_tokens")
        decoder_tokens = keras.Input((None,), dtype="int32", name="decoder_tokens")

        if share_embeddings:
            source_embedding = target_embedding = TokenAndPositionEmbedding(
                src_vocab_size, name="shared_embedding", reverse_bias=reverse_bias,
                **embedding_kwargs)
        else:
            source_embedding = TokenAndPositionEmbedding(src_vocab_size, name="encoder_embedding",
                                                         **embedding_kwargs)
            target_embedding = TokenAndPositionEmbedding(tgt_vocab_size, name="decoder_embedding",
                                                         reverse_bias=reverse_bias,
                                                         **embedding_kwargs)
        x = source_embedding(encoder_tokens)
        x = Dropout(dropout, dtype=dtype, name="encoder_embedding_dropout")(x)
        for i in range(num_encoder_layers):
            x = TransformerEncoderBlock(name=f"encoder_block_{i}", **block_kwargs)(x)
        if norm_first:
            x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, dtype=dtype,
                                                name="encoder_norm")(x)

        y = target_embedding(decoder_tokens)
        y = Dropout(dropout, dtype=dtype, name="decoder_embedding_dropout")(y)
        decoder_kwargs = {}
        if start_id is not None and start_id == pad_id:
            # The decoder starts from the padding id (MarianMT): its first position is real.
            decoder_kwargs["inputs_mask"] = masks_lib.padding_mask(decoder_tokens, pad_id,
                                                                   keep_first=True)
        for i in range(num_decoder_layers):
            y = TransformerDecoderBlock(name=f"decoder_block_{i}", **block_kwargs)(
                y, x, **decoder_kwargs)
        if norm_first:
            y = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon, dtype=dtype,
                                                name="decoder_norm")(y)
        if tie_embeddings:
            logits = target_embedding(y, reverse=True)
        else:
            logits = keras.layers.Dense(tgt_vocab_size, dtype=dtype, name="logits")(y)
        super().__init__([encoder_tokens, decoder_tokens], logits, name=name, **kwargs)

    @functools.cached_property
    def _parts(self):
        return Seq2SeqParts.from_model(self)

    def initial_cache(self, source_tokens, max_length, beams=1, pad_id=None):
        """The cache of a search: see `Seq2SeqParts.initial_cache`."""
        return self._parts.initial_cache(source_tokens, max_length, beams, pad_id)

    def call_with_cache(self, tokens, cache, cache_update_index):
        """One cached decoding step: see `Seq2SeqParts.call_with_cache`."""
        return self._parts.call_with_cache(tokens, cache, cache_update_index)


def build_transformer(*args, **kwargs):
    """Build the encoder-decoder transformer: a `Seq2SeqTransformer` (a functional `keras.Model`).

    Takes the arguments of `Seq2SeqTransformer`, in its order: `src_vocab_size,
    tgt_vocab_size, d_model=512, num_heads=8, ff_dim=2048, num_encoder_layers=6,
    num_decoder_layers=6, dropout=0.1, attention_dropout=None, activation_dropout=None,
    norm_first=False, max_length=None, positional="sinusoidal", tie_embeddings=False,
    name="transformer"`, then (by keyword) `share_embeddings`, `positional_layout`,
    `activation`, `scale_embeddings`, `logits_bias`, `layer_norm_epsilon`,
    `freeze_pad_embedding`, `pad_id=0`, `start_id=None`, `end_id=None`, `dtype`.

    Returns:
        A `keras.Model` mapping `[encoder_tokens (B, S), decoder_tokens (B, T)]` to logits
        `(B, T, tgt_vocab_size)`.

    Example:

    >>> model = build_transformer(100, 120, d_model=32, num_heads=4, ff_dim=64,
    ...                           num_encoder_layers=2, num_decoder_layers=2,
    ...                           start_id=1, end_id=2)
    >>> model([np.ones((2, 7)), np.ones((2, 5))]).shape
    (2, 5, 120)
    """
    return Seq2SeqTransformer(*args, **kwargs)


@dataclasses.dataclass
class Seq2SeqParts:
    """The layers of an encoder-decoder model, and its cached decoding (what `generate` runs).

    `from_model` looks in `model.layers` for:

    * two `TokenAndPositionEmbedding` layers: the ones named `encoder_embedding` and
      `decoder_embedding` if present, else the first is the encoder's and the second the
      decoder's; or one named `shared_embedding`, used by both;
    * the `TransformerEncoderBlock` and `TransformerDecoderBlock` layers, in the order the model
      calls them;
    * optional final normalizations, which must be named `encoder_norm` and `decoder_norm`
      (pre-LN models; another top-level `LayerNormalization` is a ValueError, as decoding
      could not tell where it belongs);
    * the output projection: the `Dense` layer named `logits`, else the last `Dense` layer; with
      none, the decoder embedding's transposed matrix (tied embeddings).

    `Seq2SeqTransformer` models (`build_transformer`, `from_marian`) and models built by hand as
    in docs/design.md have exactly these. Dropout layers are skipped (decoding is inference).
    The padding id comes from `model.special_ids` (0 for a model without one); a decoder whose
    start id is its padding id keeps its first position as a real token (`keep_first`).
    """

    encoder_embedding: object
    encoder_blocks: list
    encoder_norm: object
    decoder_embedding: object
    decoder_blocks: list
    decoder_norm: object
    output_projection: object
    pad_id: int = 0
    keep_first: bool = False

    @classmethod
    def from_model(cls, model, pad_id=None):
        layers = list(model.layers)
        by_name = {layer.name: layer for layer in layers}
        embeddings = [layer for layer in layers if isinstance(layer, TokenAndPositionEmbedding)]
        if "encoder_embedding" in by_name and "decoder_embedding" in by_name:
            embeddings = [by_name["encoder_embedding"], by_name["decoder_embedding"]]
        elif isinstance(by_name.get("shared_embedding"), TokenAndPositionEmbedding):
            embeddings = [by_name["shared_embedding"]] * 2
        encoder_blocks = [layer for layer in layers if isinstance(layer, TransformerEncoderBlock)]
        decoder_blocks = [layer for layer in layers if isinstance(layer, TransformerDecoderBlock)]
        if len(embeddings) != 2 or not encoder_blocks or not decoder_blocks:
            raise ValueError(
                f"Model {model.name!r} is not a keras_tfm encoder-decoder: generation needs two "
                "TokenAndPositionEmbedding layers (encoder, decoder) and at least one "
                "TransformerEncoderBlock and TransformerDecoderBlock; found "
                f"{len(embeddings)}, {len(encoder_blocks)} and {len(decoder_blocks)}."
            )
        dense = [layer for layer in layers if isinstance(layer, keras.layers.Dense)]
        projection = by_name.get("logits", dense[-1] if dense else None)
        norms = [layer for layer in layers if isinstance(layer, keras.layers.LayerNormalization)]
        unnamed = [n.name for n in norms if n.name not in ("encoder_norm", "decoder_norm")]
        if unnamed:
            raise ValueError(
                f"Model {model.name!r} has final LayerNormalization layers {unnamed}: generation "
                "recognises them only by the names 'encoder_norm' and 'decoder_norm' (as "
                "build_transformer names them); rename them so decoding matches the model."
            )
        own = getattr(model, "special_ids", {})
        pad_id = own.get("pad_id", 0) if pad_id is None else pad_id
        keep_first = own.get("start_id", None) == pad_id
        return cls(embeddings[0], encoder_blocks, by_name.get("encoder_norm"), embeddings[1],
                   decoder_blocks, by_name.get("decoder_norm"), projection, pad_id, keep_first)

    @property
    def target_vocab_size(self):
        return self.decoder_embedding.vocab_size

    def encode(self, source_tokens, pad_id=None):
        """Encoder output `(B, S, d_model)` and the source padding mask `(B, S)`."""
        mask = masks_lib.padding_mask(source_tokens, self.pad_id if pad_id is None else pad_id)
        x = call_layer(self.encoder_embedding, source_tokens)
        for block in self.encoder_blocks:
            x = call_layer(block, x, mask=mask)
        if self.encoder_norm is not None:
            x = call_layer(self.encoder_norm, x)
        return x, mask

    def initial_cache(self, source_tokens, max_length, beams=1, pad_id=None):
        """The cache of a search over `source_tokens (B, S)` (right-padded; every source holds
        a real token) with `beams` rows a source, for `max_length` decoder positions: a dict
        of each decoder block's empty self-attention cache (`"self"`, `B·beams` rows), its
        cross-attention keys and values (`"cross"`, one row a source, shared by its beams) and
        the source padding mask (`"source_mask"`). `pad_id`: the model's by default."""
        encoder_outputs, source_mask = self.encode(source_tokens, pad_id)
        rows = ops.shape(source_tokens)[0] * beams
        return {
            "self": [search_cache(block.self_attention, rows, max_length, block.compute_dtype)
                     for block in self.decoder_blocks],
            "cross": [cache_keys_values(block.cross_attention.compute_context_cache(
                encoder_outputs)) for block in self.decoder_blocks],
            "source_mask": source_mask,
        }

    def tied_table(self):
        """The tied logits table variable `(V, d_model)` (`_layer_calls.tied_table`), or None."""
        if self.output_projection is not None:
            return None
        return tied_table(self.decoder_embedding.token_embedding)

    def call_with_cache(self, tokens, cache, cache_update_index):
        """Logits `(R, T, V)` of the decoder tokens `(R, T)` at positions `cache_update_index
        … + T - 1`, and the cache (`initial_cache`) with their keys and values written. A
        cache entry `"logits_table"` (the tied table transposed, `(d_model, V)`) gives the
        logits against it."""
        x = call_layer(self.decoder_embedding, tokens, start_index=cache_update_index)
        updated = []
        for block, self_cache, cross in zip(self.decoder_blocks, cache["self"], cache["cross"]):
            x, self_cache = block.call_with_cache(x, self_cache, cache_update_index, cross,
                                                  cache["source_mask"])
            updated.append(self_cache)
        if self.decoder_norm is not None:
            x = call_layer(self.decoder_norm, x)
        if "logits_table" in cache:
            logits = self.decoder_embedding.transposed_logits(x, cache["logits_table"])
        elif self.output_projection is None:
            logits = call_layer(self.decoder_embedding, x, reverse=True)
        else:
            logits = call_layer(self.output_projection, x)
        return logits, dict(cache, self=updated)

    def cross_attention_weights(self, source_tokens, decoder_tokens):
        """Cross-attention weights of every decoder block for teacher-forced decoder tokens.

        Returns:
            A list (one per decoder block) of `(B, num_heads, T, S)` weights: row t tells how
            much target position t attends to each source token.
        """
        encoder_outputs, source_mask = self.encode(source_tokens)
        x = self.decoder_embedding(decoder_tokens)
        target_mask = masks_lib.padding_mask(decoder_tokens, self.pad_id,
                                             keep_first=self.keep_first)
        weights = []
        for block in self.decoder_blocks:
            x, _, cross = block(x, encoder_outputs, return_attention_scores=True,
                                inputs_mask=target_mask, encoder_outputs_mask=source_mask)
            weights.append(cross)
        return weights
