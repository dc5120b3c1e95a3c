"""Backend special cases of keras_tfm's layers and generation, each in one small helper that
says why it is needed. Everything else uses `keras.ops` alone."""

import contextlib
import functools
import math
import threading
import weakref

import keras
from keras import ops


def unfused(x):
    """`x` unchanged, kept out of the next operation's fusion by XLA on the CPU (JAX).

    XLA's CPU compiler fuses a matrix-vector product against a transposed matrix with an
    element-wise operation after it into one naive loop: the tied logits projection
    `hidden @ embeddingsᵀ + bias` at batch 1, for a 32,000 × 512 table, took 15 ms instead of
    1.2 ms (jax 0.10.2). An optimization barrier keeps the product a library matmul. Other
    backends and devices: the identity.
    """
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            return jax.lax.optimization_barrier(x)
    return x


_DIRECT = threading.local()


def _direct():
    return getattr(_DIRECT, "on", False)


def _torch_direct():
    """Eager PyTorch inside `direct_calls()`: generation owns its caches, which may then be
    written in place."""
    return _direct() and keras.backend.backend() == "torch"


@contextlib.contextmanager
def direct_calls():
    """Within this scope, `call_layer` runs built layers' `call` directly (see there).

    Generation enters it around its search: the layers are built, inputs are tensors of the
    compute dtype, and masks and `training` are passed explicitly.
    """
    previous = _direct()
    _DIRECT.on = True
    try:
        yield
    finally:
        _DIRECT.on = previous


