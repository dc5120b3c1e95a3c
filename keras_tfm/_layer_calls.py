"""How keras_tfm's layers call their sublayers (`call_layer`): Keras's `__call__`, or under
PyTorch a plain layer's `call` (and, with autograd off, single torch calls), and a tied
table's logits (`tied_logits`). Figures: benchmarks/README.md."""

import functools
import math
import weakref

import keras
from keras import ops

from keras_tfm._backend import _torch, writes_in_place


def _plain(layer):  # built, not quantized, no casts: `__call__` adds bookkeeping alone
    return (layer.built and layer.quantization_mode is None
            and layer.compute_dtype == layer.variable_dtype)


def call_layer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)`; under PyTorch, a plain layer's `call` directly: eager PyTorch
    runs Keras's `Layer.__call__` bookkeeping at every call of every sublayer in every step (JAX
    and TensorFlow only when they trace); the layers pass masks and `training` explicitly. With
    autograd off, some layers run as single torch calls (`_torch_inference`). Mixed-precision
    and quantized layers keep `__call__`, which casts and dequantizes. TensorFlow: a tied
    table's logits in a cached step by `tied_logits`."""
    if kwargs.get("reverse") and _tf_step(args[0]) and _plain(layer) and _plain_tied(layer):
        return tied_logits(args[0], layer.embeddings.value)
    if not (_torch() and _plain(layer)):
        return layer(*args, **kwargs)
    if writes_in_place() and len(args) == 1 and not kwargs.keys() - {"training", "reverse"}:
        output = _torch_inference(layer, args[0], kwargs.get("reverse", False))
        if output is not None:
            return output
    return layer.call(*args, **kwargs)


_RUNNERS = weakref.WeakKeyDictionary()  # layer -> {its key in `_torch_inference`: runner}


def _torch_inference(layer, inputs, reverse=False):
    """`layer`'s inference call on a torch tensor as one torch call, or None where `call` must
    run: a last-axis `LayerNormalization` (in float32 at least, as Keras), a `_linear_form`
    product `inputs[..., in] @ kernel[in, out…] + bias` (then the activation), or a tied
    `ReversibleEmbedding`'s logits `inputs @ tableᵀ` (by `_torch_product`). The form is worked
    out once per layer (again when LoRA is switched or the input rank changes): Python checks
    of every layer at every step cost as much as the one-row products themselves."""
    key = (reverse, bool(vars(layer).get("lora_enabled")), inputs.dim())
    runners = _RUNNERS.setdefault(layer, {})
    if key not in runners:
        runners[key] = _torch_runner(layer, reverse, inputs.dim())
    run = runners[key]
    return None if run is None else run(inputs)


def _torch_runner(layer, reverse, rank):
    """The function `_torch_inference` calls for `layer` on inputs of `rank`, or None."""
    import torch

    if reverse:
        if not _plain_tied(layer):
            return None
        table = layer.embeddings
        return lambda inputs: _torch_product(layer, inputs, table.value, True)
    if type(layer) is keras.layers.LayerNormalization:
        if layer.rms_scaling or layer.axis not in (-1, rank - 1, [-1], [rank - 1]):
            return None
        weights, epsilon = (layer.gamma, layer.beta), layer.epsilon

        def normalize(inputs):
            dtype = torch.promote_types(inputs.dtype, torch.float32)
            gamma, beta = (None if w is None else w.value.to(dtype) for w in weights)
            return torch.nn.functional.layer_norm(inputs.to(dtype), inputs.shape[-1:], gamma,
                                                  beta, epsilon).to(inputs.dtype)
        return normalize
    contracted = _linear_form(layer)
    if contracted is None:
        return None
    kernel, bias = layer.kernel, layer.bias
    width, tail = math.prod(kernel.shape[:contracted]), tuple(kernel.shape[contracted:])
    activation = None if layer.activation in (None, keras.activations.linear) else (
        layer.activation)

    def product(inputs):
        lead = inputs.shape[:inputs.dim() - contracted]
        output = _torch_product(layer, inputs.reshape(*lead, width), kernel.value, False,
                                None if bias is None else bias.value.reshape(-1))
        output = output.reshape(*lead, *tail)
        return output if activation is None else activation(output)
    return product


def _plain_tied(layer):
    """A tied `ReversibleEmbedding` whose reverse call is `inputs @ tableᵀ`: no LoRA, reverse
    dtype or logit soft cap."""
    return type(layer) is keras.layers.ReversibleEmbedding and layer.tie_weights and not (
        getattr(layer, "lora_enabled", False) or layer.reverse_dtype or layer.logit_soft_cap)


def tied_logits(hidden, table):
    """Logits `hidden (B, T, d) @ tableᵀ` of a tied `(V, d)` table. TensorFlow, one position a
    row (a cached step): as `(table · hiddenᵀ)ᵀ`, TensorFlow's own product against the
    transposed table being several times slower for a few rows outside XLA (and the order
    alike under XLA, slower for the many rows of training; benchmarks/README.md)."""
    if _tf_step(hidden):
        import tensorflow as tf

        logits = tf.transpose(tf.linalg.matmul(table, hidden[:, 0], transpose_b=True))
        return logits[:, None]
    return ops.matmul(hidden, ops.transpose(table))


def logits_against(hidden, transposed):
    """Tied logits `hidden (B, T, d) @ transposed` against a table given transposed, `(d, V)`
    (a search's copy, `_backend.transposed_table`): `tied_logits(hidden, table)`'s numbers."""
    return ops.matmul(hidden, ops.cast(transposed, hidden.dtype))


def _tf_step(hidden):
    """TensorFlow, hidden states `(B, 1, d)`: one position a row, a cached step's."""
    return (keras.backend.backend() == "tensorflow" and len(hidden.shape) == 3
            and hidden.shape[1] == 1)


_PACKED = weakref.WeakKeyDictionary()  # layer -> (weight tensor, its version, packed copy)


def _torch_product(layer, inputs, weight, transposed, bias=None):
    """`inputs (N, in) @ W + bias`, W the weight `(in, out…)` (`(out, in)` if `transposed`); in
    float32 on the CPU by oneDNN's kernel against a copy of W packed in its layout (as much
    memory again; remade when the weight tensor or its in-place version changes), which beat
    torch's own products on the CPUs of benchmarks/README.md."""
    import torch

    if (inputs.dtype != torch.float32 or weight.device.type != "cpu"
            or not torch.backends.mkldnn.is_available()):
        output = inputs @ (weight.T if transposed else weight.reshape(inputs.shape[-1], -1))
        return output if bias is None else output + bias
    held = _PACKED.get(layer)
    if held is None or held[0] is not weight or held[1] != weight._version:
        matrix = weight if transposed else weight.reshape(inputs.shape[-1], -1).T
        held = _PACKED[layer] = (weight, weight._version,
                                 torch.ops.mkldnn._reorder_linear_weight(matrix.contiguous()))
    return torch.ops.mkldnn._linear_pointwise(inputs, held[2], bias, "none", [], "")


def _linear_form(layer):
    """n when a `Dense` / `EinsumDense` layer is `inputs[..., in] @ kernel[in, out…] + bias`
    with `in` its input's last n axes (then an activation); None for another einsum or LoRA."""
    if getattr(layer, "lora_enabled", False) or type(layer) not in (keras.layers.Dense,
                                                                     keras.layers.EinsumDense):
        return None
    if type(layer) is keras.layers.Dense:
        return 1
    n = _contracted_axes(layer.equation)
    if n is None or (layer.bias is not None
                     and tuple(layer.bias.shape) != tuple(layer.kernel.shape[n:])):
        return None
    return n


@functools.lru_cache(maxsize=None)
def _contracted_axes(equation):
    """n for an einsum `...x,xk->...k` contracting the input's last n axes (parsed once)."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    n = sum(letter in inputs for letter in kernel)
    if kernel[:n] == inputs[-n:] and output == inputs[:-n] + kernel[n:]:
        return n
    return None


def tied_table(layer, embedding=None):
    """The `(V, d)` table variable of a tied logits layer, where its logits are exactly
    `hidden @ tableᵀ`: a plain tied `ReversibleEmbedding` (`layer`), or a plain layer reading
    the plain `embedding`'s matrix without LoRA (`TiedLogits`); else None."""
    if embedding is None:
        return layer.embeddings if _plain(layer) and _plain_tied(layer) else None
    plain = _plain(layer) and _plain(embedding) and not getattr(embedding, "lora_enabled", False)
    return embedding.embeddings if plain else None
