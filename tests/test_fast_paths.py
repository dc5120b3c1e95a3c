"""The backend fast paths of decoding (keras_tfm/_backend.py) give the plain path's results.

Generation runs its layers' `call` directly (`direct_calls`), and inside it PyTorch writes and
reorders caches in place, attends to the filled part of the cache only and runs Dense /
EinsumDense / LayerNormalization layers, the logits projection and its bias (oneDNN products
against packed kernels) and the attention layers' decoding steps as torch calls alone, removes
the padding token from a step's logits in place, and keeps freed memory;
JAX takes its own argmax and top-k, and in searches of a few rows on the CPU the tied logits
(and at one row a step's small attention projections) against transposed copies of the
weights; under XLA on the CPU a self-attention step projects its queries, keys and values by
one product; TensorFlow traces alike blocks once and, in its graph,
takes a tied table's logits as `(table · hiddenᵀ)ᵀ`; beams share their source's
cross-attention cache row. Each test compares
against the plain path (every layer through Keras's `__call__`, functional cache updates) or
NumPy.
"""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops

from helpers import BACKEND, np_softmax, to_np
from keras_tfm import (CrossAttention, MultiHeadSelfAttention, TokenAndPositionEmbedding,
                       TransformerEncoderBlock, build_language_model, build_transformer,
                       generate)
from keras_tfm import _backend, generation
from keras_tfm.attention import cache_keys_values


def marian_like(tied=True, **kwargs):
    """Shared embeddings, start id = pad id; tied with a logits bias (the opus-mt layout), or
    a separate logits layer (random tied weights decode one repeated token)."""
    model = build_transformer(40, 40, d_model=32, num_heads=4, ff_dim=64, num_encoder_layers=2,
                              num_decoder_layers=2, dropout=0.0, share_embeddings=True,
                              tie_embeddings=tied, logits_bias=tied, activation="swish",
                              pad_id=39, start_id=39, end_id=0, **kwargs)
    rng = np.random.default_rng(0)
    for weight in model.weights:  # std 0.1 (norms kept): varied tokens, few ties
        if "norm" not in weight.path:
            weight.assign(rng.normal(0.0, 0.1, weight.shape).astype(weight.dtype))
    return model


def sources(batch=9, seed=1):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 39, (batch, 7)).astype("int32")
    if batch > 3:
        src[1, 4:] = 39  # padded rows
        src[3, 2:] = 39
    return src


@contextlib.contextmanager
def plain_path(monkeypatch, model):
    """Generation with every layer through `Layer.__call__` (no fast path; under
    TensorFlow's XLA, one-stage top-k and argmax), freshly compiled."""
    generation._COMPILED.pop(model, None)
    with monkeypatch.context() as patch:
        patch.setattr(generation, "direct_calls", lambda **kwargs: contextlib.nullcontext())
        yield
    generation._COMPILED.pop(model, None)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("batch", [1, 17])  # TensorFlow: its graph, and XLA from 17 rows
def test_seq2seq_search_equals_the_plain_path(monkeypatch, batch, tied):
    model = marian_like(tied)
    src = sources(batch)
    cases = [dict(method="greedy"), dict(method="beam", beam_size=3),
             dict(method="sample", temperature=0.7, top_k=5, seed=3)]
    fast = [generate(model, src, max_length=8, return_scores=True, **case) for case in cases]
    with plain_path(monkeypatch, model):
        plain = [generate(model, src, max_length=8, return_scores=True, **case)
                 for case in cases]
    for case, (tokens, scores), (expected, expected_scores) in zip(cases, fast, plain):
        np.testing.assert_array_equal(tokens, expected, err_msg=str(case))
        np.testing.assert_allclose(scores, expected_scores, atol=1e-4, err_msg=str(case))
    if not tied and batch > 1:  # the comparison can fail: rows and tokens vary
        assert len({tuple(row) for row in fast[0][0]}) > 1
        assert len(set(fast[0][0][0].tolist())) > 1


def test_language_model_search_equals_the_plain_path(monkeypatch):
    lm = build_language_model(40, d_model=32, num_heads=4, ff_dim=64, num_layers=2,
                              num_key_value_heads=2, dropout=0.0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3]] * 5  # 20 rows (TensorFlow's XLA)
    cases = [dict(method="greedy"), dict(method="sample", top_p=0.9, seed=4)]
    fast = [generate(lm, prompts, max_length=6, end_id=None, **case) for case in cases]
    with plain_path(monkeypatch, lm):
        plain = [generate(lm, prompts, max_length=6, end_id=None, **case) for case in cases]
    for case, tokens, expected in zip(cases, fast, plain):
        np.testing.assert_array_equal(tokens, expected, err_msg=str(case))


