"""Generation for language models (cached, unequal prompts, a transformers Llama oracle) and
sampling (top-k, nucleus, temperature) for both model kinds."""

import keras
import numpy as np
import pytest
import torch

from helpers import llama_and_language_model, record_traces, to_np
from keras_tfm import build_language_model, build_transformer, generate

VOCAB, PAD, END = 40, 0, 2


def small_lm(**kwargs):
    kwargs = dict(d_model=32, num_heads=4, ff_dim=64, num_layers=2, num_key_value_heads=2,
                  end_id=END) | kwargs
    return build_language_model(VOCAB, **kwargs)


PROMPTS = [[5, 9, 4, 7, 8], [7, 3], [11, 12, 13]]


def reference_continuation(lm, prompt, max_length, end_id=None):
    """Full recomputation over the whole sequence at every step, padding never chosen."""
    seq = list(prompt)
    for _ in range(max_length):
        logits = to_np(lm(np.array([seq], "int32")))[0, -1].astype("float64")
        logits[PAD] = -np.inf
        seq.append(int(logits.argmax()))
        if seq[-1] == end_id:
            break
    return seq[len(prompt):]


def right_padded(rows, width=None):
    width = width or max(map(len, rows))
    out = np.full((len(rows), width), PAD, "int32")
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@pytest.mark.parametrize("positional", ["rotary", "sinusoidal", "learned"])
def test_cached_generation_equals_full_recomputation_and_each_prompt_alone(positional):
    lm = small_lm(positional=positional, max_length=32)
    got = generate(lm, right_padded(PROMPTS, width=7), max_length=6, end_id=None)
    assert got.shape == (3, 6)
    for row, prompt in zip(got, PROMPTS):
        np.testing.assert_array_equal(row, reference_continuation(lm, prompt, 6))
        np.testing.assert_array_equal(generate(lm, [prompt], max_length=6, end_id=None)[0], row)


def test_chunks_with_a_short_last_one_equal_one_batch(monkeypatch):
    """`batch_size` chunks (2 + 2 + 1 prompts) decode what one batch does; where the search is
    compiled per shape (JAX, TensorFlow's graph per shape) the last chunk is filled up and
    nothing is traced again; the sampled draws are each row's own."""
    from keras_tfm import search

    lm = small_lm()
    prompts = PROMPTS + [[6, 6, 6, 6], [9]]
    for options in (dict(), dict(method="sample", top_k=5, seed=7)):
        whole = generate(lm, prompts, max_length=5, end_id=None, return_scores=True,
                         **options)
        search._COMPILED.pop(lm, None)
        with monkeypatch.context() as patch:
            traces = record_traces(patch, lambda shape: shape[0])
            chunked = generate(lm, prompts, max_length=5, end_id=None, return_scores=True,
                               batch_size=2, **options)
        np.testing.assert_array_equal(chunked[0], whole[0])
        np.testing.assert_allclose(chunked[1], whole[1], atol=1e-5)
        assert traces == ([2, 2, 1] if keras.backend.backend() == "torch" else [2])


def test_end_id_stops_each_row_and_scores_are_log_probabilities():
    lm = small_lm()
    unscored = generate(lm, PROMPTS, max_length=8, end_id="auto")  # (compiled apart)
    tokens, scores = generate(lm, PROMPTS, max_length=8, end_id="auto", return_scores=True)
    np.testing.assert_array_equal(unscored, tokens)
    # the model's own end id (build_language_model(end_id=2)) was used
    for row, prompt, score in zip(tokens, PROMPTS, scores):
        expected = reference_continuation(lm, prompt, 8, end_id=END)
        np.testing.assert_array_equal(row[:len(expected)], expected)
        assert (row[len(expected):] == PAD).all()
        seq, total = list(prompt), 0.0
        for token in expected:
            logits = to_np(lm(np.array([seq], "int32")))[0, -1].astype("float64")
            logits[PAD] = -np.inf
            total += logits[token] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            seq.append(token)
        np.testing.assert_allclose(score, total, rtol=1e-4, atol=1e-4)


