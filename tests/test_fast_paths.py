"""Cached decoding gives the plain path's tokens and scores.

The fast path is what `generate` runs: the models' `call_with_cache` (one new token a step over
key/value caches; under PyTorch without autograd, caches and logits written in place, the
attention reading views of the filled positions, plain sublayers' `call` and single torch
products), beams sharing their source's cross-attention cache row and reordering their caches,
two-stage argmax and top-k under JAX on the CPU, length buckets. The plain path runs the same
search strategies over a decoder that recomputes the whole model (Keras's `__call__`, every
mask) over every token so far at each step, with no cache. The backend helpers are checked
against NumPy.
"""

import contextlib

import keras
import numpy as np
import pytest
from keras import ops

from helpers import BACKEND, np_softmax, to_np
from keras_tfm import (CrossAttention, MultiHeadSelfAttention, build_language_model,
                       build_transformer, generate)
from keras_tfm import _backend
from keras_tfm import search as search_lib


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
    src[1, 4:] = 39  # padded rows
    src[3, 2:] = 39
    return src


class PlainDecoder:
    """The plain path: `call_with_cache` that runs the whole model over every token so far.
    Its "cache" is the token history `(R, 1, L, 1)` (laid out as a key cache, so that beam
    search reorders it as it reorders caches)."""

    def __init__(self, model, source=None):
        self.model, self.source = model, source

    def call_with_cache(self, tokens, cache, index):
        zero = ops.zeros((), "int32")
        history = ops.slice_update(cache["self"][0], (zero, zero, ops.cast(index, "int32"), zero),
                                   ops.cast(tokens[:, None, :, None], "int32"))
        rows, length = ops.shape(history)[0], ops.shape(history)[2]
        flat = ops.reshape(history, (rows, length))
        if self.source is None:
            logits = self.model(flat)
        else:
            beams = rows // ops.shape(self.source)[0]
            logits = self.model([ops.repeat(self.source, beams, axis=0), flat])
        logits = ops.slice(logits, (0, index, 0), (rows, ops.shape(tokens)[1], logits.shape[-1]))
        return logits, dict(cache, self=[history])


def plain_search(model, strategy, max_length, end_id, pad_id, prompts, lengths, source=None,
                 uniforms=None, suppress_pad=True):
    """`search.search` over `PlainDecoder`, compiled as generation compiles its searches."""
    settings = search_lib.Settings(strategy, max_length, end_id, pad_id, suppress_pad, True)
    decoder = PlainDecoder(model, None if source is None else ops.convert_to_tensor(source))
    length = prompts.shape[1] + max_length - 1

    def run(prompts, lengths, *draws):
        cache = {"self": [ops.zeros((ops.shape(prompts)[0], 1, length, 1), "int32")]}
        return search_lib.search(decoder, settings, cache, prompts, lengths, *draws)

    inputs = [prompts, lengths] + ([] if uniforms is None else [uniforms])
    compiled = search_lib.compiled(model, ("plain", settings), run, static_shapes=True)
    tokens, scores = compiled(*[ops.convert_to_tensor(x) for x in inputs])
    return to_np(tokens), to_np(scores)


def assert_same(fast, plain, pad=39, atol=1e-4, message=""):
    """Equal tokens (`generate` cuts the columns after the longest sequence) and scores."""
    tokens, scores = fast
    width = tokens.shape[1]
    np.testing.assert_array_equal(tokens, plain[0][:, :width], err_msg=message)
    assert (plain[0][:, width:] == pad).all(), message
    np.testing.assert_allclose(scores, plain[1], atol=atol, err_msg=message)


STRATEGIES = {"greedy": (dict(method="greedy"), search_lib.Greedy()),
              "beam": (dict(method="beam", beam_size=2), search_lib.Beam(2, 0.6)),
              "sample": (dict(method="sample", temperature=0.7, top_k=5, seed=3),
                         search_lib.Sample(0.7, 5, 1.0))}


def seq2seq_plain(model, src, strategy, max_length, seed=None):
    rows = len(src) * strategy.beams
    draws = (search_lib.uniforms(seed, len(src), max_length + 1)
             if isinstance(strategy, search_lib.Sample) else None)
    return plain_search(model, strategy, max_length, 0, 39, np.full((rows, 1), 39, "int32"),
                        np.ones(rows, "int32"), source=src, uniforms=draws)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", sorted(STRATEGIES))