@pytest.mark.parametrize("tied", [True, False])
def test_decoding_sees_weights_changed_in_place(monkeypatch, tied):
    """torch keeps packed copies of the kernels (oneDNN's layout): a weight update remakes them."""
    model = marian_like(tied=tied)
    src = sources(9)
    _, before = generate(model, src, max_length=4, end_id=None, return_scores=True)
    for weight in model.weights:  # kernels and embeddings (packed under torch) change in place
        if weight.path.endswith(("kernel", "embeddings")):
            weight.assign(ops.convert_to_tensor(to_np(weight) * 1.5))
    tokens, scores = generate(model, src, max_length=4, end_id=None, return_scores=True)
    with plain_path(monkeypatch, model):
        expected, expected_scores = generate(model, src, max_length=4, end_id=None,
                                             return_scores=True)
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_allclose(scores, expected_scores, atol=1e-4)
    assert np.abs(scores - before).max() > 1e-2


def test_the_cache_is_updated_in_place_only_inside_generation():
    layer = MultiHeadSelfAttention(num_heads=2, causal=True)
    x = keras.random.normal((2, 1, 8), seed=1)
    layer(x)
    cache = ops.zeros((2, 2, 2, 4, 4))
    out, new = layer(x, cache=cache, cache_update_index=1)
    assert float(ops.max(ops.abs(cache))) == 0.0  # the caller's cache is left as it was
    assert float(ops.max(ops.abs(new[:, :, :, 1]))) > 0.0
    with _backend.direct_calls():
        direct_out, direct_new = _backend.call_layer(layer, x, cache=ops.zeros((2, 2, 2, 4, 4)),
                                                     cache_update_index=1)
    np.testing.assert_allclose(to_np(direct_out), to_np(out), atol=1e-6)
    np.testing.assert_allclose(to_np(direct_new), to_np(new), atol=1e-6)


@pytest.mark.parametrize("graph", [False, True] if BACKEND == "tensorflow" else [False])
def test_slice_update_helper_equals_keras_and_leaves_its_input(graph):
    """`_backend.slice_update` inside `direct_calls()` (under TensorFlow's graph, its own
    strided-slice update, which may write into a buffer nothing else reads) gives
    `ops.slice_update`'s result, and an input the caller still holds is left as it was."""
    x = np.arange(2 * 3 * 7, dtype="float32").reshape(2, 3, 7)
    update = -np.ones((2, 2, 3), "float32")

    def both(inputs, index):
        with _backend.direct_calls():
            helper = _backend.slice_update(inputs, (0, 1, index), update)
        return helper, ops.slice_update(inputs, (0, 1, index), update)

    if graph:
        import tensorflow as tf

        both = tf.function(both, autograph=False)
    inputs = ops.convert_to_tensor(x)
    for index in (0, 4):
        helper, expected = both(inputs, ops.convert_to_tensor(index, "int32"))
        np.testing.assert_array_equal(to_np(helper), to_np(expected))
        assert (to_np(helper)[:, 1:3, index:index + 3] == -1).all()
        np.testing.assert_array_equal(to_np(inputs), x)


def test_suppress_token_helper_equals_adding_its_row():
    """`_backend.suppress_token` gives `logits + row` exactly, inside `direct_calls()` (under
    PyTorch an in-place add to the one column) and outside (a new array, the input kept)."""
    rng = np.random.default_rng(0)
    x = rng.normal(0.0, 5.0, (4, 9)).astype("float32")
    row = np.where(np.arange(9) == 6, -1e9, 0.0).astype("float32")
    expected = x + row
    outside = ops.convert_to_tensor(x)
    np.testing.assert_array_equal(
        to_np(_backend.suppress_token(outside, 6, ops.convert_to_tensor(row))), expected)
    np.testing.assert_array_equal(to_np(outside), x)
    with _backend.direct_calls():
        inside = _backend.suppress_token(ops.convert_to_tensor(x), 6, ops.convert_to_tensor(row))
    np.testing.assert_array_equal(to_np(inside), expected)
    assert (to_np(inside)[:, 6] == -1e9).all()


@pytest.mark.parametrize("parent", [[0, 0, 3, 1, 4], [0, 1, 2, 3, 4]])
def test_beam_reorder_gives_each_row_its_parents_filled_positions(parent):
    """`reorder_beams` (under torch inside generation: in place, the filled positions of the
    rows whose parent is another row) gives every row its parent's filled positions."""
    pairs = np.random.default_rng(0).normal(size=(2, 2, 5, 2, 6, 3)).astype("float32")
    caches = [tuple(ops.convert_to_tensor(part) for part in pair) for pair in pairs]
    parents = ops.convert_to_tensor(np.array(parent, "int32"))
    with _backend.direct_calls(), _generation_grad_mode():  # two layers' (keys, values)
        got = _backend.reorder_beams(caches, parents, 4)
    assert len(got) == 2 and all(len(pair) == 2 for pair in got)
    for pair, expected in zip(got, pairs):
        for part, want in zip(pair, expected):  # (B, H, L, d)
            np.testing.assert_array_equal(to_np(part)[:, :, :4], want[parent][:, :, :4])


