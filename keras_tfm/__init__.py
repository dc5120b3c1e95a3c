"""keras_tfm: Keras 3 layers for the encoder-decoder transformer."""

from keras_tfm import masks
from keras_tfm.attention import CrossAttention
from keras_tfm.attention import MultiHeadSelfAttention
from keras_tfm.attention import scaled_dot_product_attention
from keras_tfm.positional import PositionEmbedding
from keras_tfm.positional import SinusoidalPositionalEncoding

__version__ = "0.1.0"