def test_seq2seq_search_equals_the_plain_path(method, tied):
    """9 sources (18 rows with beams: TensorFlow's XLA from 17 rows, its graph below)."""
    model = marian_like(tied)
    src = sources(9)
    options, strategy = STRATEGIES[method]
    fast = generate(model, src, max_length=8, return_scores=True, **options)
    assert_same(fast, seq2seq_plain(model, src, strategy, 8, options.get("seed")), message=method)
    if not tied:  # the comparison can fail: rows and tokens vary
        assert len({tuple(row) for row in fast[0]}) > 1 and len(set(fast[0][0].tolist())) > 1


@pytest.mark.parametrize("method", ["greedy", "sample"])
def test_language_model_search_equals_the_plain_path(method):
    """Prompts of different lengths (each row steps through its own), grouped-query attention
    with rotary positions; a model with padding and one without."""
    lm = build_language_model(40, d_model=32, num_heads=4, ff_dim=64, num_layers=2,
                              num_key_value_heads=2, dropout=0.0)
    rows = PROMPTS * 5  # 20 rows (TensorFlow's XLA)
    prompts, lengths = padded(rows)
    options, strategy = STRATEGIES[method]
    draws = search_lib.uniforms(3, 20, 5 + 6) if method == "sample" else None
    fast = generate(lm, rows, max_length=6, end_id=None, return_scores=True, **options)
    plain = plain_search(lm, strategy, 6, search_lib.NO_END, 0, prompts, lengths,
                         uniforms=draws)
    assert_same(fast, plain, pad=0, message=method)


@pytest.mark.parametrize("lora", [False, True])
def test_tied_language_model_search_equals_the_plain_path(lora):
    """A language model whose logits use its token table, 4 rows: under JAX a search of a few
    rows (the table passed in transposed; with LoRA on the table, the layer's own logits),
    under TensorFlow its graph (a step's logits as `(table · hᵀ)ᵀ`)."""
    lm = build_language_model(40, d_model=32, num_heads=4, ff_dim=64, num_layers=2,
                              tie_embeddings=True, dropout=0.0)
    if lora:
        lm.get_layer("token_embedding").enable_lora(2)
        for weight in lm.weights:
            if weight.path.endswith("lora_embeddings_b"):
                weight.assign(keras.random.normal(weight.shape, seed=4))
    prompts, lengths = padded(PROMPTS)
    fast = generate(lm, PROMPTS, max_length=6, end_id=None, return_scores=True)
    plain = plain_search(lm, search_lib.Greedy(), 6, search_lib.NO_END, 0, prompts, lengths)
    assert_same(fast, plain, pad=0)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3]]


def padded(rows):
    """Right-padded int32 prompts `(len(rows), 5)` and their lengths."""
    prompts = np.zeros((len(rows), 5), "int32")
    for i, row in enumerate(rows):
        prompts[i, :len(row)] = row
    return prompts, np.array([len(row) for row in rows], "int32")


@pytest.mark.parametrize("kind", ["int8", "mixed_bfloat16"])
def test_quantized_and_mixed_precision_models_equal_the_plain_path(kind):
    """Quantized layers run their quantized call and mixed-precision ones Keras's `__call__`
    (which casts), in the cached step as in the plain path."""
    model = marian_like(tied=False, dtype="mixed_bfloat16" if kind != "int8" else None)
    if kind == "int8":
        model.quantize("int8")
    else:  # sharper distributions: bfloat16's rounding differs between the paths, not a token
        kernel = model.get_layer("logits").kernel
        kernel.assign(kernel * 8.0)
    src = sources(9)
    # (bfloat16 rounds differently in a step and in a full pass: beams, whose sums of scores
    # tie often, are compared for the quantized model only.)
    for method in ("greedy", "beam") if kind == "int8" else ("greedy",):
        options, strategy = STRATEGIES[method]
        fast = generate(model, src, max_length=5, return_scores=True, **options)
        plain = seq2seq_plain(model, src, strategy, 5)
        assert_same(fast, plain, atol=0.1 if kind != "int8" else 1e-3, message=f"{kind} {method}")