@pytest.mark.parametrize("rows", [1, 3])
def test_generation_holds_caches_as_pairs_but_one_row_under_xla_on_the_cpu(rows):
    """Generation's self-attention caches are `(keys, values)` pairs, except one stacked array
    under XLA on the CPU at one row (`splits_caches`). (Both decode as a full forward pass:
    test_generation's cached-step test, at one row and three.)"""
    model = marian_like()
    layer = model.get_layer("decoder_block_0").self_attention
    cache = layer._empty_cache(rows, 5, "float32")
    stacked = BACKEND == "jax" and rows == 1 and _cpu_only()
    assert isinstance(cache, tuple) != stacked
    shapes = [tuple(cache.shape)] if stacked else [tuple(part.shape) for part in cache]
    assert shapes == ([(1, 2, 4, 5, 8)] if stacked else [(rows, 4, 5, 8)] * 2)


@pytest.mark.parametrize("rows", [1, 2, 16, 17])
def test_few_row_searches_under_jax_take_products_against_transposed_weights(rows):
    """Under JAX on the CPU a search of at most 16 rows takes a tied table's logits, and one of
    one row also its steps' small attention projections (in ≤ out ≤ 1024), against transposed
    copies made outside the compiled search, once per weight value, and is compiled without
    YNNPACK unless a layer is quantized; every search under JAX on the CPU compiles at LLVM's
    optimization level 1. (Its tokens and scores: the plain-path tests above, at 1, 3 and 9
    rows, and after weights change; `test_transposed_products_equal_keras_calls`.)"""
    model = marian_like()
    layer = model.get_layer("shared_embedding").token_embedding
    parts = generation.Seq2SeqParts.from_model(model)
    block = model.get_layer("decoder_block_0")
    steps = [block.self_attention.output_dense, block.cross_attention.query_dense,
             block.cross_attention.output_dense]
    assert parts.transposable()[:4] == [layer, *steps]
    wide = keras.layers.Dense(2048)  # out > 1024: its own kernel
    wide.build((None, 32))
    narrow = keras.layers.Dense(32)  # in > out: its own kernel
    narrow.build((None, 64))
    xla_cpu = BACKEND == "jax" and _cpu_only()
    few = xla_cpu and rows <= 16
    picked = _backend.transposed_weights(parts.transposable() + [wide, narrow], rows)
    assert len(parts.transposable()) == 1 + 3 * len(parts.decoder_blocks)
    transposable = parts.transposable() if rows == 1 else [layer]  # (a table: up to 16 rows)
    assert picked == (transposable if few else [])
    level = _backend._LLVM_LEVEL_1 if xla_cpu else {}
    expected = (level | (_backend._NO_YNN if few else {})) or None
    assert _backend.compiler_options(rows, model._flatten_layers()) == expected
    quantized = keras.layers.Dense(4)
    quantized.build((None, 8))
    quantized.quantize("int8")  # int8 products want YNNPACK's kernels: it stays on
    assert _backend.compiler_options(rows, [*model._flatten_layers(), quantized]) == (
        level or None)
    assert quantized not in _backend.transposed_weights([quantized], rows)
    if BACKEND != "jax":
        return  # (elsewhere a variable's value is the variable itself: no copy is kept)
    transposed = _backend.transposed_weight(layer)
    np.testing.assert_array_equal(to_np(transposed), to_np(layer.embeddings).T)
    assert _backend.transposed_weight(layer) is transposed  # kept while the table is the same
    layer.embeddings.assign(ops.convert_to_tensor(to_np(layer.embeddings) * 2.0))
    np.testing.assert_array_equal(to_np(_backend.transposed_weight(layer)),
                                  to_np(layer.embeddings).T)
    kernel = steps[0].kernel  # (heads, d, d_model) as a (heads · d, d_model) matrix
    np.testing.assert_array_equal(to_np(_backend.transposed_weight(steps[0])),
                                  to_np(kernel).reshape(-1, kernel.shape[-1]).T)


@pytest.mark.skipif(BACKEND != "jax", reason="generation passes transposed weights under JAX")
@pytest.mark.parametrize("rows", [1, 3])
def test_transposed_products_equal_keras_calls(rows):
    """A layer's product against its transposed weight (`_transposed_plan`) gives its Keras
    call: a query projection (kernel `(d, heads, d)`), an attention output projection
    (`(heads, d, d_model)`) and a `Dense` with an activation, at one row (the transposed
    product) and at three (the layer's own call)."""
    rng = np.random.default_rng(rows)
    attention = MultiHeadSelfAttention(num_heads=4, causal=True)
    attention(ops.zeros((1, 2, 32)))
    dense = keras.layers.Dense(48, activation="swish")
    dense.build((None, 32))
    cases = [(attention.query_dense, (rows, 1, 32)), (attention.output_dense, (rows, 1, 4, 8)),
             (dense, (rows, 32))]
    for layer, shape in cases:
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        x = ops.convert_to_tensor(rng.normal(size=shape), "float32")
        expected = to_np(layer(x))
        transposed = {layer: _backend.transposed_weight(layer)}
        with _backend.direct_calls(transposed=transposed):
            assert _backend._plan(layer) != layer.call
            got = to_np(_backend.call_layer(layer, x))
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=layer.name)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's compile options")
def test_the_installed_xla_accepts_the_search_compile_options():
    """If a JAX update drops an option (YNNPACK off, LLVM's level 1), searches compile with its
    defaults (no error): this test says so, so that the timings in `compiler_options` are
    measured again."""
    assert _backend._knows_options(tuple(_backend._NO_YNN.items()))
    assert _backend._knows_options(tuple(_backend._LLVM_LEVEL_1.items()))
    assert not _backend._knows_options((("xla_cpu_no_such_option", ""),))


