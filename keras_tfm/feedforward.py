"""The position-wise feed-forward network (seed 004 §9)."""

import keras

from keras_tfm._checks import clone_initializer, with_quantized_dtypes
from keras_tfm._checks import check_dropout, check_positive_int, check_rank
from keras_tfm._layer_calls import call_layer
from keras_tfm.dropout import Dropout

_SERIALIZABLE = keras.saving.register_keras_serializable(package="keras_tfm")


@_SERIALIZABLE
def gelu_approximate(x):
    """GELU with the tanh approximation, `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`: GPT-2's
    `gelu_new` (transformers' name), `keras.activations.gelu(x, approximate=True)`."""
    return keras.activations.gelu(x, approximate=True)


def get_activation(activation):
    """`keras.activations.get`, which also knows `"gelu_approximate"` (`gelu_approximate`)."""
    if activation == "gelu_approximate":
        return gelu_approximate
    return keras.activations.get(activation)


@_SERIALIZABLE
class FeedForward(keras.layers.Layer):
    """`FFN(x) = W₂ σ(W₁x + b₁) + b₂`, the same weights at every position.

    With `gated=True`, the gated linear unit of Shazeer (2020): `FFN(x) = W₂ (σ(W₁x) ⊙ Vx)`,
    SwiGLU with `activation="silu"` (LLaMA), GeGLU with `"gelu"`. `W₁` is `intermediate_dense`
    (LLaMA's `gate_proj`), `V` is `up_dense` (`up_proj`), `W₂` is `output_dense` (`down_proj`).

    Args:
        ff_dim: width of the hidden layer (`W₁` maps `d_model → ff_dim`).
        activation: `σ`, ReLU in the paper (any Keras activation, or `"gelu_approximate"`).
        gated: multiply the activated hidden layer by a second, linear one (`V`).
        dropout: dropout rate on the hidden activations, in [0, 1).
        use_bias: whether both layers have biases.
        kernel_initializer, bias_initializer: for both dense layers.
        **kwargs: base `Layer` arguments.

    Call arguments:
        inputs: `(B, T, d_model)`; its Keras mask passes through.
        training: whether dropout is active.

    Returns:
        `(B, T, d_model)`: the output width equals the input width.

    Example:

    >>> FeedForward(ff_dim=32)(keras.random.normal((2, 5, 8))).shape
    (2, 5, 8)
    >>> swiglu = FeedForward(ff_dim=32, activation="silu", gated=True, use_bias=False)
    """

    def __init__(self, ff_dim, activation="relu", dropout=0.0, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", gated=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.ff_dim = check_positive_int("ff_dim", ff_dim)
        self.activation = get_activation(activation)
        self.gated = bool(gated)
        self.dropout = check_dropout("dropout", dropout)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True

    def _dense(self, units, name, activation=None):
        return keras.layers.Dense(
            units, activation=activation, use_bias=self.use_bias,
            kernel_initializer=clone_initializer(self.kernel_initializer),
            bias_initializer=clone_initializer(self.bias_initializer),
            dtype=self.dtype_policy, name=name,
        )

    def build(self, input_shape):
        check_rank(self, "inputs", input_shape, 3)
        d_model = input_shape[-1]
        self.intermediate_dense = self._dense(self.ff_dim, "intermediate_dense", self.activation)
        self.intermediate_dense.build(input_shape)
        if self.gated:
            self.up_dense = self._dense(self.ff_dim, "up_dense")
            self.up_dense.build(input_shape)
        self.dropout_layer = Dropout(self.dropout, dtype=self.dtype_policy, name="dropout")
        self.output_dense = self._dense(d_model, "output_dense")
        self.output_dense.build(tuple(input_shape[:-1]) + (self.ff_dim,))

    def call(self, inputs, training=None):
        hidden = call_layer(self.intermediate_dense, inputs)
        if self.gated:
            hidden = hidden * call_layer(self.up_dense, inputs)
        if training:
            hidden = call_layer(self.dropout_layer, hidden, training=training)
        return call_layer(self.output_dense, hidden)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return with_quantized_dtypes(self, super().get_config()) | {
            "ff_dim": self.ff_dim,
            "activation": keras.activations.serialize(self.activation),
            "gated": self.gated,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }
