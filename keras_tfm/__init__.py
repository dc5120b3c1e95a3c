"""keras_tfm: Keras 3 layers for the encoder-decoder transformer."""

from keras_tfm import losses
from keras_tfm import masks
from keras_tfm import metrics
from keras_tfm import saving
from keras_tfm import schedules
from keras_tfm.attention import CrossAttention
from keras_tfm.attention import MultiHeadSelfAttention
from keras_tfm.attention import scaled_dot_product_attention
from keras_tfm.blocks import TransformerDecoderBlock
from keras_tfm.blocks import TransformerEncoderBlock
from keras_tfm.embedding import TokenAndPositionEmbedding
from keras_tfm.feedforward import FeedForward
from keras_tfm.generation import Seq2SeqParts
from keras_tfm.generation import generate
from keras_tfm.losses import MaskedSparseCategoricalCrossentropy
from keras_tfm.metrics import MaskedAccuracy
from keras_tfm.positional import PositionEmbedding
from keras_tfm.positional import SinusoidalPositionalEncoding
from keras_tfm.schedules import TransformerSchedule
from keras_tfm.seq2seq import build_transformer

__version__ = "0.1.0"

__all__ = [
    "CrossAttention",
    "FeedForward",
    "MaskedAccuracy",
    "MaskedSparseCategoricalCrossentropy",
    "MultiHeadSelfAttention",
    "PositionEmbedding",
    "Seq2SeqParts",
    "SinusoidalPositionalEncoding",
    "TokenAndPositionEmbedding",
    "TransformerDecoderBlock",
    "TransformerEncoderBlock",
    "TransformerSchedule",
    "build_transformer",
    "generate",
    "losses",
    "masks",
    "metrics",
    "saving",
    "scaled_dot_product_attention",
    "schedules",
]