def _generation_grad_mode():
    """No autograd, as generation runs under PyTorch (the oneDNN products need it off)."""
    if BACKEND == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


def _direct_layers():
    """(layer, input width or shape, call kwargs, whether torch runs a packed product)."""
    return [
        (keras.layers.Dense(24, activation="swish"), (16,), {}, True),
        (keras.layers.Dense(24, use_bias=False), (16,), {}, True),
        (keras.layers.EinsumDense("btd,dhk->bthk", (None, 4, 6), bias_axes="hk"), (16,), {},
         True),  # a query projection
        (keras.layers.EinsumDense("bthk,hkd->btd", (None, 16), bias_axes="d"), (4, 6), {},
         True),  # an attention output projection
        (keras.layers.EinsumDense("btd,de->bte", (None, 8)), (16,), {}, True),
        (keras.layers.LayerNormalization(epsilon=1e-5), (16,), {}, False),
        (keras.layers.LayerNormalization(center=False, scale=False), (16,), {}, False),
        (keras.layers.LayerNormalization(dtype="bfloat16"), (16,), {}, False),
        (keras.layers.ReversibleEmbedding(30, 16), (16,), {"reverse": True}, True),
        (keras.layers.ReversibleEmbedding(30, 16, tie_weights=False), (16,), {"reverse": True},
         True),
        (TokenAndPositionEmbedding(30, 16, reverse_bias=True), (16,), {"reverse": True},
         True),  # MarianMT's logits: the bias added by the product (packed: its table)
    ]


@pytest.mark.parametrize("rows", [1, 3, 9, 64])
def test_direct_layer_calls_equal_keras_calls(rows):
    """Inside `direct_calls()` without autograd (generation's setting) the layers a decoding
    step calls most give their Keras `__call__` outputs. Under PyTorch they run as torch calls
    alone: products by oneDNN against packed kernels, layer norm by `F.layer_norm`. Under
    TensorFlow a tied table's logits take the product `(table · hiddenᵀ)ᵀ`."""
    rng = np.random.default_rng(rows)
    for layer, shape, kwargs, packed in _direct_layers():
        x = ops.convert_to_tensor(rng.normal(size=(rows, 1) + shape), layer.compute_dtype)
        layer(x, **kwargs) if not kwargs else layer(ops.ones((rows, 1), "int32"))
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        expected = to_np(layer(x, **kwargs))
        with _backend.direct_calls(), _generation_grad_mode():
            got = to_np(_backend.call_layer(layer, x, **kwargs))
        atol = 2e-2 if layer.compute_dtype == "bfloat16" else 1e-5
        np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"),
                                   atol=atol, err_msg=layer.name)
        if BACKEND == "torch":  # (oneDNN's packing: in torch's CPU builds, for CPU tensors)
            table = getattr(layer, "token_embedding", layer)
            packs = packed and _backend._one_dnn() and x.device.type == "cpu"
            assert (table in _backend._PACKED) == packs, layer.name
            if table is not layer:  # the logits and their bias: one torch product, no `call`
                assert _backend._plan(layer) != layer.call
        if BACKEND == "tensorflow":
            table = getattr(layer, "token_embedding", layer)
            with _backend.direct_calls():
                planned = _backend._plan(table) != table.call
            assert planned == (kwargs.get("reverse", False) and table.tie_weights), layer.name


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's graph alone: its own "
                    "product order for a tied table's logits (`_tf_graph_logits_plan`)")
def test_tensorflow_graph_logits_equal_keras_logits():
    """Traced with unknown dimensions, as generation's graph is, the tied logits of 1 to 9
    rows (and of 2 positions a row) equal Keras's `hidden @ tableᵀ`."""
    import tensorflow as tf

    layer = keras.layers.ReversibleEmbedding(30, 16)
    layer.build((None, None))
    rng = np.random.default_rng(0)
    layer.embeddings.assign(rng.normal(size=(30, 16)).astype("float32"))

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None, None, 16])])
    def logits(hidden):
        with _backend.direct_calls():
            return _backend.call_layer(layer, hidden, reverse=True)

    for shape in [(1, 1), (3, 1), (9, 1), (3, 2)]:
        hidden = rng.normal(size=shape + (16,)).astype("float32")
        got = logits(tf.constant(hidden)).numpy()
        assert got.shape == shape + (30,)
        np.testing.assert_allclose(got, hidden @ to_np(layer.embeddings).T, atol=1e-5)


