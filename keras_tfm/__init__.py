"""keras_tfm: Keras 3 layers for the transformer: encoder-decoder, decoder-only and encoder-only."""

from keras_tfm import distribution, losses, masks, metrics, saving, schedules, text
from keras_tfm._checks import check_token_ids
from keras_tfm.attention import (
    CrossAttention,
    MultiHeadSelfAttention,
    scaled_dot_product_attention,
)
from keras_tfm.blocks import TransformerDecoderBlock, TransformerEncoderBlock
from keras_tfm.dropout import Dropout
from keras_tfm.embedding import TiedLogits, TokenAndPositionEmbedding
from keras_tfm.feedforward import FeedForward
from keras_tfm.generation import Seq2SeqParts, generate
from keras_tfm.losses import MaskedSparseCategoricalCrossentropy
from keras_tfm.marian import from_marian, to_marian
from keras_tfm.metrics import MaskedAccuracy
from keras_tfm.models import EncoderModel, LanguageModel, build_encoder, build_language_model
from keras_tfm.positional import PositionEmbedding, RotaryEmbedding, SinusoidalPositionalEncoding
from keras_tfm.pretrained import from_pretrained, to_pretrained
from keras_tfm.schedules import TransformerSchedule
from keras_tfm.seq2seq import Seq2SeqTransformer, build_transformer

__version__ = "0.1.0"

__all__ = [
    "CrossAttention",
    "Dropout",
    "EncoderModel",
    "FeedForward",
    "LanguageModel",
    "MaskedAccuracy",
    "MaskedSparseCategoricalCrossentropy",
    "MultiHeadSelfAttention",
    "PositionEmbedding",
    "RotaryEmbedding",
    "Seq2SeqParts",
    "Seq2SeqTransformer",
    "SinusoidalPositionalEncoding",
    "TiedLogits",
    "TokenAndPositionEmbedding",
    "TransformerDecoderBlock",
    "TransformerEncoderBlock",
    "TransformerSchedule",
    "build_encoder",
    "build_language_model",
    "build_transformer",
    "check_token_ids",
    "distribution",
    "from_marian",
    "from_pretrained",
    "generate",
    "losses",
    "masks",
    "metrics",
    "saving",
    "scaled_dot_product_attention",
    "schedules",
    "text",
    "to_marian",
    "to_pretrained",
]