def test_decoding_sees_weights_changed_in_place():
    model = marian_like(tied=True)
    src = sources(9)
    _, before = generate(model, src, max_length=4, end_id=None, return_scores=True)
    for weight in model.weights:
        if weight.path.endswith(("kernel", "embeddings")):
            weight.assign(ops.convert_to_tensor(to_np(weight) * 1.5))
    after = generate(model, src, max_length=4, end_id=None, return_scores=True)
    plain = plain_search(model, search_lib.Greedy(), 4, search_lib.NO_END, 39,
                         np.full((9, 1), 39, "int32"), np.ones(9, "int32"), source=src)
    assert_same(after, plain)
    assert np.abs(after[1] - before).max() > 1e-2


def _no_autograd():
    """Autograd off, as generation runs under PyTorch."""
    if BACKEND == "torch":
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()


@pytest.mark.parametrize("form", ["pair", "stacked"])
def test_call_with_cache_writes_in_place_only_under_torch_without_autograd(form):
    """`call_with_cache` equals `call` over the whole sequence; the cache comes back updated,
    written in place under PyTorch with autograd off (the same tensors) and a new one
    otherwise (the caller's left as it was)."""
    layer = MultiHeadSelfAttention(num_heads=2, causal=True)
    x = keras.random.normal((2, 3, 8), seed=1)
    full = to_np(layer(x))
    for in_place in (False, True):
        cache = layer.empty_cache(2, 4)
        if form == "stacked":
            cache = ops.stack(cache, axis=1)
        kept = [to_np(part) for part in keras.tree.flatten(cache)]
        with _no_autograd() if in_place else contextlib.nullcontext():
            for i in range(3):
                out, new = layer.call_with_cache(x[:, i:i + 1], cache, i)
                np.testing.assert_allclose(to_np(out)[:, 0], full[:, i], atol=1e-5)
                written = in_place and BACKEND == "torch"
                assert all((a is b) == written for a, b in zip(keras.tree.flatten(new),
                                                               keras.tree.flatten(cache)))
                if not written:
                    for part, old in zip(keras.tree.flatten(cache), kept):
                        np.testing.assert_array_equal(to_np(part), old)
                cache = new
                kept = [to_np(part) for part in keras.tree.flatten(cache)]


def test_query_rows_share_a_context_cache_row():
    """A context cache of B rows serves m·B query rows (beam search's beams of a source share
    their source's cross-attention keys and values): query rows b·m … b·m + m - 1 attend to
    cache row b, with its padding mask, as over the cache repeated m times; through `call`
    (two query positions, a 3-D and a 2-D `attention_mask`, the weights) and
    `call_with_cache` (a step, autograd off). A query batch that is no multiple of the
    cache's is refused."""
    sources, m = 3, 4
    rng = np.random.default_rng(7)
    context = ops.convert_to_tensor(rng.normal(size=(sources, 6, 16)), "float32")
    pad = np.ones((sources, 6), bool)
    pad[0, 4:] = False
    allowed = rng.random((sources * m, 2, 6)) < 0.7
    allowed[..., 0] = True
    for layer in (CrossAttention(num_heads=4, num_key_value_heads=2),
                  CrossAttention(num_heads=2, num_key_value_heads=1)):
        layer(ops.zeros((sources, 1, 16)), context)
        for weight in layer.weights:
            weight.assign(rng.normal(0.0, 0.5, weight.shape).astype("float32"))
        cache = layer.compute_context_cache(context)
        repeated = ops.repeat(cache, m, axis=0)
        mask, repeated_mask = ops.convert_to_tensor(pad), ops.convert_to_tensor(np.repeat(pad, m, 0))
        x = ops.convert_to_tensor(rng.normal(size=(sources * m, 2, 16)), "float32")
        for attention_mask in (None, allowed, allowed[0]):
            got, scores = layer(x, context_cache=cache, context_mask=mask,
                                attention_mask=attention_mask, return_attention_scores=True)
            want, want_scores = layer(x, context_cache=repeated, context_mask=repeated_mask,
                                      attention_mask=attention_mask,
                                      return_attention_scores=True)
            np.testing.assert_allclose(to_np(got), to_np(want), atol=1e-5)
            np.testing.assert_allclose(to_np(scores), to_np(want_scores), atol=1e-6)
        step = x[:, :1]
        want = to_np(layer(step, context_cache=repeated, context_mask=repeated_mask))
        assert np.abs(want[0] - want[m]).max() > 0.1  # rows of two sources differ
        with _no_autograd():
            got = layer.call_with_cache(step, cache, mask)
        np.testing.assert_allclose(to_np(got), want, atol=1e-5)
        with pytest.raises(ValueError, match="multiple of 3 rows; received 5"):
            layer(x[:5], context_cache=cache, context_mask=mask)


