"""KV-cached greedy and beam search (keras_tfm.generate)."""

import keras
import numpy as np
import pytest
from keras import ops

from helpers import BACKEND, record_traces, to_np
from keras_tfm import build_transformer, generate
from keras_tfm import generation
from keras_tfm import search as search_lib
from keras_tfm.generation import Seq2SeqParts

SOS, EOS = 1, 2


def small_model(norm_first=False, **kwargs):
    return build_transformer(20, 22, d_model=32, num_heads=4, ff_dim=64, num_encoder_layers=2,
                             num_decoder_layers=2, norm_first=norm_first, **kwargs)


def sources(seed=0, batch=4, length=9):
    rng = np.random.default_rng(seed)
    src = rng.integers(3, 20, (batch, length)).astype("int32")
    src[1, 5:] = 0
    src[2, 2:] = 0
    return src


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_greedy(model, src, max_length):
    """Full recomputation at every step (the keras.io example's loop), PAD never chosen."""
    dec = np.full((len(src), 1), SOS, "int32")
    scores = np.zeros(len(src))
    done = np.zeros(len(src), bool)
    for _ in range(max_length):
        logits = to_np(model([src, dec]))[:, -1].astype("float64")
        logits[:, 0] = -1e9
        log_probs = np_log_softmax(logits)
        chosen = log_probs.argmax(-1)
        scores += np.where(done, 0.0, log_probs[np.arange(len(src)), chosen])
        chosen = np.where(done, 0, chosen)
        done |= chosen == EOS
        dec = np.concatenate([dec, chosen[:, None].astype("int32")], axis=1)
        if done.all():
            break
    return dec[:, 1:], scores


@pytest.mark.parametrize("norm_first,rows", [(False, 3), (True, 3), (True, 1)])
def test_cached_step_logits_equal_a_full_forward_pass(norm_first, rows):
    """The model's `call_with_cache`, one token a step, at three rows and at one."""
    model = small_model(norm_first)
    src = sources(1, batch=3)[-rows:]  # (the last: padded)
    dec = np.random.default_rng(2).integers(3, 22, (rows, 7)).astype("int32")
    dec[:, 0] = SOS
    full = to_np(model([src, dec]))
    cache = model.initial_cache(src, 7)
    for i in range(7):
        logits, cache = model.call_with_cache(dec[:, i:i + 1], cache, i)
        np.testing.assert_allclose(to_np(logits)[:, 0], full[:, i], atol=1e-4)


@pytest.mark.parametrize("norm_first", [False, True])
def test_greedy_equals_full_recomputation(norm_first):
    """Tokens and scores; a search without scores (which skips their log-sum-exp) is compiled
    apart and gives the same tokens."""
    model = small_model(norm_first)
    src = sources(3)
    unscored = generate(model, src, SOS, EOS, max_length=8)
    tokens, scores = generate(model, src, SOS, EOS, max_length=8, return_scores=True)
    np.testing.assert_array_equal(unscored, tokens)
    expected, expected_scores = reference_greedy(model, src, 8)
    np.testing.assert_array_equal(tokens, expected[:, :tokens.shape[1]])
    assert (expected[:, tokens.shape[1]:] == 0).all()
    np.testing.assert_allclose(scores, expected_scores, atol=1e-3)