def call_layer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)`; inside `direct_calls()`, the layer's `call` itself.

    Eager PyTorch runs Keras's `Layer.__call__` (input conversion, mask filling, name and
    autocast scopes, `training` inference) at every call: ~50 µs each, against ~36 µs for an
    `EinsumDense.call` at one token; a 6-layer decoder step makes ~120 such calls, more time
    than its matmuls at batch 1. Decoding needs none of that bookkeeping, so inside
    `direct_calls()` a built layer's `call` (`quantized_call` when quantized) runs directly. A
    layer whose variables have another dtype than its computations (mixed precision) still
    goes through `__call__`, which casts its variables. Under PyTorch a `Dense` or
    `EinsumDense` layer runs as a torch matrix product (`_torch_linear`). Under JAX and
    TensorFlow this only shortens tracing.
    """
    if _direct() and layer.built and layer.compute_dtype == layer.variable_dtype:
        if layer.quantization_mode is not None:
            return layer.quantized_call(*args, **kwargs)
        if keras.backend.backend() == "torch" and len(args) == 1 and not kwargs:
            output = _torch_linear(layer, args[0])
            if output is not None:
                return output
        return layer.call(*args, **kwargs)
    return layer(*args, **kwargs)


def dot_product_attention(query, key, value, mask, scale):
    """`keras.ops.dot_product_attention` of `(B, T, H, d)` tensors with a boolean mask
    broadcasting to `(B, H, T, S)`.

    Two backends take another route to the same numbers:

    * PyTorch: torch's `scaled_dot_product_attention` on transposed views. Keras's torch
      version copies the keys and values into new contiguous tensors first, which in cached
      decoding is the whole cache at every step (2× the attention's time at 64 rows × 32
      positions); torch's kernel takes the strided views as they are.
    * JAX on the CPU, one query position (a decoding step) and more than one row: products
      and sums instead of batched matrix products, for which XLA first transposes the keys
      and values to `(B, H, S, d)`; a quarter of a beam search's time went to those copies.
      Measured at 32 positions, 8 heads: 0.67 → 0.30 ms at 64 rows, 0.17 → 0.11 at 16,
      0.11 → 0.06 at 4; at one row XLA needs no copy and the matrix products stay faster
      (0.025 against 0.13 ms).
    """
    if keras.backend.backend() == "torch":
        import torch

        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        mask = None if mask is None else ops.convert_to_tensor(mask, "bool")
        output = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask,
            scale=scale)
        return output.transpose(1, 2)
    if keras.backend.backend() == "jax" and query.shape[1] == 1 and query.shape[0] != 1:
        import jax

        if jax.default_backend() == "cpu":
            from keras_tfm.masks import apply_to_scores

            # In float32 throughout, as the fused path accumulates (half-precision sums would
            # differ from it).
            query, key = ops.cast(query, "float32"), ops.cast(key, "float32")
            scores = ops.sum(query * key, axis=-1) * scale  # (B, S, H)
            if mask is not None:  # (B|1, 1, 1, S|1) -> (B|1, S|1, 1)
                scores = apply_to_scores(scores, ops.transpose(mask[:, 0], (0, 2, 1)))
            weights = ops.softmax(scores, axis=1)[..., None]
            output = ops.sum(weights * ops.cast(value, "float32"), axis=1, keepdims=True)
            return ops.cast(output, value.dtype)
    return ops.dot_product_attention(query, key, value, mask=mask, scale=scale)


def update_cache(cache, index, update):
    """`cache` with `update` written at `index` along axis 2 (the position axis).

    `ops.slice_update`, except under PyTorch inside `direct_calls()` (generation, which owns
    its caches and never reads an old one again): there the cache is written in place, as
    Keras's torch `slice_update` clones the whole cache at every decoding step.
    """
    if _torch_direct():
        cache.narrow(2, index, update.shape[2]).copy_(update)
        return cache
    zero = ops.zeros((), "int32")
    return ops.slice_update(cache, (zero, zero, index, zero, zero), update)


_LINEAR = weakref.WeakKeyDictionary()  # layer -> (kernel and bias versions, weight, bias)


def _linear_form(layer):
    """How many trailing input axes a `Dense` or `EinsumDense` layer contracts with the leading
    axes of its kernel, when the layer is `inputs[..., in] @ kernel[in, out...] + bias[out...]`
    (then an activation); None for another einsum, LoRA or a quantized layer."""
    if getattr(layer, "lora_enabled", False) or layer.quantization_mode is not None:
        return None
    if type(layer) is keras.layers.Dense:
        return 1
    if type(layer) is not keras.layers.EinsumDense:
        return None
    n = _contracted_axes(layer.equation)
    if n is None or (layer.bias is not None
                     and tuple(layer.bias.shape) != tuple(layer.kernel.shape[n:])):
        return None
    return n


@functools.lru_cache(maxsize=None)
def _contracted_axes(equation):
    """n for an einsum `...x,xk->...k` contracting the input's last n axes with the kernel's
    first n (parsed once per equation: layers call this at every decoding step)."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    n = sum(letter in inputs for letter in kernel)
    if kernel[:n] == inputs[-n:] and output == inputs[:-n] + kernel[n:]:
        return n
    return None


def _torch_linear(layer, inputs):
    """A `Dense`/`EinsumDense` call in torch alone, or None where that does not apply.

    `ops.einsum` and `ops.add` cost ~40 µs of Python a call at one token, against ~15 µs for
    the product itself. From 8 rows on, the product runs against a cached `(out, in)` copy of
    the kernel (`torch.nn.Linear`'s layout, which transformers uses): on the CPU torch's
    matrix products against it were 15-25% faster at 16 and 64 rows, and ~20% slower at one
    row, than against Keras's `(in, out)` kernel. The copy (as much memory again as the kernel) is
    remade when a weight changes (torch counts in-place updates).
    """
    contracted = _linear_form(layer)
    if contracted is None:
        return None
    kernel = layer.kernel.value
    if kernel.device.type != "cpu":
        return None
    import torch

    bias = None if layer.bias is None else layer.bias.value
    lead = inputs.shape[:inputs.dim() - contracted]
    inputs = inputs.reshape(*lead, -1)
    if math.prod(lead) < 8:
        output = torch.matmul(inputs, kernel.reshape(inputs.shape[-1], -1))
        if bias is not None:
            output = output + bias.reshape(-1)
    else:
        versions = (kernel.data_ptr(), kernel._version,  # the same tensor, not updated since
                    None if bias is None else (bias.data_ptr(), bias._version))
        cached = _LINEAR.get(layer)
        if cached is None or cached[0] != versions:
            weight = kernel.reshape(inputs.shape[-1], -1).T.contiguous()
            cached = (versions, weight, None if bias is None else bias.reshape(-1))
            _LINEAR[layer] = cached
        output = torch.nn.functional.linear(inputs, cached[1], cached[2])
    output = output.reshape(*lead, *kernel.shape[contracted:])
    return output if layer.activation is None else layer.activation(output)


def filled_part(cache, length):
    """The keys and values `(B, L', H, d)` of a cache `(B, 2, L, H, d)` that attention reads.

    Under PyTorch inside `direct_calls()` (generation, which passes no `attention_mask`),
    views of the first `length` (filled) positions, as transformers' growing cache attends to;
    otherwise the whole cache, whose unfilled positions the causal mask excludes (compiled
    backends need static shapes). (On a GPU, `int(length)` waits for the device once a layer
    and step.)
    """
    if _torch_direct():
        cache = cache.narrow(2, 0, int(length))
    return cache[:, 0], cache[:, 1]


def reorder_beams(cache, parent, length):
    """`ops.take(cache, parent, axis=0)`: the cache rows of each kept beam's parent.

    Under PyTorch inside `direct_calls()`, only the first `length` (filled) positions are
    gathered, in place: a beam step otherwise copies every layer's whole cache.
    """
    if _torch_direct():
        filled = cache.narrow(2, 0, int(length))
        filled.copy_(filled.index_select(0, parent))
        return cache
    return ops.take(cache, parent, axis=0)


def argmax(x):
    """`ops.argmax(x, axis=-1)` as int32: the first index of each row's largest value.

    Under JAX on the CPU, the row maximum and then the smallest index holding it: XLA's CPU
    argmax (a reduction over value-index pairs) took 4.5 ms on `(64, 32000)` logits against
    1.0 ms for these two plain reductions (0.17 against 0.05 ms for one row). A row without
    a maximum (NaN) gives its last index.
    """
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() == "cpu":
            size = ops.shape(x)[-1]
            positions = ops.arange(size, dtype="int32")
            first = ops.min(ops.where(ops.equal(x, ops.max(x, axis=-1, keepdims=True)),
                                      positions, size), axis=-1)
            return ops.minimum(first, size - 1)
    return ops.cast(ops.argmax(x, axis=-1), "int32")