def test_suppress_token_helper_sets_one_column():
    """`suppress_token` sets the one column, in place under PyTorch with autograd off."""
    x = np.random.default_rng(0).normal(0.0, 5.0, (4, 9)).astype("float32")
    expected = x.copy()
    expected[:, 6] = -1e9
    for grad_off in (False, True):
        logits = ops.convert_to_tensor(x)
        with _no_autograd() if grad_off else contextlib.nullcontext():
            got = _backend.suppress_token(logits, 6, -1e9)
        np.testing.assert_array_equal(to_np(got), expected)


@pytest.mark.parametrize("parent", [[0, 0, 3, 1, 4], [0, 1, 2, 3, 4]])
def test_beam_reorder_gives_each_row_its_parents_filled_positions(parent):
    """`reorder_beams` (under PyTorch without autograd: in place, the filled positions of the
    rows whose parent is another row) gives every row its parent's filled positions."""
    pairs = np.random.default_rng(0).normal(size=(2, 2, 5, 2, 6, 3)).astype("float32")
    caches = [tuple(ops.convert_to_tensor(part) for part in pair) for pair in pairs]
    with _no_autograd():
        got = _backend.reorder_beams(caches, ops.convert_to_tensor(np.array(parent, "int32")), 4)
    assert len(got) == 2 and all(len(pair) == 2 for pair in got)
    for pair, expected in zip(got, pairs):
        for part, want in zip(pair, expected):  # (B, H, L, d)
            np.testing.assert_array_equal(to_np(part)[:, :, :4], want[parent][:, :, :4])


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
    got = to_np(search_lib.argmax(ops.convert_to_tensor(x)))
    np.testing.assert_array_equal(got, [1, 0, 1])
    assert got.dtype == np.int32
    big = np.random.default_rng(0).normal(size=(5, 1000)).astype("float32")
    np.testing.assert_array_equal(to_np(search_lib.argmax(ops.convert_to_tensor(big))),
                                  big.argmax(-1))


@pytest.mark.parametrize("vocab", [1000, 32000, 1157])
def test_top_k_helper_equals_a_full_ranking(vocab):
    """Two stages under JAX on the CPU: the same values and indices as NumPy's stable ranking,
    ties (in one chunk and across chunks) to the lower index, a vocabulary that is not a
    multiple of the chunk size, and rows whose best values share one chunk. (Elsewhere the
    helper is the backend's top-k; torch's orders equal values as it likes, so there the
    indices are checked to hold the values.)"""
    rng = np.random.default_rng(vocab)
    x = rng.normal(size=(6, vocab)).astype("float32")
    x[0, [5, 9, 700, 900]] = 10.0  # four equal maxima, two chunks
    x[1, 130:138] = np.arange(8, 16)  # the best eight in one chunk
    x[2, -3:] = 20.0  # in the last, partly filled chunk
    x[3, :] = 1.0  # every value equal
    for k in (1, 8):
        values, indices = search_lib.top_k(ops.convert_to_tensor(x), k)
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(to_np(values), np.take_along_axis(x, order, -1))
        np.testing.assert_array_equal(np.take_along_axis(x, to_np(indices), -1), to_np(values))
        assert all(len(set(row)) == k for row in to_np(indices).tolist())
        if keras.backend.backend() != "torch":
            np.testing.assert_array_equal(to_np(indices), order)
        assert to_np(indices).dtype == np.int32
    np.testing.assert_array_equal(to_np(search_lib.argmax(ops.convert_to_tensor(x))),
                                  x.argmax(-1))
