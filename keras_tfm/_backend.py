"""Backend special cases of keras_tfm's layers and decoding, each a small helper saying why
(figures: benchmarks/README.md); the rest is `keras.ops`. No keras_tfm imports."""

import functools
import math
import weakref

import keras
from keras import ops

_POSITIONS = -2  # the position axis of a key or value cache `(B, H, L, d)`


def _torch():
    return keras.backend.backend() == "torch"


def writes_in_place():
    """Whether a cached decoding step writes its caches and logits in place: under PyTorch with
    autograd off (generation), where Keras's `slice_update` would copy whole caches a step."""
    if not _torch():
        return False
    import torch

    return not torch.is_grad_enabled()


def _plain(layer):  # built, not quantized, no casts: `__call__` adds bookkeeping alone
    return (layer.built and layer.quantization_mode is None
            and layer.compute_dtype == layer.variable_dtype)


def call_layer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)`; under PyTorch, a plain layer's `call` directly: eager PyTorch
    runs Keras's `Layer.__call__` bookkeeping at every call of every sublayer in every step (JAX
    and TensorFlow only when they trace); the layers pass masks and `training` explicitly. With
    autograd off, some layers run as single torch calls (`_torch_inference`). Mixed-precision
    and quantized layers keep `__call__`, which casts and dequantizes."""
    if not (_torch() and _plain(layer)):
        return layer(*args, **kwargs)
    if writes_in_place() and len(args) == 1 and not kwargs.keys() - {"training", "reverse"}:
        output = _torch_inference(layer, args[0], kwargs.get("reverse", False))
        if output is not None:
            return output
    return layer.call(*args, **kwargs)


def _torch_inference(layer, inputs, reverse=False):
    """`layer`'s inference call on a torch tensor as one torch call, or None where `call` must
    run: a last-axis `LayerNormalization` (in float32 at least, as Keras), a `_linear_form`
    product `inputs[..., in] @ kernel[in, out…] + bias` (then the activation), or a tied
    `ReversibleEmbedding`'s logits `inputs @ tableᵀ` (by `_torch_product`)."""
    import torch

    if reverse:  # a tied table's logits, unless LoRA, a reverse dtype or a soft cap change them
        plain = type(layer) is keras.layers.ReversibleEmbedding and layer.tie_weights and not (
            getattr(layer, "lora_enabled", False) or layer.reverse_dtype or layer.logit_soft_cap)
        return _torch_product(layer, inputs, layer.embeddings.value, True) if plain else None
    if type(layer) is keras.layers.LayerNormalization:
        if layer.rms_scaling or layer.axis not in (-1, inputs.dim() - 1, [-1], [inputs.dim() - 1]):
            return None
        dtype = torch.promote_types(inputs.dtype, torch.float32)
        gamma, beta = (None if w is None else w.value.to(dtype) for w in (layer.gamma, layer.beta))
        return torch.nn.functional.layer_norm(inputs.to(dtype), inputs.shape[-1:], gamma, beta,
                                              layer.epsilon).to(inputs.dtype)
    contracted = _linear_form(layer)
    if contracted is None:
        return None
    kernel = layer.kernel.value
    width, tail = math.prod(kernel.shape[:contracted]), tuple(kernel.shape[contracted:])
    lead = inputs.shape[:inputs.dim() - contracted]
    bias = None if layer.bias is None else layer.bias.value.reshape(-1)
    output = _torch_product(layer, inputs.reshape(*lead, width), kernel, False, bias)
    output = output.reshape(*lead, *tail)
    return output if layer.activation is None else layer.activation(output)


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


def dot_product_attention(query, key, value, mask, scale, heads_first=False, causal=False):
    """`keras.ops.dot_product_attention` of queries `(B, T, H, d)` and keys and values
    `(B, S, H, d)` (`(B, H, S, d)` with `heads_first`, PyTorch only), a bool mask broadcasting
    to `(B, H, T, S)` or, with `causal` (`T == S`), the kernel's own causal masking. PyTorch
    calls torch's kernel on `(B, H, ·, d)` views: Keras's torch version copies the keys and
    values first, in cached decoding the whole cache at every step."""
    if not _torch():
        return ops.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                         is_causal=causal)
    import torch

    query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
    mask = None if mask is None else ops.convert_to_tensor(mask, "bool")
    if not heads_first:
        key, value = key.transpose(1, 2), value.transpose(1, 2)
    output = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key, value, attn_mask=mask, scale=scale, is_causal=causal)
    return output.transpose(1, 2)


def reads_cache_views():
    """Whether a cached step's attention reads views of the filled cache positions (`filled_part`)
    by `dot_product_attention`: under PyTorch. Elsewhere, the explicit path's products over the
    whole cache as it lies (the fused one transposes it), unfilled positions masked (XLA)."""
    return _torch()


def filled_part(cache, length):
    """What a step's attention reads of a cache `(B, H, L, d)`: see `reads_cache_views`."""
    if _torch():
        return cache.narrow(_POSITIONS, 0, int(length))
    return cache


def update_cache(cache, index, update):
    """A cache `(B, [2,] H, L, d)` with `update` `(B, [2,] H, T, d)` written at position `index`:
    in place where `writes_in_place`, else `ops.slice_update` (a new array)."""
    if writes_in_place():
        cache.narrow(_POSITIONS, int(index), update.shape[_POSITIONS]).copy_(update)
        return cache
    zero = ops.zeros((), "int32")
    return ops.slice_update(cache, (zero,) * (len(cache.shape) - 2) + (index, zero), update)


def reorder_beams(caches, parent, length):
    """`caches` (nested key/value caches) with each row replaced by row `parent[row]`: where
    `writes_in_place`, in place, the filled positions (`length`) of the rows whose parent is
    another row (not every layer's whole cache a step); elsewhere a gather (`ops.take`)."""
    if not writes_in_place():
        return keras.tree.map_structure(lambda cache: ops.take(cache, parent, axis=0), caches)
    import torch

    rows = torch.nonzero(parent != torch.arange(parent.shape[0], device=parent.device))[:, 0]
    if rows.numel():
        sources = parent[rows]
        for cache in keras.tree.flatten(caches):
            filled = cache.narrow(_POSITIONS, 0, int(length))
            filled.index_copy_(0, rows, filled.index_select(0, sources))
    return caches


def suppress_token(logits, token_id, value):
    """`logits (B, V)` with column `token_id` set to `value`: in place where `writes_in_place`
    (not a whole new `(B, V)` array a step), else a `where` (XLA fuses it)."""
    if writes_in_place():
        logits[:, token_id] = value
        return logits
    column = ops.equal(ops.arange(ops.shape(logits)[-1], dtype="int32"), token_id)
    return ops.where(column[None, :], ops.cast(value, logits.dtype), logits)


def xla_cpu():
    """JAX on the CPU: XLA's slow long-row argmax / top-k (two stages) and fusions (`unfused`)."""
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


def unfused(x):
    """`x`, kept by XLA on the CPU out of a fusion with the next operation: XLA fused the tied
    logits' one-row product with the bias add after it into one naive loop. Else the identity."""
    if not xla_cpu():
        return x
    import jax

    return jax.lax.optimization_barrier(x)