def _attention_layers():
    """(name, layer) of each attention layer a decoding step calls: cached causal
    self-attention (plain; grouped-query with rotary positions) and cross-attention over a
    context cache (grouped-query with a padding mask; one key/value head and no mask)."""
    return [
        ("self", MultiHeadSelfAttention(num_heads=4, causal=True)),
        ("self, gqa, rotary", MultiHeadSelfAttention(num_heads=4, causal=True,
                                                     num_key_value_heads=2, rotary=True)),
        ("cross, padding, gqa", CrossAttention(num_heads=4, num_key_value_heads=2)),
        ("cross, no mask, mqa", CrossAttention(num_heads=4, num_key_value_heads=1)),
    ]


def _not_called(*args, **kwargs):
    raise AssertionError("the layer's `call` ran instead of its torch plan")


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("rows", [1, 5])
def test_direct_attention_steps_equal_keras_calls(monkeypatch, rows, split):
    """Inside `direct_calls()` (generation's setting) decoding steps of each attention layer
    give its Keras `__call__` outputs, and the self-attention its updated cache. Under
    PyTorch a one-query step runs as torch calls alone (`_torch_self_attention_plan`,
    `_torch_cross_attention_plan`: the layer's `call` is not reached); the cross-attention
    plan prepares a padding mask once, and again for another mask; a source of padding alone
    gives its row zeros (then the output bias) on both paths; several queries (a prompt's
    prefill) take `call`. The Keras calls take each cache as the stacked array; the direct
    steps too, or (`split`, generation's form) as its `(keys, values)` pair, which the
    self-attention gives back updated."""
    rng = np.random.default_rng(rows)
    context = ops.convert_to_tensor(rng.normal(size=(rows, 6, 16)), "float32")
    pad = np.ones((rows, 6), bool)
    pad[0, 4:] = False
    if rows > 1:
        pad[-1, :] = False  # a source of padding alone
    other = np.ones((rows, 6), bool)
    other[:, 2:] = False  # another padding: other outputs
    for name, layer in _attention_layers():
        x = ops.convert_to_tensor(rng.normal(size=(rows, 1, 16)), "float32")
        layer(x) if name.startswith("self") else layer(x, context)
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        if name.startswith("self"):
            cache = ops.convert_to_tensor(rng.normal(size=(rows, 2, layer._kv_heads, 5, 4)),
                                          "float32")
            steps = [dict(cache=cache, cache_update_index=ops.convert_to_tensor(i, "int32"))
                     for i in (3, 4)]
        else:
            cached = layer.compute_context_cache(context)
            masks = ([ops.convert_to_tensor(m) for m in (pad, pad, other)]
                     if "padding" in name else [None, None])
            steps = [dict(context_cache=cached, context_mask=m) for m in masks]
        expected = [layer(x, **step) for step in steps]
        stacked = steps
        if split:  # as generation passes them: keys and values split
            key = "cache" if name.startswith("self") else "context_cache"
            steps = [dict(step, **{key: cache_keys_values(step[key])}) for step in steps]
        with _backend.direct_calls(), _generation_grad_mode(), monkeypatch.context() as patch:
            if BACKEND == "torch":
                patch.setattr(layer, "call", _not_called)
            got = [_backend.call_layer(layer, x, **_copied(step)) for step in steps]
        if name.startswith("self"):  # three queries (a prompt's prefill): `call`
            prefill = dict(steps[0], cache_update_index=1)
            expected.append(layer(ops.tile(x, (1, 3, 1)), **dict(stacked[0], cache_update_index=1)))
            with _backend.direct_calls(), _generation_grad_mode():
                got.append(_backend.call_layer(layer, ops.tile(x, (1, 3, 1)),
                                               **_copied(prefill)))
        for g, e in zip(got, expected):
            assert len(_flat(g)) == len(_flat(e)), name
            for g_part, e_part in zip(_flat(g), _flat(e)):
                if isinstance(g_part, tuple):  # a split cache, given back split
                    assert split and len(g_part) == 2, name
                    g_part = np.stack([to_np(part) for part in g_part], axis=1)
                np.testing.assert_allclose(to_np(g_part), to_np(e_part), atol=1e-5,
                                           err_msg=name)
        if "padding" in name:
            assert np.abs(to_np(expected[0]) - to_np(expected[2])).max() > 0.1
            if rows > 1:  # the padded source's attention: zeros, then the bias
                bias = to_np(layer.output_dense.bias)
                np.testing.assert_allclose(to_np(expected[0])[-1, 0], bias, atol=1e-6)
                assert np.abs(to_np(expected[0])[0, 0] - bias).max() > 0.1


