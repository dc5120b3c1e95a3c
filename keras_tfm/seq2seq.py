"""The encoder-decoder transformer assembled with the Keras functional API (seed 000's block
diagram: embeddings + positional encoding → N encoder blocks; embeddings + positional encoding →
N decoder blocks attending to the encoder output → linear → softmax)."""

import keras

from keras_tfm._checks import check_dropout, check_positive_int
from keras_tfm.blocks import TransformerDecoderBlock, TransformerEncoderBlock
from keras_tfm.dropout import Dropout
from keras_tfm.embedding import TokenAndPositionEmbedding


def build_transformer(
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
):
    """Build the encoder-decoder transformer as a functional `keras.Model`.

    Inputs `encoder_tokens` `(B, S)` and `decoder_tokens` `(B, T)` are int token ids with 0 as
    padding; the output is the logits `(B, T, tgt_vocab_size)` (the softmax is left to the loss).
    Layer names follow the seed's diagram: `encoder_embedding`, `encoder_block_{i}`,
    `decoder_embedding`, `decoder_block_{i}`, `logits`; with `norm_first=True` (pre-LN) each
    stack ends in a layer normalization (`encoder_norm`, `decoder_norm`), as in `torch.nn.Transformer`.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (id 0 is padding in both).
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
            (`logits = h Eᵀ`, no separate output kernel). Only the target side is tied, so the
            source and target vocabularies may differ.
        name: the model's name.

    Returns:
        A `keras.Model` mapping `[encoder_tokens, decoder_tokens]` to logits.

    Example:

    >>> model = build_transformer(100, 120, d_model=32, num_heads=4, ff_dim=64,
    ...                           num_encoder_layers=2, num_decoder_layers=2)
    >>> model([np.ones((2, 7)), np.ones((2, 5))]).shape
    (2, 5, 120)
    """
    check_positive_int("num_encoder_layers", num_encoder_layers)
    check_positive_int("num_decoder_layers", num_decoder_layers)
    check_positive_int("d_model", d_model)
    check_positive_int("num_heads", num_heads)
    check_dropout("dropout", dropout)
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}.")
    embedding_kwargs = dict(d_model=d_model, max_length=max_length, positional=positional)
    block_kwargs = dict(num_heads=num_heads, ff_dim=ff_dim, dropout=dropout,
                        attention_dropout=attention_dropout,
                        activation_dropout=activation_dropout,
                        norm_first=norm_first)

    encoder_tokens = keras.Input((None,), dtype="int32", name="encoder_tokens")
    decoder_tokens = keras.Input((None,), dtype="int32", name="decoder_tokens")

    x = TokenAndPositionEmbedding(src_vocab_size, name="encoder_embedding",
                                  **embedding_kwargs)(encoder_tokens)
    x = Dropout(dropout, name="encoder_embedding_dropout")(x)
    for i in range(num_encoder_layers):
        x = TransformerEncoderBlock(name=f"encoder_block_{i}", **block_kwargs)(x)
    if norm_first:
        x = keras.layers.LayerNormalization(epsilon=1e-5, name="encoder_norm")(x)

    target_embedding = TokenAndPositionEmbedding(tgt_vocab_size, name="decoder_embedding",
                                                 **embedding_kwargs)
    y = target_embedding(decoder_tokens)
    y = Dropout(dropout, name="decoder_embedding_dropout")(y)
    for i in range(num_decoder_layers):
        y = TransformerDecoderBlock(name=f"decoder_block_{i}", **block_kwargs)(y, x)
    if norm_first:
        y = keras.layers.LayerNormalization(epsilon=1e-5, name="decoder_norm")(y)
    if tie_embeddings:
        logits = target_embedding(y, reverse=True)
    else:
        logits = keras.layers.Dense(tgt_vocab_size, name="logits")(y)
    return keras.Model([encoder_tokens, decoder_tokens], logits, name=name)