def test_beam_size_one_equals_greedy_and_beam_is_not_worse():
    model = small_model()
    src = sources(4, batch=6)
    greedy, greedy_scores = generate(model, src, SOS, EOS, 10, return_scores=True)
    one, one_scores = generate(model, src, SOS, EOS, 10, method="beam", beam_size=1,
                               return_scores=True)
    np.testing.assert_array_equal(one, greedy)
    np.testing.assert_allclose(one_scores, greedy_scores, atol=1e-4)
    beam, beam_scores = generate(model, src, SOS, EOS, 10, method="beam", beam_size=4,
                                 return_scores=True)

    def penalised(tokens, scores, alpha=0.6):
        lengths = (tokens != 0).sum(1)
        return scores / ((5.0 + lengths) / 6.0) ** alpha

    assert (penalised(beam, beam_scores) >= penalised(greedy, greedy_scores) - 1e-4).all()
    # The returned log-probability is the model's own for the returned tokens.
    dec = np.concatenate([np.full((6, 1), SOS), beam], 1).astype("int32")
    logits = to_np(model([src, dec[:, :-1]])).astype("float64")
    logits[..., 0] = -1e9
    log_probs = np.take_along_axis(np_log_softmax(logits), beam[..., None], -1)[..., 0]
    np.testing.assert_allclose((log_probs * (beam != 0)).sum(1), beam_scores, atol=1e-3)