def _cpu_only():
    """Whether JAX or TensorFlow computes on the CPU alone (XLA's CPU rules apply)."""
    if BACKEND == "jax":
        import jax

        return jax.default_backend() == "cpu"
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return not tf.config.list_logical_devices("GPU")
    return True


@pytest.mark.parametrize("rows", [1, 5])
def test_fused_step_projections_equal_keras_calls(rows):
    """Where generation is compiled by XLA on the CPU (JAX; TensorFlow's XLA searches), a
    cached self-attention step takes its queries, keys and values from one product against
    the three kernels concatenated (`fuses_projections`): each equals its projection's Keras
    call, with grouped-query heads and rotary positions, and without biases. Elsewhere
    (PyTorch, a GPU), outside generation, and for a quantized or mixed-precision projection,
    the projections stay apart."""
    rng = np.random.default_rng(rows)
    x = ops.convert_to_tensor(rng.normal(size=(rows, 1, 16)), "float32")
    index = ops.convert_to_tensor(3, "int32")
    layers = [MultiHeadSelfAttention(num_heads=4, causal=True),
              MultiHeadSelfAttention(num_heads=4, causal=True, num_key_value_heads=2,
                                     rotary=True),
              MultiHeadSelfAttention(num_heads=4, causal=True, use_bias=False)]
    for layer in layers:
        layer(x)
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        expected = [layer._rotate(layer.query_dense(x), index),
                    layer._rotate(layer.key_dense(x), index), layer.value_dense(x)]
        dense = (layer.query_dense, layer.key_dense, layer.value_dense)
        fused = []

        def step(inputs, layer=layer, dense=dense, fused=fused):
            fused.append(bool(_backend.fuses_projections(*dense)))
            return layer._project_step(inputs, index)

        if BACKEND == "tensorflow":
            got = _as_generation_compiles(step)(x)
        else:
            with _backend.direct_calls():
                got = step(x)
        assert fused == [BACKEND != "torch" and _cpu_only()], layer.name
        assert not _backend.fuses_projections(*dense)  # outside generation
        for g, e in zip(got, expected):
            np.testing.assert_allclose(to_np(g), to_np(e), atol=1e-5, err_msg=layer.name)
    quantized = keras.layers.EinsumDense("btd,dhk->bthk", (None, 4, 4), bias_axes="hk")
    quantized.build((None, 1, 16))
    quantized.quantize("int8")
    mixed = keras.layers.EinsumDense("btd,dhk->bthk", (None, 4, 4), dtype="mixed_bfloat16")
    mixed.build((None, 1, 16))
    with _backend.direct_calls():
        assert not _backend.fuses_projections(layers[0].query_dense, quantized)
        assert not _backend.fuses_projections(layers[0].query_dense, mixed)


def _graph_operations(function, *args):
    """Operations of a TensorFlow function's graph, those of the functions it calls included."""
    graph = function.get_concrete_function(*args).graph.as_graph_def()
    return len(graph.node) + sum(len(f.node_def) for f in graph.library.function)


@pytest.mark.parametrize("xla", [False, True])
def test_alike_blocks_run_through_one_trace(xla):
    """`repeated_layer_caller`: each of three alike blocks gives its own Keras call's output
    (its own weights). Under TensorFlow, in a search's trace (XLA or the graph of unknown
    dimensions), the three are traced once: the graph holds under half the operations of one
    traced per block. Blocks whose configs or variables differ are not alike."""
    rng = np.random.default_rng(0)
    x = ops.convert_to_tensor(rng.normal(size=(2, 5, 16)), "float32")
    mask = ops.convert_to_tensor(np.array([[1] * 5, [1, 1, 1, 0, 0]], "bool"))
    blocks = [TransformerEncoderBlock(num_heads=4, ff_dim=32, dropout=0.0) for _ in range(3)]
    for block in blocks:
        block(x)
        for weight in block.weights:
            weight.assign(rng.normal(0.0, 0.3, weight.shape).astype("float32"))
    expected = [to_np(block(x, mask=mask)) for block in blocks]
    assert np.abs(expected[0] - expected[1]).max() > 0.1
    other = TransformerEncoderBlock(num_heads=4, ff_dim=48, dropout=0.0)
    other(x)
    assert _backend._alike(blocks) and not _backend._alike(blocks + [other])

    def search(x, caller=_backend.repeated_layer_caller):
        with _backend.direct_calls(xla=xla):
            call = caller(blocks)
            return [call(i, x, mask=mask) for i in range(3)]

    if BACKEND == "tensorflow":
        import tensorflow as tf

        def one_by_one(layers):
            return lambda i, *args, **kwargs: _backend.call_layer(layers[i], *args, **kwargs)

        def traced(caller):
            return tf.function(lambda x: search(x, caller), autograph=False, jit_compile=xla)

        shared, apart = _graph_operations(traced(_backend.repeated_layer_caller), x), \
            _graph_operations(traced(one_by_one), x)
        assert shared < apart / 2, (shared, apart)
        got = traced(_backend.repeated_layer_caller)(x)
    else:
        got = search(x)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(to_np(g), e, atol=1e-5)