def test_greedy_generation_equals_transformers_llama_token_for_token():
    llama, lm = llama_and_language_model(seed=1)
    prompts = np.random.default_rng(5).integers(3, 64, (3, 6))
    with torch.no_grad():
        expected = llama.generate(torch.from_numpy(prompts).long(), max_new_tokens=10,
                                  do_sample=False, suppress_tokens=[PAD], eos_token_id=None,
                                  pad_token_id=PAD).numpy()[:, 6:]
    got = generate(lm, prompts, max_length=10, end_id=None)
    np.testing.assert_array_equal(got, expected)
    assert len(set(got.ravel())) > 3  # not one repeated token


def test_generation_after_keras_file_round_trip_uses_the_saved_special_ids(tmp_path):
    lm = small_lm(pad_id=1, end_id=3)
    path = str(tmp_path / "lm.keras")
    lm.save(path)
    restored = keras.saving.load_model(path)
    prompts = [[5, 9, 4], [7]]
    np.testing.assert_array_equal(generate(restored, prompts, max_length=5),
                                  generate(lm, prompts, max_length=5))
    out = generate(lm, [[5, 9, 4], [7, 1, 1]], max_length=5, end_id=None)
    assert (out != 1).all()  # the padding id 1 is never generated


# --- sampling --------------------------------------------------------------------------------

def small_seq2seq():
    return build_transformer(VOCAB, VOCAB, d_model=32, num_heads=4, ff_dim=64,
                             num_encoder_layers=1, num_decoder_layers=1, start_id=1, end_id=END)


def first_logits(kind, model, prompt):
    """The float64 logits of the first generated token (padding excluded)."""
    if kind == "lm":
        logits = to_np(model(np.array([prompt], "int32")))[0, -1]
    else:
        logits = to_np(model([np.array([prompt], "int32"), np.array([[1]], "int32")]))[0, -1]
    logits = logits.astype("float64")
    logits[PAD] = -np.inf
    return logits


def expected_distribution(logits, temperature, top_k=None, top_p=1.0):
    """softmax(logits / T) restricted to the top-k, then to the nucleus, renormalised."""
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[:top_k or len(probs)]] = True
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    before = np.cumsum(probs[order]) - probs[order]
    keep[order[before >= top_p]] = False
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum(), keep


def draws(kind, model, prompt, n, **options):
    tokens = generate(model, [prompt] * n, max_length=1, method="sample", end_id=None,
                      **options)
    return np.bincount(tokens[:, 0], minlength=VOCAB) / n


def total_variation(p, q):
    return 0.5 * np.abs(p - q).sum()


