"""Backend special cases of keras_tfm's cached decoding, each a small helper saying why
(figures: benchmarks/README.md); the rest is `keras.ops`. No keras_tfm imports. (How layers
call their sublayers: `_layer_calls`.)"""

import functools
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

    query, key, value = (torch.as_tensor(x) for x in (query, key, value))
    mask = None if mask is None else torch.as_tensor(mask).bool()
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


def stacks_caches(rows):
    """Whether a search of `rows` rows (an int) holds each self-attention cache as one stacked
    `(B, 2, H, L, d)` array rather than a `(keys, values)` pair: under XLA on the CPU at one
    row, where a pair's write is computed twice (for the next step, and for the attention,
    which reads the cache without its unit batch axis) and each cache copied two to four times
    a step. Elsewhere the pair: a slice of the stacked array is a copy a layer a step."""
    return xla_cpu() and rows == 1


def attention_scores(query, key, heads_first=False):
    """Scores `(B, H, T, S)` of queries `(B, T, H, d)` against keys `(B, S, H, d)` (`(B, H, S,
    d)` with `heads_first`: a cache's). Under XLA on the CPU heads-first scores are taken as
    `keys · queryᵀ`, then swapped: for `query · keysᵀ` at one source row XLA copied the keys
    transposed, the whole key cache of every layer at every step."""
    if heads_first and xla_cpu():
        return ops.swapaxes(ops.einsum("bhsd,bthd->bhst", key, query), -1, -2)
    return ops.einsum("bthd,bhsd->bhts" if heads_first else "bthd,bshd->bhts", query, key)


def filled_part(cache, length):
    """What a step's attention reads of a cache `(B, H, L, d)`: see `reads_cache_views`."""
    if _torch():
        return cache.narrow(_POSITIONS, 0, int(length))
    return cache


def update_cache(cache, index, update):
    """A cache `(B, [2,] H, L, d)` with the new keys or values `update` `(B, [2,] T, H, d)`
    written heads first at position `index` (in the cache's dtype): in place where
    `writes_in_place` (torch's copy transposes and casts), else `ops.slice_update` (a new
    array)."""
    if writes_in_place():
        cache.narrow(_POSITIONS, int(index), update.shape[-3]).copy_(update.transpose(-3, -2))
        return cache
    zero = ops.zeros((), "int32")
    start = (zero,) * (len(cache.shape) - 2) + (ops.cast(index, "int32"), zero)
    update = ops.cast(ops.swapaxes(update, -3, -2), cache.dtype)
    if _tensorflow_outside_xla():
        import tensorflow as tf

        begin = tf.stack(start)
        return tf.raw_ops.TensorStridedSliceUpdate(input=cache, begin=begin,
                                                   end=begin + tf.shape(update),
                                                   strides=tf.ones_like(begin), value=update)
    return ops.slice_update(cache, start, update)


def _tensorflow_outside_xla():
    """TensorFlow, eager or in a graph that XLA does not compile (generation below 17 rows).
    There Keras's `slice_update` (tf2xla's `XlaDynamicUpdateSlice`) runs as a one-operation XLA
    program copying the whole cache at every write; TensorFlow's own strided-slice update
    writes into the cache when nothing else reads it. (Inside XLA it needs constant indices.)"""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util  # (TensorFlow has no public test)

    return not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


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


FEW_ROWS = 16  # the most rows (sources × beams) of a JAX search compiled without YNNPACK
_NO_YNNPACK = (("xla_cpu_experimental_ynn_fusion_type", ""),)


def few_rows_options(rows, quantized):
    """XLA's compile options of a JAX search of `rows` rows (sources × beams) on the CPU:
    YNNPACK off for at most `FEW_ROWS` rows of a model that is not `quantized` (XLA's own
    products read a few rows' weights faster; quantized products need YNNPACK's int8
    kernels), else None (also where this JAX's XLA lacks the option). Such a search takes its
    tied logits against the table transposed (`transposed_table`): XLA's own product of a few
    rows against the `(V, d)` table is many times slower. Figures: benchmarks/README.md."""
    if not (xla_cpu() and rows <= FEW_ROWS and not quantized and _knows(_NO_YNNPACK)):
        return None
    return dict(_NO_YNNPACK)


@functools.lru_cache(maxsize=None)
def _knows(options):
    """Whether this JAX's XLA compiles with `options` ((name, value) pairs; it refuses an
    option it lacks)."""
    import jax

    try:
        jax.jit(lambda x: x, compiler_options=dict(options)).lower(0).compile()
    except Exception:  # an INVALID_ARGUMENT JaxRuntimeError
        return False
    return True


def quantized_variables(variables):
    """Whether `variables` include a quantized layer's (int8, int4 or float8)."""
    return any(v.dtype in ("int8", "int4") or v.dtype.startswith("float8") for v in variables)


_TRANSPOSED = weakref.WeakKeyDictionary()  # model -> (its table's value, the value transposed)


def transposed_table(model, table, rows):
    """`model`'s tied logits table variable `table` `(V, d)` as a `(d, V)` array of its own
    (as much memory again, made once per value) where a search of `rows` rows compiles with
    `few_rows_options` (made inside the compiled search, XLA would fold the transpose back
    into the product); else None."""
    if table is None or few_rows_options(rows, quantized_variables(model.variables)) is None:
        return None
    held = _TRANSPOSED.get(model)
    if held is None or held[0] is not table.value:
        held = _TRANSPOSED[model] = (table.value, ops.transpose(table.value))
    return held[1]


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