def test_query_rows_share_a_context_cache_row(monkeypatch):
    """A context cache of B rows serves m·B query rows (beam search's beams of a source share
    their source's cross-attention keys and values): query rows b·m … b·m + m - 1 attend to
    cache row b, with its padding mask, as over the cache repeated m times. Checked through
    Keras's `__call__` (two query positions a row, a 3-D and a 2-D `attention_mask`, the
    weights) and inside `direct_calls()` (PyTorch's cross-attention plan, its `call` not
    reached); a query batch that is no multiple of the cache's is refused, and a padding mask
    passed as `attention_mask` gets the masks module's hint."""
    sources, m = 3, 4
    rng = np.random.default_rng(7)
    context = ops.convert_to_tensor(rng.normal(size=(sources, 6, 16)), "float32")
    pad = np.ones((sources, 6), bool)
    pad[0, 4:] = False
    pad[2, :] = False  # a source of padding alone
    allowed = rng.random((sources * m, 2, 6)) < 0.7
    for name, layer in _attention_layers():
        if name.startswith("self"):
            continue
        layer(ops.zeros((sources, 1, 16)), context)
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        cache = layer.compute_context_cache(context)
        repeated = ops.repeat(cache, m, axis=0)
        mask = ops.convert_to_tensor(pad)
        repeated_mask = ops.convert_to_tensor(np.repeat(pad, m, 0))
        x = ops.convert_to_tensor(rng.normal(size=(sources * m, 2, 16)), "float32")
        for attention_mask in (None, allowed, allowed[0]):
            got, scores = layer(x, context_cache=cache, context_mask=mask,
                                attention_mask=attention_mask, return_attention_scores=True)
            want, want_scores = layer(x, context_cache=repeated, context_mask=repeated_mask,
                                      attention_mask=attention_mask,
                                      return_attention_scores=True)
            np.testing.assert_allclose(to_np(got), to_np(want), atol=1e-5, err_msg=name)
            np.testing.assert_allclose(to_np(scores), to_np(want_scores), atol=1e-6,
                                       err_msg=name)
        step = x[:, :1]
        want = to_np(layer(step, context_cache=repeated, context_mask=repeated_mask))
        assert np.abs(want[0] - want[m]).max() > 0.1  # rows of two sources differ
        with _backend.direct_calls(), _generation_grad_mode(), monkeypatch.context() as patch:
            if BACKEND == "torch":
                patch.setattr(layer, "call", _not_called)
            got = _backend.call_layer(layer, step, context_cache=cache_keys_values(cache),
                                      context_mask=mask)
        np.testing.assert_allclose(to_np(got), want, atol=1e-5, err_msg=name)
        with pytest.raises(ValueError, match="multiple of 3 rows; received 5"):
            layer(x[:5], context_cache=cache, context_mask=mask)
        with pytest.raises(ValueError, match="padding mask"):  # (B, S) for a (B, T, S) mask
            layer(x, context_cache=cache, attention_mask=np.repeat(pad, m, 0))


def _copied(kwargs):
    """The call arguments with a copy of the cache (the direct path writes it in place)."""
    if "cache" not in kwargs:
        return kwargs
    cache = kwargs["cache"]
    if isinstance(cache, tuple):
        return dict(kwargs, cache=tuple(ops.convert_to_tensor(to_np(part)) for part in cache))
    return dict(kwargs, cache=ops.convert_to_tensor(to_np(cache)))


def _flat(result):
    return result if isinstance(result, (tuple, list)) else [result]


def test_products_with_autograd_on_stay_differentiable():
    """With autograd on, no packed product runs (oneDNN's kernel has no gradient here): the
    direct call is the plain product, gradients included."""
    layer = keras.layers.Dense(8)
    x = keras.random.normal((9, 1, 4), seed=2)
    expected = to_np(layer(x))
    with _backend.direct_calls():
        got = _backend.call_layer(layer, x)
    np.testing.assert_allclose(to_np(got), expected, atol=1e-5)
    if BACKEND == "torch":
        assert layer not in _backend._PACKED
        got.sum().backward()
        assert layer.kernel.value.grad is not None


@pytest.mark.parametrize("batch, length", [(1, 1), (3, 1), (3, 4)])
def test_attention_helper_matches_numpy(batch, length):
    rng = np.random.default_rng(batch + length)
    q = rng.normal(size=(batch, length, 2, 4)).astype("float32")
    k = rng.normal(size=(batch, 6, 2, 4)).astype("float32")
    v = rng.normal(size=(batch, 6, 2, 4)).astype("float32")
    mask = rng.random((batch, 1, length, 6)) > 0.4
    mask[..., 0] = True  # every row has a key (scaled_dot_product_attention sees to that)
    out = to_np(_backend.dot_product_attention(ops.convert_to_tensor(q), ops.convert_to_tensor(k),
                                               ops.convert_to_tensor(v),
                                               ops.convert_to_tensor(mask), 0.5))
    scores = np.einsum("bthd,bshd->bhts", q, k) * 0.5
    weights = np_softmax(np.where(mask, scores, -1e9))
    np.testing.assert_allclose(out, np.einsum("bhts,bshd->bthd", weights, v), atol=1e-5)