N_DRAWS, BOUND = 8000, 0.035  # total-variation bound: ~4x its typical value at 8,000 draws


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_sampled_frequencies_match_softmax_with_temperature_and_top_k(kind):
    model = small_lm() if kind == "lm" else small_seq2seq()
    prompt = [5, 9, 4, 7]
    logits = first_logits(kind, model, prompt)
    for case in (dict(temperature=0.25), dict(temperature=0.25, top_k=3)):
        expected, keep = expected_distribution(logits, **case)
        empirical = draws(kind, model, prompt, N_DRAWS, seed=11, **case)
        assert total_variation(empirical, expected) < BOUND, case
        assert empirical[~keep].sum() == 0.0, case  # nothing outside the top-k
    # the bound tells a wrong temperature apart (unfiltered draws at T = 0.25)
    empirical = draws(kind, model, prompt, N_DRAWS, seed=11, temperature=0.25)
    for wrong in (0.25 * 1.5, 0.25 / 1.5):
        assert total_variation(empirical, expected_distribution(logits, wrong)[0]) > BOUND


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_sampled_frequencies_match_the_nucleus_and_nothing_outside_appears(kind):
    model = small_lm() if kind == "lm" else small_seq2seq()
    prompt = [5, 9, 4, 7]
    logits = first_logits(kind, model, prompt)

    def ranked_cumulative(temperature):
        return np.cumsum(np.sort(expected_distribution(logits, temperature)[0])[::-1])

    def off_by_one_gap(temperature, m):
        """How far a nucleus of m - 1 or m + 1 tokens moves the m-token distribution (TV)."""
        c = ranked_cumulative(temperature)
        return min((c[m - 1] - c[m - 2]) / c[m - 1], (c[m] - c[m - 1]) / c[m])

    # a nucleus of m tokens (top_p between the mass of m - 1 and of m tokens), with T and m
    # chosen so that an off-by-one nucleus is far outside the bound
    temperature, m = max(((t, m) for t in (0.5, 1.0) for m in range(2, 7)),
                         key=lambda tm: off_by_one_gap(*tm))
    assert off_by_one_gap(temperature, m) > 3 * BOUND, "no usable nucleus in these logits"
    cumulative = ranked_cumulative(temperature)
    top_p = float((cumulative[m - 2] + cumulative[m - 1]) / 2)
    expected, keep = expected_distribution(logits, temperature, top_p=top_p)
    assert keep.sum() == m
    empirical = draws(kind, model, prompt, N_DRAWS, seed=11, temperature=temperature,
                      top_p=top_p)
    assert total_variation(empirical, expected) < BOUND
    assert empirical[~keep].sum() == 0.0  # tokens outside the nucleus never appear
    for wrong in (cumulative[m - 2] - 1e-4, cumulative[m] - 1e-4):  # m - 1 or m + 1 tokens
        off_by_one, wrong_keep = expected_distribution(logits, temperature, top_p=float(wrong))
        assert wrong_keep.sum() in (m - 1, m + 1)
        assert total_variation(empirical, off_by_one) > BOUND


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_top_k_one_is_greedy_and_a_seed_repeats_its_draws(kind):
    model = small_lm() if kind == "lm" else small_seq2seq()
    prompts = right_padded(PROMPTS)
    greedy = generate(model, prompts, max_length=6, end_id=None)
    sampled = generate(model, prompts, max_length=6, end_id=None, method="sample", top_k=1,
                       seed=4)
    np.testing.assert_array_equal(sampled, greedy)
    options = dict(max_length=6, end_id=None, method="sample", temperature=2.0, seed=7)
    first, again = generate(model, prompts, **options), generate(model, prompts, **options)
    np.testing.assert_array_equal(first, again)
    other = generate(model, prompts, **options | {"seed": 8})
    assert (other != first).any()


def test_sampling_and_language_model_errors_name_the_values():
    lm = small_lm()
    with pytest.raises(ValueError, match="temperature=0"):
        generate(lm, PROMPTS, max_length=3, method="sample", temperature=0)
    with pytest.raises(ValueError, match="temperature=-1.0"):
        generate(small_seq2seq(), PROMPTS, max_length=3, method="sample", temperature=-1.0)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"`top_p` must be in \(0, 1\]; received top_p={top_p}"):
            generate(lm, PROMPTS, max_length=3, method="sample", top_p=top_p)
    with pytest.raises(ValueError, match="top_k=0"):
        generate(lm, PROMPTS, max_length=3, method="sample", top_k=0)
    with pytest.raises(ValueError, match="'nucleus'"):
        generate(lm, PROMPTS, max_length=3, method="nucleus")
    with pytest.raises(ValueError, match='received method="beam"'):
        generate(lm, PROMPTS, max_length=3, method="beam")
    with pytest.raises(ValueError, match="start_id=1"):
        generate(lm, PROMPTS, max_length=3, start_id=1)
    with pytest.raises(ValueError, match="prompt 1 is only padding"):
        generate(lm, [[5, 6], [0, 0]], max_length=3)
    with pytest.raises(ValueError, match="has no end_id of its own"):
        generate(small_lm(end_id=None), PROMPTS, max_length=3)
    learned = small_lm(positional="learned", max_length=8)
    with pytest.raises(ValueError, match=r"longest prompt \(5 tokens\) plus max_length=4"):
        generate(learned, PROMPTS, max_length=4)