def test_beam_candidates_are_the_best_of_all_beams_and_tokens():
    """The 2k best continuations from each beam's 2k largest logits equal the 2k best of the
    whole log-softmax over every (beam, token): values, beams and tokens."""
    rng = np.random.default_rng(3)
    batch, k, vocab, count = 3, 4, 50, 8
    logits = rng.normal(0.0, 3.0, (batch * k, vocab)).astype("float32")
    alive = rng.normal(-5.0, 2.0, (batch, k)).astype("float32")
    alive[0, 1:] = search_lib.NEG_INF  # a first step: one live beam
    values, beams, tokens = search_lib._beam_candidates(
        ops.convert_to_tensor(logits), ops.convert_to_tensor(alive), count)
    full = (alive[:, :, None] + np_log_softmax(logits.astype("float64")).reshape(batch, k, vocab))
    full = full.reshape(batch, k * vocab)
    best = np.argsort(-full, axis=1)[:, :count]
    np.testing.assert_allclose(to_np(values), np.take_along_axis(full, best, 1), atol=1e-4)
    np.testing.assert_array_equal(to_np(beams), best // vocab)
    np.testing.assert_array_equal(to_np(tokens), best % vocab)
    assert (to_np(beams)[0] == 0).all() and len(set(to_np(beams)[1].tolist())) > 1


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_eos_stops_and_max_length_is_respected(method):
    model = small_model()
    src = sources(5, batch=5)
    free = generate(model, src, SOS, EOS, 12, method=method)
    assert free.shape[1] <= 12
    # Take as end token the first token some sequence emits: it must stop right there.
    end_id = int(free[0, 0])
    tokens = generate(model, src, SOS, end_id, 12, method=method)
    assert tokens.shape[1] <= 12
    for row in tokens:
        hits = np.flatnonzero(row == end_id)
        if hits.size:
            assert (row[hits[0] + 1:] == 0).all()
            assert (row[:hits[0]] != 0).all()
        else:
            assert (row != 0).all() and len(row) == tokens.shape[1]
    assert tokens[0, 0] == end_id and (tokens[0, 1:] == 0).all()
    short = generate(model, src, SOS, EOS, 3, method=method)
    assert short.shape[1] <= 3


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_batch_of_one_equals_the_same_source_in_a_batch(method):
    model = small_model(norm_first=True)
    src = sources(6, batch=5)
    batch = generate(model, src, SOS, EOS, 8, method=method, beam_size=3)
    for i in (1, 2):
        alone = generate(model, src[i:i + 1, :int((src[i] != 0).sum())], SOS, EOS, 8,
                         method=method, beam_size=3)
        np.testing.assert_array_equal(alone[0], batch[i, :alone.shape[1]])
        assert (batch[i, alone.shape[1]:] == 0).all()


def test_unnamed_final_norm_is_refused():
    model = small_model(norm_first=True)
    inputs = model.inputs
    renamed = keras.layers.LayerNormalization(name="final_norm")(model.outputs[0])
    with pytest.raises(ValueError, match="final_norm.*'encoder_norm' and 'decoder_norm'"):
        generate(keras.Model(inputs, renamed), sources(11), SOS, EOS, 4)


def test_hand_built_model_and_tied_embeddings_decode():
    from test_model import build_by_hand

    model = build_by_hand(20, 22, 16, 2, 32, 2)
    src = sources(7)
    tokens, scores = generate(model, src, SOS, EOS, 6, return_scores=True)
    expected, expected_scores = reference_greedy(model, src, 6)
    np.testing.assert_array_equal(tokens, expected[:, :tokens.shape[1]])
    tied = small_model(tie_embeddings=True, positional="learned", max_length=16)
    tokens = generate(tied, src, SOS, EOS, 6)
    np.testing.assert_array_equal(tokens, reference_greedy(tied, src, 6)[0][:, :tokens.shape[1]])


def test_compiled_once_per_settings_and_sees_new_weights(monkeypatch):
    model = small_model()
    src = sources(8)
    traces = record_traces(monkeypatch)
    first = generate(model, src, SOS, EOS, 6)
    second = generate(model, src, SOS, EOS, 6)
    np.testing.assert_array_equal(first, second)
    if BACKEND in ("jax", "tensorflow"):
        assert len(traces) == 1  # traced and compiled once, then reused
    else:
        assert len(traces) == 2  # torch runs the loop eagerly (under torch.no_grad)
    # New weights are used without a stale compiled copy.
    for weight in model.get_layer("logits").weights:
        weight.assign(ops.zeros(weight.shape, weight.dtype))
    bias = model.get_layer("logits").bias
    bias.assign(ops.convert_to_tensor(np.eye(22)[5] * 10.0, bias.dtype))
    np.testing.assert_array_equal(generate(model, src, SOS, EOS, 3), np.full((4, 3), 5))


def test_chunks_with_progress_equal_one_batch():
    model = small_model()
    src = sources(9, batch=5)
    whole = generate(model, src, SOS, EOS, 6)
    chunked = generate(model, src, SOS, EOS, 6, batch_size=2, verbose=True)
    np.testing.assert_array_equal(chunked[:, :whole.shape[1]], whole)


def test_chunks_run_shortest_sources_first_where_shapes_are_free(monkeypatch):
    """Where a chunk is not compiled per shape (PyTorch; TensorFlow's graph below `_XLA_ROWS`
    rows), the sources run shortest first, each chunk cut to its longest source; under JAX in
    the order given at the bucket's width. Either way the tokens and scores come back in the
    order given, those of one batch."""
    model = small_model()
    rng = np.random.default_rng(3)
    src = np.zeros((7, 9), "int32")
    for row, n in enumerate([9, 2, 6, 4, 9, 1, 7]):
        src[row, :n] = rng.integers(3, 20, n)
    for method, beams in (("greedy", 1), ("beam", 2)):
        whole, whole_scores = generate(model, src, SOS, EOS, 6, method=method,
                                       beam_size=beams, return_scores=True)
        search_lib._COMPILED.pop(model, None)
        shapes, compile_search = [], search_lib._compile
        monkeypatch.setattr(search_lib, "_compile", lambda *a, **k: (
            lambda run: lambda *x: shapes.append(tuple(x[0].shape)) or run(*x))(
                compile_search(*a, **k)))
        chunked, scores = generate(model, src, SOS, EOS, 6, method=method, beam_size=beams,
                                   return_scores=True, batch_size=3)
        monkeypatch.undo()
        np.testing.assert_array_equal(chunked, whole)
        np.testing.assert_allclose(scores, whole_scores, atol=1e-5)
        # lengths 1, 2, 4 | 6, 7, 9 | 9 (JAX: 3 rows each, the bucket's 16 positions)
        assert shapes == ([(3, 16)] * 3 if BACKEND == "jax" else [(3, 4), (3, 9), (1, 9)])


def test_a_short_last_chunk_compiles_nothing_new(monkeypatch):
    """Where the search compiles per shape (JAX; TensorFlow's XLA from `_XLA_ROWS` rows: here
    9 sources × 2 beams) the last chunk is filled up to `batch_size` rows (copies of its first
    row, dropped), so it reuses the compiled search; tokens and scores are those of one batch."""
    model = small_model()
    src = sources(4, batch=15)
    whole, whole_scores = generate(model, src, SOS, EOS, 6, method="beam", beam_size=2,
                                   return_scores=True)
    search_lib._COMPILED.pop(model, None)
    traces = record_traces(monkeypatch, lambda shape: shape[0])
    chunked, scores = generate(model, src, SOS, EOS, 6, method="beam", beam_size=2,
                               return_scores=True, batch_size=9)  # 9 + 6 sources
    assert chunked.shape[0] == scores.shape[0] == 15
    np.testing.assert_array_equal(chunked[:, :whole.shape[1]], whole)
    np.testing.assert_allclose(scores, whole_scores, atol=1e-5)
    if BACKEND in ("jax", "tensorflow"):
        assert traces == [9]
    else:  # torch runs eagerly: nothing to reuse, no padding
        assert traces == [9, 6]


class FixedDistribution:
    """A stand-in decoder for the search alone: every step gives the same next-token
    distribution over PAD, SOS, EOS, A, B (the search only calls `call_with_cache`)."""

    def __init__(self, probabilities):
        self.logits = np.log(np.asarray(probabilities, "float32"))

    def call_with_cache(self, tokens, cache, index):
        logits = ops.tile(ops.convert_to_tensor(self.logits)[None, None], (tokens.shape[0], 1, 1))
        return logits, cache


def fixed_search(decoder, strategy, sources=2, max_length=10):
    rows = sources * strategy.beams
    cache = {"self": [ops.zeros((rows, 1, max_length, 1))]}
    settings = search_lib.Settings(strategy, max_length, EOS, 0)
    return search_lib.search(decoder, settings, cache, ops.full((rows, 1), SOS, "int32"),
                             ops.ones((rows,), "int32"))


def test_beam_keeps_a_better_unfinished_beam_over_an_early_eos():
    # p(A) = 0.95, p(EOS) = 0.03: stopping at once scores log 0.03 = -3.5, ten A's score
    # 10 log 0.95 / ((5 + 10) / 6)^0.6 = -0.30, so the cut beam must win over the early EOS.
    parts = FixedDistribution([1e-6, 1e-6, 0.03, 0.95, 0.02])
    greedy, greedy_scores = fixed_search(parts, search_lib.Greedy())
    np.testing.assert_array_equal(to_np(greedy), np.full((2, 10), 3))
    for k in (1, 2):
        tokens, scores = fixed_search(parts, search_lib.Beam(k, 0.6))
        np.testing.assert_array_equal(to_np(tokens), np.full((2, 10), 3))
        np.testing.assert_allclose(to_np(scores), to_np(greedy_scores), rtol=1e-4)
    # With EOS far more likely, the one-token hypothesis wins.
    parts = FixedDistribution([1e-6, 1e-6, 0.6, 0.3, 0.1])
    tokens, _ = fixed_search(parts, search_lib.Beam(2, 0.6))
    np.testing.assert_array_equal(to_np(tokens)[:, 0], EOS)
    assert (to_np(tokens)[:, 1:] == 0).all()


def test_bad_input_is_a_clear_error():
    model = small_model()
    src = sources(10)
    with pytest.raises(ValueError, match=r"start_id.*\[0, 22\).*start_id=22"):
        generate(model, src, 22, EOS, 5)
    with pytest.raises(ValueError, match="end_id=-1"):
        generate(model, src, SOS, -1, 5)
    with pytest.raises(ValueError, match="beam_size"):
        generate(model, src, SOS, EOS, 5, method="beam", beam_size=0)
    with pytest.raises(ValueError, match="max_length"):
        generate(model, src, SOS, EOS, 0)
    with pytest.raises(ValueError, match="method"):
        generate(model, src, SOS, EOS, 5, method="nucleus")
    with pytest.raises(ValueError, match=r"shape \(batch, length\)"):
        generate(model, src[0], SOS, EOS, 5)
    with pytest.raises(ValueError, match="start_id.*padding id"):
        generate(model, src, 0, EOS, 5)
    with pytest.raises(ValueError, match="length_penalty"):
        generate(model, src, SOS, EOS, 5, method="beam", length_penalty=-1.0)
    with pytest.raises(ValueError, match="beam_size.*11 is too large"):
        generate(model, src, SOS, EOS, 5, method="beam", beam_size=11)
    with pytest.raises(ValueError, match="batch_size"):
        generate(model, src, SOS, EOS, 5, batch_size=0)
    learned = small_model(positional="learned", max_length=6)
    with pytest.raises(ValueError, match="max_length.*=7.*learned position table"):
        generate(learned, src, SOS, EOS, 7)
    with pytest.raises(ValueError, match="length 9 exceed the encoder's learned position table"):
        generate(learned, src, SOS, EOS, 5)  # src has 9 tokens, the table 6
    encoder_only = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not a keras_tfm encoder-decoder"):
        generate(encoder_only, src, SOS, EOS, 5)


def test_special_ids_come_from_the_model_and_explicit_ones_win():
    model = small_model(start_id=SOS, end_id=EOS)
    assert model.special_ids == {"pad_id": 0, "start_id": SOS, "end_id": EOS}
    src = sources(11)
    np.testing.assert_array_equal(generate(model, src, max_length=6),
                                  generate(model, src, SOS, EOS, 6))
    never_stops = generate(model, src, end_id=None, max_length=6)
    assert never_stops.shape == (4, 6) and (never_stops != 0).all()
    np.testing.assert_array_equal(never_stops, generate(model, src, SOS, None, 6))
    with pytest.raises(ValueError, match="end_id.*must not be the padding id 0.*end_id=None"):
        generate(model, src, end_id=0, max_length=6)
    bare = small_model()
    with pytest.raises(ValueError, match="`start_id` was not given.*no start_id of its own"):
        generate(bare, src, max_length=6)
    with pytest.raises(ValueError, match="`end_id` was not given.*end_id=None"):
        generate(bare, src, start_id=SOS, max_length=6)
    with pytest.raises(ValueError, match=r"pad_id.*\[0, 22\)"):
        generate(model, src, max_length=6, pad_id=40)


def test_a_model_padding_with_another_id_decodes_as_with_zero():
    """The same weights, ids permuted so that padding is the last id: the same translation."""
    zero = small_model()
    last = build_transformer(20, 22, d_model=32, num_heads=4, ff_dim=64, num_encoder_layers=2,
                             num_decoder_layers=2, pad_id=19, start_id=SOS, end_id=EOS)
    source_perm = np.arange(20)
    source_perm[[0, 19]] = [19, 0]
    target_perm = np.arange(22)
    target_perm[[0, 19]] = [19, 0]
    for a, b in zip(zero.weights, last.weights):
        value = to_np(a)
        if a.path.startswith("encoder_embedding") and "token" in a.path:
            value = value[np.argsort(source_perm)]
        elif a.path.startswith("decoder_embedding") and "token" in a.path:
            value = value[np.argsort(target_perm)]
        elif a.path.startswith("logits"):
            value = value[..., np.argsort(target_perm)]
        b.assign(value)
    src = sources(12)
    dec = np.concatenate([np.full((4, 1), SOS), src[:, :5]], axis=1) % 22
    real = dec != 0
    np.testing.assert_allclose(
        to_np(last([source_perm[src], target_perm[dec]]))[..., target_perm][real],
        to_np(zero([src, dec]))[real], atol=1e-5)
    ours = generate(last, source_perm[src], end_id=None, max_length=7)
    np.testing.assert_array_equal(ours, target_perm[generate(zero, src, SOS, None, 7)])
    assert 19 not in ours  # the padding id is never generated


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_length_buckets_pad_the_sources_without_changing_tokens(method):
    """Sources right-padded to a bucket decode the same tokens and scores: padding is masked."""
    model = small_model()
    for length in (3, 6, 9):
        src = sources(20 + length, batch=3, length=length)
        plain = generate(model, src, SOS, EOS, 7, method=method, beam_size=2,
                         return_scores=True, length_buckets=None)
        for buckets in ("auto", (4, 16), [32]):
            tokens, scores = generate(model, src, SOS, EOS, 7, method=method, beam_size=2,
                                      return_scores=True, length_buckets=buckets)
            np.testing.assert_array_equal(tokens, plain[0])
            np.testing.assert_allclose(scores, plain[1], atol=1e-5)


def test_one_compilation_per_length_bucket(monkeypatch):
    model = small_model()
    traces = record_traces(monkeypatch, lambda shape: shape[1])
    for length in (3, 5, 8, 9, 12):  # buckets 8, 8, 8, 16, 16
        generate(model, sources(length, batch=3, length=length), SOS, EOS, 4)
    if BACKEND == "jax":
        assert traces == [8, 16]
    elif BACKEND == "tensorflow":  # no padding: one graph of unknown lengths for all
        assert traces == [None]
    else:  # torch runs eagerly: no compilation to save, no padding ("auto")
        assert traces == [3, 5, 8, 9, 12]


def test_searches_of_xla_rows_or_more_compile_per_bucket(monkeypatch):
    """From `_XLA_ROWS` rows (sources × beams) TensorFlow compiles the search with XLA, once
    per bucketed shape, as JAX does; the tokens and scores equal those of the same sources
    decoded in chunks of fewer rows (TensorFlow's one graph of unknown dimensions)."""
    model = small_model()
    assert search_lib.XLA_ROWS == 17  # (the sources below are sized around it)
    src = np.concatenate([sources(5, batch=9), sources(6, batch=8)])  # 17 of length 9 (bucket 16)
    for method, beams in (("greedy", 1), ("beam", 2)):
        small = generate(model, src, SOS, EOS, 7, method=method, beam_size=beams,
                         return_scores=True, batch_size=2)  # 2 or 4 rows a chunk
        whole = generate(model, src, SOS, EOS, 7, method=method, beam_size=beams,
                         return_scores=True)  # 17 or 34 rows
        np.testing.assert_array_equal(whole[0], small[0])
        np.testing.assert_allclose(whole[1], small[1], atol=1e-5)
    search_lib._COMPILED.pop(model, None)
    traces = record_traces(monkeypatch)
    for length in (3, 9, 12):  # buckets 8, 12, 12 (from 16 rows "auto" has halfway buckets)
        generate(model, sources(length, batch=17, length=length), SOS, EOS, 4)
    generate(model, sources(2, batch=16), SOS, EOS, 4)  # 16 rows: below the bar
    if BACKEND == "jax":
        assert traces == [(17, 8), (17, 12), (16, 12)]
    elif BACKEND == "tensorflow":  # XLA per shape, then the graph of unknown dimensions
        assert traces == [(17, 8), (17, 12), (None, None)]
    else:  # torch runs eagerly, no padding
        assert traces == [(17, 3), (17, 9), (17, 12), (16, 9)]


def test_bucket_padding_and_its_limits():
    model = small_model()
    embedding = Seq2SeqParts.from_model(model).encoder_embedding
    src = sources(30, batch=3, length=9)
    padded = generation._bucket_sources(src, (4, 16, 32), 0, embedding, 3)
    assert padded.shape == (3, 16)
    np.testing.assert_array_equal(padded[:, :9], src)
    assert (padded[:, 9:] == 0).all()
    assert generation._bucket_sources(src, (4, 8), 0, embedding, 3) is src  # longer than all
    assert generation._bucket_sources(src, None, 0, embedding, 3) is src
    learned = Seq2SeqParts.from_model(small_model(positional="learned", max_length=12))
    assert generation._bucket_sources(src, (16,), 0, learned.encoder_embedding, 3) is src
    assert generation._bucket_sources(src, (10, 16), 0, learned.encoder_embedding, 3).shape == (
        3, 10)
    # "auto": buckets where such searches compile; powers of two, and from 16 rows their
    # halfway points too (9 -> 16 or 12)
    for rows, width in ((3, 16), (generation._FINE_BUCKET_ROWS, 12), (search_lib.XLA_ROWS, 12)):
        auto = generation._bucket_sources(src, "auto", 0, embedding, rows)
        per_shape = BACKEND == "jax" or (BACKEND == "tensorflow" and rows >= search_lib.XLA_ROWS)
        assert auto.shape == ((3, width) if per_shape else (3, 9))
    assert generation._FINE_BUCKETS[:8] == [8, 12, 16, 24, 32, 48, 64, 96]
    for bad in ((16, 8), (0, 8), "powers", (8.0,), ()):
        with pytest.raises(ValueError, match="length_buckets.*increasing sequence"):
            generate(model, src, SOS, EOS, 3, length_buckets=bad)


def test_the_compile_cache_per_model_is_bounded():
    model = small_model()
    src = sources(31, batch=3, length=4)
    for max_length in range(1, 12):
        generate(model, src, SOS, EOS, max_length)
    kept = search_lib._COMPILED[model][1]
    assert len(kept) == search_lib.MAX_COMPILED
    assert [key[1].max_length for key in kept] == list(range(4, 12))  # the most recently used
    generate(model, src, SOS, EOS, 5)  # a hit moves to the end
    assert list(kept)[-1][1].max_length == 5 and len(kept) == search_lib.MAX_COMPILED


def test_generate_after_quantize_runs_the_quantized_weights():
    model = small_model(start_id=SOS, end_id=EOS)
    src = np.concatenate([sources(13, batch=9), sources(12, batch=8)])  # TensorFlow's XLA: 17 rows
    _, before = generate(model, src, end_id=None, max_length=6, return_scores=True)
    model.quantize("int8")
    _, after = generate(model, src, end_id=None, max_length=6, return_scores=True)
    search_lib._COMPILED.pop(model)  # a search compiled afresh
    _, fresh = generate(model, src, end_id=None, max_length=6, return_scores=True)
    np.testing.assert_allclose(after, fresh, rtol=1e-5)
    assert np.abs(after - before).max() > 1e-4


def test_hand_built_model_with_grouped_query_attention_decodes():
    from keras_tfm import TokenAndPositionEmbedding, TransformerDecoderBlock, TransformerEncoderBlock

    encoder_tokens = keras.Input((None,), dtype="int32")
    decoder_tokens = keras.Input((None,), dtype="int32")
    x = TokenAndPositionEmbedding(20, 16, name="encoder_embedding")(encoder_tokens)
    x = TransformerEncoderBlock(4, 32, dropout=0.0, num_key_value_heads=2)(x)
    y = TokenAndPositionEmbedding(22, 16, name="decoder_embedding")(decoder_tokens)
    y = TransformerDecoderBlock(4, 32, dropout=0.0, num_key_value_heads=1)(y, x)
    model = keras.Model([encoder_tokens, decoder_tokens],
                        keras.layers.Dense(22, name="logits")(y))
    src = sources(14)
    tokens, scores = generate(model, src, SOS, EOS, 6, return_scores=True)
    expected, expected_scores = reference_greedy(model, src, 6)
    np.testing.assert_array_equal(tokens, expected[:, :tokens.shape[1]])
    np.testing.assert_allclose(scores, expected_scores, rtol=1e-4, atol=1e-4)