def test_argmax_helper_takes_the_first_maximum():
    x = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.0]],
                 "float32")
    got = to_np(_backend.argmax(ops.convert_to_tensor(x)))
    np.testing.assert_array_equal(got, [1, 0, 1])
    assert got.dtype == np.int32
    big = np.random.default_rng(0).normal(size=(5, 1000)).astype("float32")
    np.testing.assert_array_equal(to_np(_backend.argmax(ops.convert_to_tensor(big))),
                                  big.argmax(-1))


def _as_generation_compiles(function):
    """`function` as generation runs it: under TensorFlow, in an XLA function traced inside
    `direct_calls(xla=True)` (as a search of `_XLA_ROWS` rows or more), where the helpers take two
    stages on the CPU; elsewhere as it is."""
    if keras.backend.backend() != "tensorflow":
        return function
    import tensorflow as tf

    def traced(x):
        with _backend.direct_calls(xla=True):
            assert _backend._xla_cpu() == (not tf.config.list_logical_devices("GPU"))
            return function(x)

    return tf.function(traced, jit_compile=True, autograph=False)


@pytest.mark.parametrize("vocab", [1000, 32000, 1157])
def test_top_k_helper_equals_a_full_ranking(vocab):
    """Two stages under XLA on the CPU (JAX, and TensorFlow's XLA-compiled searches): the same
    values and indices as NumPy's stable ranking,
    ties (in one chunk and across chunks) to the lower index, a vocabulary that is not a
    multiple of the chunk size, and rows whose best values share one chunk. (Elsewhere the helper
    is the backend's top-k; torch's orders equal values as it likes, so there the indices are
    checked to hold the values.)"""
    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(6, vocab)).astype("float32")
    x[0, [5, 9, 700, 900]] = 10.0  # four equal maxima, two chunks
    x[1, 130:138] = np.arange(8, 16)  # the best eight in one chunk
    x[2, -3:] = 20.0  # in the last, partly filled chunk
    x[3, :] = 1.0  # every value equal
    for k in (1, 8):
        top_k = _as_generation_compiles(lambda t, k=k: _backend.top_k(t, k))
        values, indices = top_k(ops.convert_to_tensor(x))
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(to_np(values), np.take_along_axis(x, order, -1))
        np.testing.assert_array_equal(np.take_along_axis(x, to_np(indices), -1), to_np(values))
        assert all(len(set(row)) == k for row in to_np(indices).tolist())
        if keras.backend.backend() != "torch":
            np.testing.assert_array_equal(to_np(indices), order)
        assert to_np(indices).dtype == np.int32
    argmax = _as_generation_compiles(_backend.argmax)
    np.testing.assert_array_equal(to_np(argmax(ops.convert_to_tensor(x))), x.argmax(-1))


def test_mixed_precision_layers_keep_keras_call(monkeypatch):
    """A layer whose variables are float32 but computes in bfloat16 needs `__call__`'s
    autocasting: the fast path leaves it there, and decoding equals the plain path."""
    model = marian_like(tied=False, dtype="mixed_bfloat16")
    src = sources(9)
    fast = generate(model, src, max_length=5)
    with plain_path(monkeypatch, model):
        plain = generate(model, src, max_length=5)
    np.testing.assert_array_equal(fast, plain)
    mixed = [layer for layer in model._flatten_layers()
             if layer.built and layer.dtype_policy.name == "mixed_bfloat16"]
    assert mixed
    with _backend.direct_calls():  # each is called through Keras's __call__
        assert all(_backend._plan(layer) is layer for layer in mixed)


@pytest.mark.skipif(BACKEND != "torch", reason="torch generation's malloc rule (JAX and "
                    "TensorFlow allocate through their own allocators)")
def test_torch_generation_reuses_freed_memory(monkeypatch):
    """A search that frees 4 MB logits arrays every step takes them again from the process's
    heap instead of page-faulting fresh pages: few minor faults in a warm call (thousands
    with glibc's defaults). A user's MALLOC_*_ environment variable is left alone."""
    import platform
    import resource

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the rule is glibc's")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert _backend.keep_freed_memory.__wrapped__() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    model = build_transformer(32000, 32000, d_model=16, num_heads=2, ff_dim=32,
                              num_encoder_layers=1, num_decoder_layers=1, dropout=0.0)
    src = np.random.default_rng(0).integers(3, 32000, (32, 6)).astype("int32")
    generate(model, src, start_id=1, end_id=None, max_length=8)  # warm
    assert _backend.keep_freed_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    generate(model, src, start_id=1, end_id=None, max_length=8)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 500
