"""Backend special cases of keras_tfm's layers and generation, each in one small helper that
says why it is needed. Everything else uses `keras.ops` alone."""

import contextlib
import functools
import math
import threading
import weakref

import keras
from keras import ops


def _xla_cpu():
    """Whether the code being traced is compiled by XLA for the CPU: JAX on the CPU, or a
    TensorFlow search that generation compiles with XLA (`direct_calls(xla=True)`) on a machine
    without a GPU. XLA's CPU compiler is what `unfused`, `argmax` and `top_k` work around."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() == "cpu"
    if backend == "tensorflow" and getattr(_DIRECT, "xla", False):
        import tensorflow as tf

        return not tf.config.list_logical_devices("GPU")
    return False


_FEW_ROWS = 16  # the most rows (sources × beams) of a search compiled without YNNPACK
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}
_LLVM_LEVEL_1 = {"xla_backend_optimization_level": 1}


def _few_rows_under_jax_on_the_cpu(rows):
    """Whether a search of `rows` rows (sources × beams) is one that `compiler_options` and
    `transposed_weights` change: at most `_FEW_ROWS` rows, under JAX on the CPU (the two need
    each other: see there)."""
    return rows <= _FEW_ROWS and keras.backend.backend() == "jax" and _xla_cpu()


def compiler_options(rows, layers=()):
    """XLA's options for compiling a search of `rows` rows (sources × beams) of a model of
    `layers` under JAX on the CPU: LLVM's optimization level 1, and YNNPACK off for at most 16
    rows unless a layer is quantized; elsewhere (other backends, JAX on a GPU) None.

    XLA's CPU compiler emits its own kernels (the element-wise fusions, reductions, gathers,
    top-k) through LLVM, at optimization level 2 by default, and a search has a few dozen of
    them; at level 1 it compiles faster and ran as fast or faster. Measured on a 2-core AMD
    EPYC (Zen 2), opus-mt-base, 32 new tokens, jax 0.10.2, three pairs of processes in turns
    (first call less the warm median; warm median of 5), level 2 / level 1: compile at one row
    3.4-4.0 / 2.6-2.9 s, 16 rows 3.1-3.4 / 2.2-2.8, 16 sources × beam 4 3.4-4.2 / 3.1-3.3, 64
    rows 3.3-4.0 / 2.1-3.6; warm one row 0.33-0.35 / 0.29-0.31 s, 16 rows 1.03-1.18 /
    0.98-1.03, beam 3.01-3.12 / 2.56-2.62, 64 rows 2.80-3.30 / 2.70-2.87; a 2-layer model of
    width 16 (compilation alone) 2.1-2.3 / 1.4-1.5 s.

    XLA hands matrix products, with the element-wise work around them, to YNNPACK's kernels.
    In a search of a few rows those ran slower than XLA's own (Eigen's)
    products, against weights read afresh from memory at every step. Measured with the tied
    logits against a transposed table (`transposed_weights`, which Eigen needs: without it 4
    rows took 2.3-2.7 s), opus-mt-base, 32 new tokens, jax 0.10.2, 2-core AMD EPYC, in turns,
    tokens equal; with YNNPACK / without: 4 rows 0.55 / 0.35 s, 8 rows 0.73 / 0.52, 16 rows
    1.00 / 0.77, 4 sources × beam 4 1.00 / 0.73, one row level (0.21 / 0.22; in a noisier
    hour 0.33-0.42 / 0.26-0.30); from 24 rows YNNPACK is faster (24 rows 1.29 / 1.70, 32 rows
    1.60 / 1.94, 64 rows 2.2 / 2.9, 8 sources × beam 4 1.55 / 1.86). Quantized products need
    YNNPACK's int8 kernels (`quantize("int8")`, 16 rows: 792 tokens/s with them, 138
    without). An option this JAX's XLA lacks is left out (its default then).
    """
    if keras.backend.backend() != "jax" or not _xla_cpu():
        return None
    options = dict(_LLVM_LEVEL_1) if _knows_options(tuple(_LLVM_LEVEL_1.items())) else {}
    if (_few_rows_under_jax_on_the_cpu(rows) and _knows_options(tuple(_NO_YNN.items()))
            and not any(getattr(layer, "quantization_mode", None) for layer in layers)):
        options |= _NO_YNN
    return options or None


@functools.lru_cache(maxsize=None)
def _knows_options(items):
    """Whether this JAX's XLA accepts the compile options `items` ((name, value) pairs; it
    refuses unknown ones)."""
    import jax

    try:
        jax.jit(lambda x: x, compiler_options=dict(items)).lower(0).compile()
    except Exception:  # an XLA without one of them (a JaxRuntimeError of INVALID_ARGUMENT)
        return False
    return True


def unfused(x):
    """`x` unchanged, kept out of the next operation's fusion by XLA on the CPU (JAX).

    XLA's CPU compiler fuses a matrix-vector product against a transposed matrix with an
    element-wise operation after it into one naive loop: the tied logits projection
    `hidden @ embeddingsᵀ + bias` at batch 1, for a 32,000 × 512 table, took 15 ms instead of
    1.2 ms (jax 0.10.2). An optimization barrier keeps the product a library matmul. Other
    backends and devices: the identity. (TensorFlow compiles with XLA only searches of more
    than 16 rows, where the product is no matrix-vector product.)
    """
    if keras.backend.backend() == "jax" and _xla_cpu():
        import jax

        return jax.lax.optimization_barrier(x)
    return x


def keys_lead_one_query():
    """Whether a cached step's one query takes its scores as `keys · query` (the keys the
    product's left operand, `(B, H, S, d) · (B, H, d, 1)`) rather than `query · keysᵀ`: under
    XLA on the CPU, which for the latter copies each layer's whole key cache transposed at
    every step. Measured in one process, tokens equal (opus-mt-base): JAX at batch 1, 512 new
    tokens 5.27 → 4.76 s; 16 rows, 128 tokens 3.61 → 3.45 s (TensorFlow's XLA 3.07 → 2.91);
    32 tokens unchanged. TensorFlow's graph without XLA is slower that way (batch 1, 512
    tokens 10.5 → 11.8 s); PyTorch attends by its own kernel (`fuses_heads_first`)."""
    return _xla_cpu()


def fuses_projections(*layers):
    """Whether a decoding step computes the projections `layers` of one input (a
    self-attention's query, key and value `EinsumDense`) as one product against their
    concatenated kernels: inside `direct_calls()` under XLA on the CPU, when every layer runs
    its plain `call` (not quantized, variables in the compute dtype). XLA computes the
    concatenation of the loop-invariant kernels once, before the loop, and a step then reads
    one 512 × 1536 kernel instead of three 512 × 512 ones, which at one row are too small to
    reach the memory bandwidth (~75 µs each against ~125 µs for the fused product). Eager
    backends would concatenate at every step. Measured in one process, calls in turns, tokens
    equal (opus-mt-base, JAX): batch 1, 128 new tokens 1.146 → 1.044 s, 32 tokens 0.335 →
    0.303 s; 16 and 64 rows, beam search and TensorFlow's XLA at 16 rows within noise."""
    return _direct() and _xla_cpu() and all(
        layer.built and layer.quantization_mode is None
        and layer.compute_dtype == layer.variable_dtype for layer in layers)


_DIRECT = threading.local()  # .plans: None outside direct_calls(), else {layer: callable}


def _direct():
    return getattr(_DIRECT, "plans", None) is not None


def _torch_direct():
    """Eager PyTorch inside `direct_calls()`: generation owns its caches, which may then be
    written in place."""
    return _direct() and keras.backend.backend() == "torch"


@contextlib.contextmanager
def direct_calls(xla=False, transposed=None):
    """Within this scope, `call_layer` runs built layers' `call` directly (see there).

    Generation enters it around its search: the layers are built, inputs are tensors of the
    compute dtype, masks and `training` are passed explicitly, and no layer is rebuilt,
    quantized or given new variables until the scope ends (how each layer is called is
    decided once per scope). `xla`: the scope is traced by TensorFlow for XLA (`_xla_cpu`).
    `transposed`: `{layer: transposed_weight(layer)}` for layers of `transposed_weights` (JAX).
    """
    previous = (getattr(_DIRECT, "plans", None), getattr(_DIRECT, "xla", False),
                getattr(_DIRECT, "transposed", {}))
    _DIRECT.plans, _DIRECT.xla, _DIRECT.transposed = {}, xla, transposed or {}
    try:
        yield
    finally:
        _DIRECT.plans, _DIRECT.xla, _DIRECT.transposed = previous


def call_layer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)`; the layer's `call` itself inside `direct_calls()`, and for a
    plain layer under eager PyTorch (`_calls_plain_layers_directly`).

    Eager PyTorch runs Keras's `Layer.__call__` (input conversion, mask filling, name and
    autocast scopes, `training` inference) at every call: ~50 µs each, against ~36 µs for an
    `EinsumDense.call` at one token; a 6-layer decoder step makes ~120 such calls, more time
    than its matmuls at batch 1. Decoding needs none of that bookkeeping, so inside
    `direct_calls()` a built layer's `call` (`quantized_call` when quantized) runs directly. A
    layer whose variables have another dtype than its computations (mixed precision) still
    goes through `__call__`, which casts its variables. Under PyTorch a `Dense`,
    `EinsumDense`, `LayerNormalization` or reversed `ReversibleEmbedding` layer, the logits of
    a `TokenAndPositionEmbedding`, and an attention layer's decoding step, run as torch calls
    alone (`_torch_plan`). In TensorFlow's graph a tied `ReversibleEmbedding`'s logits take
    another product order (`_tf_graph_logits_plan`). Otherwise, under JAX and TensorFlow,
    this only shortens tracing.
    """
    plans = getattr(_DIRECT, "plans", None)
    if plans is None:
        if _calls_plain_layers_directly() and _plain(layer):
            return layer.call(*args, **kwargs)
        return layer(*args, **kwargs)
    run = plans.get(layer)
    if run is None:
        run = plans[layer] = _plan(layer)
    return run(*args, **kwargs)


def _calls_plain_layers_directly():
    """Whether the layers call their plain sublayers' `call` outside `direct_calls()`: under
    PyTorch, which runs Keras's `Layer.__call__` bookkeeping at every call of every sublayer
    in every step (JAX and TensorFlow only when they trace). The layers pass masks and
    `training` to their sublayers explicitly. Figures: benchmarks/README.md (`train_levers.py`)."""
    return keras.backend.backend() == "torch"


def _plain(layer):
    """Whether `layer` is built, not quantized and computes in its variables' dtype: what its
    `__call__` adds to `call` is then bookkeeping alone (no casts)."""
    return (layer.built and layer.quantization_mode is None
            and layer.compute_dtype == layer.variable_dtype)


def _plan(layer):
    """How `call_layer` calls `layer` inside `direct_calls()`."""
    if not layer.built or layer.compute_dtype != layer.variable_dtype:
        return layer
    if layer.quantization_mode is not None:
        return layer.quantized_call
    run = None
    if keras.backend.backend() == "torch":
        run = _torch_plan(layer)
    elif _tf_graph_direct():
        run = _tf_graph_logits_plan(layer)
    elif layer in _DIRECT.transposed:
        run = _transposed_plan(layer, _DIRECT.transposed[layer])
    return layer.call if run is None else run


_TRANSPOSED = weakref.WeakKeyDictionary()  # layer -> (weight, its transposed matrix)
_SMALL_KERNEL = 1024  # the widest kernel `transposed_weights` transposes for one-row products


def transposed_weights(layers, rows):
    """Those of `layers` whose products a search of `rows` rows (sources × beams) takes against
    a transposed copy of their weights (`transposed_weight`), passed into the compiled search:
    under JAX on the CPU, the products below; none elsewhere. XLA folded a transpose inside
    the compiled search back into the table's product, so each copy (as much memory as its
    weight again) is made outside it, once per weight value. Measured with jax 0.10.2 on a
    2-core AMD EPYC.

    * A tied `ReversibleEmbedding`'s logits, up to `_FEW_ROWS` rows, against a `(d_model, V)`
      copy of the table. XLA's CPU product of a few rows against the `(V, d_model)` table
      (Keras's `hidden @ tableᵀ`) is slow: 32,000 × 512, one row 2.7-2.9 ms against 1.6-1.7
      ms for a `(d_model, V)` matrix (half the memory bandwidth), 16 rows 7.9 against 6.5 ms;
      and without YNNPACK (`compiler_options`) slower still (a search of 4 rows, 32 new
      tokens, 2.3-2.7 against 0.33-0.38 s; with YNNPACK, one row 0.25-0.27 → 0.23-0.24 s, 16
      rows 1.05-1.07 → 1.00); level at 64 rows.
    * At one row, a `Dense` or `EinsumDense` product `inputs[..., in] @ kernel[in, out]`
      (`_linear_form`, plain: not quantized, variables in the compute dtype) with in ≤ out ≤
      `_SMALL_KERNEL`, against the `(out, in)` matrix: the other way round. One row times a
      512 × 512 kernel read memory at 13-15 GB/s (67-77 µs), against 21-23 GB/s (46-49 µs) for
      its transpose; 768 × 768 113-127 → 95-96 µs, 512 × 1024 112-119 → 84-94; 1024 × 1024
      level (163-198 / 175-186); 512 × 1536 level, 512 × 2048 up to 10 % slower, 1024 × 512
      and 2048 × 512 3-4× slower, and at two or more rows 5-10× slower. Generation passes a
      decoding step's attention output and cross-attention query projections (one row a step
      at batch 1; a prompt's or source's rows take the kernel): batch 1 greedy, opus-mt-base,
      six pairs of processes in turns, tokens equal, medians 32 new tokens 0.218 → 0.210 s,
      128 tokens 0.834 → 0.777 s (Zen 2). On a Zen 4 VM these one-row products were slower:
      128 tokens 1-39 % (median 12 %, 9 pairs), XLA's loop over an `(out, in)` 512 × 512
      kernel taking ~90 µs in the search against 36-47 µs alone; not yet explained.
    """
    if not _few_rows_under_jax_on_the_cpu(rows):
        return []
    return [layer for layer in layers if layer.built and layer.quantization_mode is None
            and layer.compute_dtype == layer.variable_dtype
            and (_tied_logits(layer) or (rows == 1 and _small_kernel(layer)))]


def _tied_logits(layer):
    """Whether `layer` is a tied `ReversibleEmbedding` whose logits are a product alone."""
    return (type(layer) is keras.layers.ReversibleEmbedding and layer.tie_weights
            and _plain_reverse(layer))


def _small_kernel(layer):
    """Whether `layer` is a product `inputs[..., in] @ kernel[in, out]` with in ≤ out ≤
    `_SMALL_KERNEL` (`transposed_weights`)."""
    if _linear_form(layer) is None:
        return False
    width, out = _matrix_shape(layer)
    return width <= out <= _SMALL_KERNEL


def _matrix_shape(layer):
    """`(in, out)`: a `_linear_form` layer's kernel `(in…, out…)` as the matrix it multiplies."""
    contracted = _linear_form(layer)
    return (math.prod(layer.kernel.shape[:contracted]),
            math.prod(layer.kernel.shape[contracted:]))


def transposed_weight(layer):
    """The transposed matrix of one of `transposed_weights`: a tied table `(V, d)` as `(d, V)`,
    a kernel `(in…, out…)` as `(out, in)`. Made again only when the weight's value is another
    array (JAX arrays are immutable: an update assigns a new one)."""
    table = type(layer) is keras.layers.ReversibleEmbedding
    weight = layer.embeddings.value if table else layer.kernel.value
    cached = _TRANSPOSED.get(layer)
    if cached is None or cached[0] is not weight:
        matrix = weight if table else ops.reshape(weight, _matrix_shape(layer))
        cached = _TRANSPOSED[layer] = (weight, ops.transpose(matrix))
    return cached[1]


def _transposed_plan(layer, transposed):
    """`layer`'s call with its product against `transposed` (`transposed_weights`): a tied
    table's logits `hidden @ transposed`; a one-row kernel product `inputs @ transposedᵀ`
    (more rows, or other arguments, take the layer's `call`), kept out of a fusion with the
    bias (`unfused`: XLA fused them into one naive loop, batch 1 32 tokens 0.21 → 0.27 s)."""
    if type(layer) is keras.layers.ReversibleEmbedding:
        def logits(inputs, reverse=False):
            return ops.matmul(inputs, transposed) if reverse else layer.call(inputs)

        return logits
    contracted = _linear_form(layer)
    tail = tuple(layer.kernel.shape[contracted:])

    def run(inputs, **kwargs):
        lead = tuple(inputs.shape[:len(inputs.shape) - contracted])
        if set(kwargs) - {"training"} or math.prod(lead) != 1:
            return layer.call(inputs, **kwargs)
        rows = ops.reshape(inputs, (1, transposed.shape[1]))
        output = ops.reshape(unfused(ops.matmul(rows, ops.transpose(transposed))), lead + tail)
        if layer.bias is not None:
            output = ops.add(output, layer.bias)
        return output if layer.activation is None else layer.activation(output)

    return run


def _tf_graph_logits_plan(layer):
    """In TensorFlow's graph (generation below `_XLA_ROWS` rows), a tied
    `ReversibleEmbedding`'s logits as `(table · hiddenᵀ)ᵀ`, or None for other layers.

    Keras computes `hidden @ tableᵀ`: TensorFlow's `MatMul` against the transposed 32,000 ×
    512 table took 70-90 ms for 2 to 7 rows, against 3 ms for one row and 26 ms for eight
    (Eigen's product on the 2-core development machine, TensorFlow 2.21). The table as the left
    operand takes 3-9 ms for 1 to 16 rows, and the transpose of the `(V, rows)` result is
    small. Measured in generation (opus-mt-base, 32 new tokens, warm, in one process, in
    turns): 2 rows 3.58 → 0.88 s, one source with beam 4 3.66 → 0.99 s, one row 0.553 → 0.550
    s; tokens equal.
    """
    if not _tied_logits(layer):
        return None
    import tensorflow as tf

    def run(inputs, reverse=False):
        if not reverse:
            return layer.call(inputs)
        table = layer.embeddings.value
        rows = tf.reshape(inputs, (-1, inputs.shape[-1]))
        logits = tf.transpose(tf.linalg.matmul(table, rows, transpose_b=True))
        return tf.reshape(logits, tf.concat([tf.shape(inputs)[:-1], tf.shape(table)[:1]], 0))

    return run


def _alike(layers):
    """Whether `layers` are one layer repeated: one class, one config but the name, and
    variables of the same names, shapes and dtypes in the same order."""
    def signature(layer):
        config = dict(layer.get_config(), name=None)
        return type(layer), config, [(v.name, tuple(v.shape), v.dtype) for v in layer.variables]

    first = signature(layers[0])
    return all(signature(layer) == first for layer in layers[1:])


def repeated_layer_caller(layers):
    """A function `call(i, *args, **kwargs)` that is `call_layer(layers[i], *args, **kwargs)`.

    When TensorFlow traces generation's search (inside `direct_calls()`) and `layers` are
    alike (a stack of encoder or decoder blocks), every layer runs through one `tf.function`,
    traced at the first call, into which each layer passes its own variables (a
    `StatelessScope`): the search's graph holds one copy of the layer's operations instead of
    one per layer. Building a graph costs TensorFlow ~0.4 ms per operation, and a search
    traced every block of the encoder and of the decoder's step: opus-mt-base, 16 rows, 3,409
    → 1,475 operations, trace 0.9 → 0.6 s. (The conversion to XLA, ~2.2 s, is unchanged:
    TensorFlow's bridge inlines the function.) JAX's tracing is cheaper and PyTorch traces
    nothing: there, and for layers that differ, each layer is called as it is. Create the
    caller inside the traced function, so that its `tf.function` is never reused by another
    trace.
    """
    if not (_direct() and keras.backend.backend() == "tensorflow" and len(layers) > 1
            and _alike(layers)):
        return lambda i, *args, **kwargs: call_layer(layers[i], *args, **kwargs)
    import tensorflow as tf

    template = layers[0]

    def run(values, *args, **kwargs):
        with keras.StatelessScope(state_mapping=list(zip(template.variables, values))):
            return call_layer(template, *args, **kwargs)

    shared = tf.function(run, autograph=False)
    return lambda i, *args, **kwargs: shared(
        [v.value for v in layers[i].variables], *args, **kwargs)


def dot_product_attention(query, key, value, mask, scale, heads_first=False, causal=False):
    """`keras.ops.dot_product_attention` of queries `(B, T, H, d)` and keys and values
    `(B, S, H, d)` (`(B, H, S, d)` with `heads_first`, under PyTorch only: see
    `fuses_heads_first`), with a boolean mask broadcasting to `(B, H, T, S)` or, with `causal`
    (and `T == S`), the kernel's own causal masking.

    PyTorch takes another route to the same numbers: torch's `scaled_dot_product_attention`
    on `(B, H, ·, d)` views. Keras's torch version copies the keys and values into new
    contiguous tensors first, which in cached decoding is the whole cache at every step (2×
    the attention's time at 64 rows × 32 positions); torch's kernel takes strided views as
    they are.
    """
    if keras.backend.backend() == "torch":
        query, key, value = (ops.convert_to_tensor(x) for x in (query, key, value))
        mask = None if mask is None else ops.convert_to_tensor(mask, "bool")
        if not heads_first:
            key, value = key.transpose(1, 2), value.transpose(1, 2)
        return _torch_attention(query, key, value, mask, scale, causal=causal)
    return ops.dot_product_attention(query, key, value, mask=mask, scale=scale, is_causal=causal)


def _torch_attention(query, key, value, mask, scale, groups=1, causal=False):
    """torch's `scaled_dot_product_attention` of torch queries `(B, T, H, d)` over keys and
    values `(B, H / groups, S, d)` (`groups` query heads per key/value head, as `ops.repeat`
    along the heads would give them); the output `(B, T, H, d)`."""
    import torch

    grouped = {"enable_gqa": True} if groups > 1 else {}  # (an argument since torch 2.5)
    output = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), key, value, attn_mask=mask, scale=scale, is_causal=causal,
        **grouped)
    return output.transpose(1, 2)


def fuses_heads_first():
    """Whether `dot_product_attention` takes keys and values heads first, `(B, H, S, d)` (the
    key/value caches' layout): under PyTorch, whose kernel reads that layout. Keras's fused
    attention under JAX and TensorFlow takes `(B, S, H, d)` and transposes the keys and
    values first — in cached decoding the whole cache, at every step — so there the cached
    layers attend by the explicit path's two products, which read `(B, H, S, d)` as it lies
    (a batched product over `(B, H)`). Measured with XLA on the CPU, 6 layers of 8 heads ×
    64, a step's attention alone: at one row 76 → 27 µs over 33 cached positions, 618 →
    94 µs over 129; at 16 rows 0.97 → 0.51 ms and 10.5 → 2.2 ms.
    """
    return keras.backend.backend() == "torch"


_POSITIONS = -2  # the position axis of a cache: (B, 2, H, L, d) or a pair of (B, H, L, d)


def splits_caches(batch_size):
    """Whether generation holds each self-attention cache as a `(keys, values)` pair of
    `(B, H, L, d)` arrays rather than one stacked `(B, 2, H, L, d)` array: everywhere but under
    XLA on the CPU at one row. Under XLA a slice of the stacked array is a copy, made by every
    layer at every step (see `attention.cache_keys_values`); but at one row XLA computes a
    pair's cache write twice (for the next step, and for the attention's product, which reads
    the cache without its unit batch axis) and copies each cache about four times a step (JAX,
    batch 1, 128 new tokens: 0.93-0.95 s stacked, 1.03 s split)."""
    return not (_xla_cpu() and batch_size == 1)


def slice_update(inputs, start_indices, updates):
    """`ops.slice_update(inputs, start_indices, updates)`: `inputs` with `updates` written from
    `start_indices` (one index per axis).

    In TensorFlow's graph without XLA inside `direct_calls()` (generation below `_XLA_ROWS`
    rows), TensorFlow's own strided-slice update, which writes into its input's buffer when
    nothing else reads that input (TensorFlow checks) and copies it otherwise. Keras's
    TensorFlow `slice_update` is tf2xla's `XlaDynamicUpdateSlice`, which outside XLA runs as a
    one-operation XLA program: ~0.25 ms a call, 7 calls a decoding step (6 layers' caches and
    the tokens). Measured in one process, batch 1, calls in turns, same tokens: 32 new tokens
    0.705 → 0.643 s, 128 tokens 2.77 → 2.58 s.
    """
    if not _tf_graph_direct():
        return ops.slice_update(inputs, start_indices, updates)
    import tensorflow as tf

    begin = tf.stack([tf.cast(i, "int32") for i in start_indices])
    return tf.raw_ops.TensorStridedSliceUpdate(
        input=inputs, begin=begin, end=begin + tf.shape(updates),
        strides=tf.ones_like(begin), value=tf.cast(updates, inputs.dtype))


def suppress_token(logits, token_id, bias_row):
    """`logits (B, V) + bias_row (V,)`, where `bias_row` is 0 except at `token_id`: the logits
    with that one token's changed.

    Under PyTorch inside `direct_calls()` (generation, which owns its logits and reads them
    only after this) the one column is added to in place, the same numbers: the add over the
    whole array reads and writes it, 2.9 ms a step at 64 rows × 32,000 in a search (8 MB
    arrays, memory-bound), the column 64 numbers. XLA fuses the add into the reduction after
    it.
    """
    if _torch_direct():
        logits.select(-1, token_id).add_(bias_row[token_id])
        return logits
    return logits + ops.cast(bias_row, logits.dtype)


def update_cache(cache, index, update):
    """`cache` (`(B, 2, H, L, d)`, or keys or values `(B, H, L, d)`) with `update` (`(B, 2, H,
    T, d)` or `(B, H, T, d)`) written at `index` along the position axis.

    `slice_update`, except under PyTorch inside `direct_calls()` (generation, which owns its
    caches and never reads an old one again): there the cache is written in place, as Keras's
    torch `slice_update` clones the whole cache at every decoding step.
    """
    if _torch_direct():
        cache.narrow(_POSITIONS, index, update.shape[_POSITIONS]).copy_(update)
        return cache
    zero = ops.zeros((), "int32")
    return slice_update(cache, (zero,) * (len(cache.shape) - 2) + (index, zero), update)


_PACKED = weakref.WeakKeyDictionary()  # layer -> (source tensor, its version, packed kernel)


@functools.lru_cache(maxsize=None)
def _one_dnn():
    """Whether torch's oneDNN linear kernels are there (`_linear_pointwise` is what
    `torch.compile` calls for a linear layer on the CPU)."""
    import torch

    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packed_kernel(layer, kernel, source):
    """`kernel` `(in, out)` packed for torch's oneDNN linear kernel, or None where that does not
    apply (not float32, not on the CPU, autograd on, no oneDNN).

    On the development machine's CPU (AMD EPYC, 2 cores, torch 2.13.0's MKL build) torch's
    float32 matrix products (MKL; `torch.nn.Linear` and transformers use them) ran 2-3× slower
    than oneDNN's against a packed weight: a decoder step's products (6 layers of opus-mt-base
    and the 32,000-row tied logits projection, weights cold in cache) 9.2 → 4.5 ms at one
    row, 15.1 → 5.3 ms at 16, 31.9 → 12.7 ms at 64. The packed copy (as much memory again) is
    made once per layer and remade when `source` (the variable's tensor `kernel` is a view of)
    is another tensor or was updated in place (torch's version counter: `Variable.assign` and
    optimizers count; an edit through `tensor.data` does not).
    """
    import torch

    if (kernel.dtype != torch.float32 or kernel.device.type != "cpu"
            or torch.is_grad_enabled() or not _one_dnn()):
        return None
    cached = _PACKED.get(layer)  # (source, its version then, packed)
    if cached is None or cached[0] is not source or cached[1] != source._version:
        cached = _PACKED[layer] = (source, source._version,
                                   torch.ops.mkldnn._reorder_linear_weight(kernel.detach().T))
    return cached[2]


def _torch_product(layer, inputs, kernel, bias=None, source=None):
    """`inputs[..., in] @ kernel[in, out] + bias` in torch: oneDNN's kernel against the packed
    kernel (`_packed_kernel`; `source`: the tensor `kernel` views, itself by default) for
    float32 inputs, else a matrix product."""
    import torch

    source = kernel if source is None else source
    packed = _packed_kernel(layer, kernel, source) if inputs.dtype == torch.float32 else None
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(inputs, packed, bias, "none", [], "")
    output = torch.matmul(inputs, kernel)
    return output if bias is None else output + bias


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
    first n (parsed once per equation)."""
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    n = sum(letter in inputs for letter in kernel)
    if kernel[:n] == inputs[-n:] and output == inputs[:-n] + kernel[n:]:
        return n
    return None


def _torch_plan(layer):
    """A torch-only `call` for the layers a decoding step calls most, or None. Each skips
    ~40 µs of Keras ops' Python (`convert_to_tensor`, dtype checks) at one token, against
    ~15 µs for a product itself:

    * `Dense`/`EinsumDense` of the form `inputs[..., in] @ kernel[in, out...] + bias`: the
      product by `_torch_product` (oneDNN's kernel where it applies);
    * `ReversibleEmbedding(reverse=True)` (the logits projection) the same way, and
      `TokenAndPositionEmbedding(reverse=True)` with its logits bias in the same product;
    * `LayerNormalization` over the last axis: one `torch.nn.functional.layer_norm`, the
      kernel Keras's `ops.layer_normalization` calls, in float32 at least as Keras computes;
    * `MultiHeadSelfAttention` and `CrossAttention`: a decoding step (one query over the
      caches) without the Keras ops between the projections and the attention.
    Variables are read as torch tensors once per `direct_calls()` scope (in-place updates are
    seen); the products of a layer off the CPU, where they were measured, keep `call`.
    """
    from keras_tfm.attention import CrossAttention, MultiHeadSelfAttention
    from keras_tfm.embedding import TokenAndPositionEmbedding

    kind = type(layer)
    if kind in (keras.layers.Dense, keras.layers.EinsumDense):
        return _torch_linear_plan(layer)
    if kind is keras.layers.ReversibleEmbedding:
        return _torch_reverse_plan(layer)
    if kind is TokenAndPositionEmbedding:
        return _torch_logits_plan(layer)
    if kind is keras.layers.LayerNormalization:
        return _torch_layer_norm_plan(layer)
    if kind is MultiHeadSelfAttention:
        return _torch_self_attention_plan(layer)
    if kind is CrossAttention:
        return _torch_cross_attention_plan(layer)
    return None


def _torch_linear_plan(layer):
    contracted = _linear_form(layer)
    kernel = None if contracted is None else layer.kernel.value
    if kernel is None or kernel.device.type != "cpu":
        return None
    width, tail = math.prod(kernel.shape[:contracted]), tuple(kernel.shape[contracted:])
    matrix = kernel.reshape(width, -1)
    bias = None if layer.bias is None else layer.bias.value.reshape(-1)
    activation = layer.activation

    def run(inputs, **kwargs):
        if kwargs:
            return layer.call(inputs, **kwargs)
        lead = inputs.shape[:inputs.dim() - contracted]
        output = _torch_product(layer, inputs.reshape(*lead, width), matrix, bias, kernel)
        output = output.reshape(*lead, *tail)
        return output if activation is None else activation(output)

    return run


def _plain_reverse(layer):
    """Whether a `ReversibleEmbedding`'s reverse call is the product `hidden @ kernel` alone:
    no LoRA, no reverse dtype, no soft cap (a fast path may then take the product its way)."""
    return not (getattr(layer, "lora_enabled", False) or layer.reverse_dtype is not None
                or layer.logit_soft_cap is not None)


def _torch_reverse_kernel(layer):
    """The `(kernel, source)` of a `ReversibleEmbedding`'s reverse product for
    `_torch_product`, or None where its `call` must run (not `_plain_reverse`, or a device
    other than the CPU)."""
    if not _plain_reverse(layer) or layer.embeddings.value.device.type != "cpu":
        return None
    source = layer.embeddings.value if layer.tie_weights else layer.reverse_embeddings.value
    return (source.T if layer.tie_weights else source), source


def _torch_reverse_plan(layer):
    parts = _torch_reverse_kernel(layer)
    if parts is None:
        return None
    kernel, source = parts

    def run(inputs, reverse=False):
        if not reverse:
            return layer.call(inputs)
        return _torch_product(layer, inputs, kernel, source=source)

    return run


def _torch_logits_plan(layer):
    """`TokenAndPositionEmbedding(reverse=True)` with `reverse_bias` (MarianMT's logits): the
    bias added by the product's kernel, not by a second pass over the `(B, vocab)` logits
    (2.9 ms a step at 64 rows × 32,000, memory-bound; the product alone is 14 ms)."""
    inner = layer.token_embedding
    if (not layer.reverse_bias or inner.quantization_mode is not None
            or inner.compute_dtype != inner.variable_dtype):
        return None
    parts = _torch_reverse_kernel(inner)
    if parts is None:
        return None
    kernel, source = parts
    bias = layer.logits_bias.value

    def run(inputs, reverse=False, **kwargs):
        if not reverse:
            return layer.call(inputs, **kwargs)
        return _torch_product(inner, inputs, kernel, bias, source)

    return run


def _torch_layer_norm_plan(layer):
    axes = (layer.axis,) if isinstance(layer.axis, int) else tuple(layer.axis)
    if layer.rms_scaling or len(axes) != 1:
        return None
    import torch

    gamma = None if layer.gamma is None else layer.gamma.value
    beta = None if layer.beta is None else layer.beta.value
    epsilon, axis = layer.epsilon, axes[0]

    def run(inputs):
        if axis not in (-1, inputs.dim() - 1):
            return layer.call(inputs)
        dtype = torch.promote_types(inputs.dtype, torch.float32)
        output = torch.nn.functional.layer_norm(
            inputs.to(dtype), inputs.shape[-1:], None if gamma is None else gamma.to(dtype),
            None if beta is None else beta.to(dtype), epsilon)
        return output.to(inputs.dtype)

    return run


def _attention_dropout_active(layer, training):
    return bool(training) and layer.dropout > 0


def _torch_self_attention_plan(layer):
    """A decoding step of a causal `MultiHeadSelfAttention` with a cache: one query, no
    `attention_mask`, no weights returned, no active dropout (anything else: `call`). The
    step's keys and values are written into the cache in place, and the query attends to its
    filled positions, all of which it sees, by `_torch_attention`; the projections (and
    rotary positions) go through `call_layer`. The same steps as `call` without the Keras ops
    between them: at one row of opus-mt-base's shape, 0.55 → 0.26 ms a call."""
    from keras_tfm.attention import cache_keys_values

    if not layer.causal or layer._value_dim != layer._key_dim:
        return None
    scale, groups = 1.0 / math.sqrt(layer._key_dim), layer.num_heads // layer._kv_heads

    def run(inputs, attention_mask=None, training=None, return_attention_scores=False,
            cache=None, cache_update_index=None, mask=None):
        if (cache is None or cache_update_index is None or attention_mask is not None
                or return_attention_scores or inputs.shape[1] != 1
                or _attention_dropout_active(layer, training)):
            return layer.call(inputs, attention_mask=attention_mask, training=training,
                              return_attention_scores=return_attention_scores, cache=cache,
                              cache_update_index=cache_update_index, mask=mask)
        index = int(cache_update_index)
        keys, values = layer._project_context(inputs, start_index=cache_update_index)
        key_cache, value_cache = cache_keys_values(cache)  # (B, H, L, d): views, if stacked
        key_cache[:, :, index] = keys[:, 0]  # (B, H, d) each
        value_cache[:, :, index] = values[:, 0]
        queries = layer._rotate(call_layer(layer.query_dense, inputs), cache_update_index)
        output = _torch_attention(queries, key_cache.narrow(_POSITIONS, 0, index + 1),
                                  value_cache.narrow(_POSITIONS, 0, index + 1), None, scale,
                                  groups)
        return call_layer(layer.output_dense, output), cache

    return run


def _torch_cross_attention_plan(layer):
    """A decoding step of `CrossAttention` over a `context_cache`: no `attention_mask`, no
    weights returned, no active dropout (anything else: `call`). The padding mask is prepared
    by the attention module's own rules once per `context_mask` tensor, cache shape and
    in-place version of the mask (a search passes the same ones at every step), and the rows
    of sources with no key are zeroed only when there are any; the attention runs by
    `_torch_attention`, the projections through `call_layer`. At one row of opus-mt-base's
    shape, 0.41 → 0.14 ms a call."""
    from keras_tfm import masks as masks_lib
    from keras_tfm.attention import (cache_keys_values, fold_query_rows, open_empty_rows,
                                     unfold_query_rows, zero_empty_rows)

    scale, groups = 1.0 / math.sqrt(layer._key_dim), layer.num_heads // layer._kv_heads
    prepared = [None, None, None, None]  # the context mask, its key, attention mask, rows to zero

    def run(query, context=None, attention_mask=None, training=None,
            return_attention_scores=False, context_cache=None, query_mask=None,
            context_mask=None):
        if (context_cache is None or attention_mask is not None or return_attention_scores
                or _attention_dropout_active(layer, training)):
            return layer.call(query, context, attention_mask=attention_mask, training=training,
                              return_attention_scores=return_attention_scores,
                              context_cache=context_cache, query_mask=query_mask,
                              context_mask=context_mask)
        keys, values = cache_keys_values(context_cache)  # (B, H, S, d)
        folded, _ = fold_query_rows(query, keys)  # (B, m·T, D): m query rows a cache row
        key = (tuple(keys.shape), tuple(folded.shape), getattr(context_mask, "_version", None))
        if context_mask is None or prepared[0] is not context_mask or prepared[1] != key:
            merged = masks_lib.merge_masks(folded, keys[:, 0], key_padding_mask=context_mask)
            mask, row_has_key = (None, None) if merged is None else open_empty_rows(merged)
            empty = row_has_key is not None and not bool(row_has_key.all())
            prepared[:] = context_mask, key, mask, row_has_key if empty else None
        queries = call_layer(layer.query_dense, folded)
        output = _torch_attention(queries, keys, values, prepared[2], scale, groups)
        if prepared[3] is not None:
            output = zero_empty_rows(output, prepared[3])
        return unfold_query_rows(call_layer(layer.output_dense, output), query)

    return run


_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.lru_cache(maxsize=None)
def keep_freed_memory():
    """Ask glibc's `malloc` to keep freed memory for reuse in this process (once; True if it
    agreed). PyTorch generation calls it.

    Eager PyTorch allocates each step's large arrays afresh (the `(B, vocab)` logits and their
    log-sum-exp: 8 MB each at 64 rows × 32,000), and with glibc's defaults a freed block that
    large goes back to the system (an `mmap` per allocation, or the heap's top trimmed) and is
    page-faulted in again at the next step: 387,000 minor faults in one beam search of 16
    sources × 4 beams (opus-mt-base, 32 tokens), 1.42 s, against 5 faults and 1.15 s with
    blocks up to 32 MB kept on the heap and the heap trimmed only beyond 1 GB free (greedy, 64
    rows: 1.69 → 1.15 s; transformers, JAX and TensorFlow, which allocate otherwise,
    unchanged). The cost: the process keeps up to 1 GB of freed heap. Left alone when
    `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` is set (the user's choice) and on a
    C library other than glibc.
    """
    import ctypes
    import os
    import platform

    if any(name in os.environ for name in _MALLOC_ENV) or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters (malloc.h)
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)
                and libc.mallopt(m_trim_threshold, 1 << 30))


def _tf_graph_direct():
    """TensorFlow's graph without XLA inside `direct_calls()` (generation below `_XLA_ROWS`
    rows), where a slice may have a length known only at run time."""
    return (_direct() and keras.backend.backend() == "tensorflow"
            and not getattr(_DIRECT, "xla", False))


def attends_filled_only():
    """Whether `filled_part` returns the filled positions alone (eager PyTorch or
    TensorFlow's graph in `direct_calls()`); otherwise the whole cache, which the causal mask
    must cut."""
    return _torch_direct() or _tf_graph_direct()


def filled_part(cache, length):
    """The part `(B, H, L', d)` of a key or value cache `(B, H, L, d)` that attention reads.

    Under PyTorch inside `direct_calls()` (generation, which passes no `attention_mask`), a
    view of the first `length` (filled) positions, as transformers' growing cache attends to;
    in TensorFlow's graph there, a slice of them (its length known at run time; batch 1, 128
    new tokens 2.84 -> 2.74 s, 32 unchanged); otherwise the whole cache, whose unfilled
    positions the causal mask excludes (XLA needs static shapes). (On a GPU, `int(length)`
    waits for the device once a layer and step.)
    """
    if _torch_direct():
        return cache.narrow(_POSITIONS, 0, int(length))
    if _tf_graph_direct():
        return cache[:, :, :length]
    return cache


def reorder_beams(caches, parent, length):
    """`caches` (a list of key/value pairs) with each cache's rows those of each kept beam's
    parent (`ops.take(cache, parent, axis=0)`).

    Under PyTorch inside `direct_calls()`, only the first `length` (filled) positions of the
    rows whose parent is another row are gathered, in place: a beam step otherwise copies every
    layer's whole cache. Those rows are found once for all caches, and on the CPU only (it
    reads `parent` on the host: a device sync a step on an accelerator, where the copy is cheap).
    """
    if not _torch_direct():
        return keras.tree.map_structure(lambda cache: ops.take(cache, parent, axis=0), caches)
    import torch

    rows, sources = None, parent
    if parent.device.type == "cpu":
        rows = torch.nonzero(parent != torch.arange(parent.shape[0])).flatten()
        sources = parent[rows]
    for cache in keras.tree.flatten(caches):
        filled = cache.narrow(_POSITIONS, 0, int(length))
        if rows is None:
            filled.copy_(filled.index_select(0, sources))
        elif rows.numel():
            filled.index_copy_(0, rows, filled.index_select(0, sources))
    return caches


_CHUNK = 128  # row positions per chunk of the two-stage reductions (`_chunks`)


def _chunks(x):
    """`x (B, V)` as `(B, n, _CHUNK)` chunks of consecutive positions (-inf fills the last)."""
    rows, size = ops.shape(x)
    n = -(-size // _CHUNK)
    if n * _CHUNK != size:
        x = ops.pad(x, ((0, 0), (0, n * _CHUNK - size)), constant_values=float("-inf"))
    return ops.reshape(x, (rows, n, _CHUNK))


def _gather_chunks(chunks, which):
    """The chunks `which (B, m)` of each row, `(B, m * _CHUNK)`."""
    picked = ops.take_along_axis(chunks, which[:, :, None], axis=1)
    return ops.reshape(picked, (ops.shape(which)[0], -1))


def _chunk_positions(which, position):
    """Row positions of positions in `_gather_chunks(chunks, which)`."""
    return ops.take_along_axis(which, position // _CHUNK, axis=1) * _CHUNK + position % _CHUNK


def argmax(x):
    """`ops.argmax(x, axis=-1)` as int32: the first index of each row's largest value.

    Under XLA on the CPU (`_xla_cpu`), in two stages over chunks of 128 positions (`top_k`
    says why): the first chunk holding the row's maximum, then the first position in it.
    XLA's CPU argmax (a reduction over value-index pairs) took 4.7 ms on `(64, 32000)` logits,
    a row maximum and then the smallest index holding it 1.0 ms, these two stages 0.29 ms (jax
    0.10.2). A row with NaN gives its first NaN's index, as `ops.argmax` under JAX.
    """
    if not _xla_cpu():
        return ops.cast(ops.argmax(x, axis=-1), "int32")
    chunks = _chunks(x)
    which = ops.cast(ops.argmax(ops.max(chunks, axis=-1), axis=-1), "int32")[:, None]
    inside = ops.cast(ops.argmax(_gather_chunks(chunks, which), axis=-1), "int32")[:, None]
    return _chunk_positions(which, inside)[:, 0]


def top_k(x, k):
    """`ops.top_k(x, k)` over the last axis of `x (B, V)`: the k largest values of each row,
    largest first, and their int32 indices.

    Under XLA on the CPU (`_xla_cpu`), exactly the same (equal values: the lower index
    first) in two stages: each chunk of 128 positions is reduced to its maximum, the k chunks
    with the largest maxima are taken (every one of the k largest values lies in one of them:
    a value outside them is outranked by those k maxima) in position order, and the top k of
    their `k * 128` values picked. XLA's CPU TopK took 2.3 ms on `(64, 32000)` logits with
    k = 8, the two stages 0.36 ms (jax 0.10.2); a beam search step at 64 rows takes one.
    """
    if not _xla_cpu() or ops.shape(x)[-1] <= k * _CHUNK:  # (one stage is enough)
        values, indices = ops.top_k(x, k)
        return values, ops.cast(indices, "int32")
    chunks = _chunks(x)
    _, which = ops.top_k(ops.max(chunks, axis=-1), k)
    which = ops.sort(ops.cast(which, "int32"), axis=-1)
    values, position = ops.top_k(_gather_chunks(chunks, which), k)
    return values, _chunk_positions(which, ops.cast(position, "int32"))
