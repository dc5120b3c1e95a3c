"""Nothing silent (issue 20): bad token ids, masks in other conventions, unreadable files and
quantized models give a clear error or a NaN, the same on every backend."""

import json
import zipfile

import keras
import numpy as np
import pytest
from keras import ops

from helpers import BACKEND, jit_options, to_np
from keras_tfm import (MaskedSparseCategoricalCrossentropy, MultiHeadSelfAttention,
                       TokenAndPositionEmbedding, TransformerEncoderBlock, build_transformer, check_token_ids, generate,
                       masks, saving, scaled_dot_product_attention)
from reverse_task_data import reverse_task

VOCAB = 20


def small_model(**kwargs):
    return build_transformer(VOCAB, VOCAB, d_model=16, num_heads=2, ff_dim=32,
                             num_encoder_layers=1, num_decoder_layers=1, dropout=0.0, **kwargs)


def random_ids(shape, seed=0):
    return np.random.default_rng(seed).integers(3, VOCAB, shape).astype("int32")


# --- token ids ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, what", [(VOCAB, "20"), (-1, "-1"), (3.5, "3.5")])
def test_check_token_ids_names_value_position_and_vocabulary(bad, what):
    ids = random_ids((3, 5)).astype("float64" if bad == 3.5 else "int32")
    ids[2, 4] = bad
    with pytest.raises(ValueError, match=rf"{what}.*\(2, 4\)") as error:
        check_token_ids(ids, VOCAB, name="source_tokens")
    assert "source_tokens" in str(error.value)
    if bad != 3.5:
        assert f"[0, {VOCAB})" in str(error.value)
    with pytest.raises(ValueError, match=r"rank 2.*\(5,\)"):
        check_token_ids(ids[0], VOCAB)
    with pytest.raises(ValueError, match="integer token ids.*bool"):
        check_token_ids(ids > 4, VOCAB)
    whole = check_token_ids(random_ids((2, 3)).astype("float32"), VOCAB)
    assert whole.dtype == np.int32


def test_check_token_ids_takes_backend_tensors():
    """A backend tensor (on any device: NumPy cannot read a CUDA torch tensor) is checked like
    an array."""
    ids = random_ids((2, 3))
    np.testing.assert_array_equal(check_token_ids(ops.convert_to_tensor(ids), VOCAB), ids)
    ids[1, 2] = VOCAB
    with pytest.raises(ValueError, match=rf"{VOCAB}.*\(1, 2\)"):
        check_token_ids(ops.convert_to_tensor(ids), VOCAB)


@pytest.mark.parametrize("bad", [VOCAB, -1, 3.5])
def test_generate_refuses_bad_source_ids(bad):
    model = small_model()
    source = random_ids((2, 4)).astype("float64")
    source[1, 2] = bad
    with pytest.raises(ValueError, match=rf"\(1, 2\).*" if bad == 3.5 else
                       rf"{bad}.*\(1, 2\).*\[0, {VOCAB}\)"):
        generate(model, source, start_id=1, end_id=2, max_length=3)


def test_predict_with_an_id_outside_the_vocabulary_gives_nan_rows():
    model = small_model()
    src, tgt = random_ids((3, 5)), random_ids((3, 4), seed=1)
    good = to_np(model.predict([src, tgt], verbose=0))
    for position, bad in (((1, 2), VOCAB), ((1, 0), -1)):
        src_bad = src.copy()
        src_bad[position] = bad
        logits = to_np(model.predict([src_bad, tgt], verbose=0))
        assert np.isnan(logits[1]).all()  # the bad row, on every backend
        np.testing.assert_allclose(logits[[0, 2]], good[[0, 2]], atol=1e-5)
    tgt_bad = tgt.copy()
    tgt_bad[0, 3] = VOCAB + 5  # a decoder input outside the target vocabulary
    assert np.isnan(to_np(model.predict([src, tgt_bad], verbose=0))[0]).all()


def test_fit_with_an_id_outside_the_vocabulary_has_no_finite_loss():
    """Targets >= vocabulary, or padded with another library's -100 / -1, and source ids
    outside the vocabulary: the loss is NaN on every backend (torch gave a finite one)."""
    src, dec_in, tgt = reverse_task(32, vocab_size=VOCAB, seed=0)
    model = small_model()
    model.compile(optimizer="adam", loss=MaskedSparseCategoricalCrossentropy(), **jit_options())
    assert np.isfinite(model.evaluate([src, dec_in], tgt, batch_size=32, verbose=0))
    for bad_target in (VOCAB, -100, -1):
        bad = tgt.copy()
        bad[tgt == 0] = bad_target if bad_target < 0 else 0  # another library's padding
        bad[5, 0] = bad_target
        loss = model.evaluate([src, dec_in], bad, batch_size=32, verbose=0)
        assert np.isnan(loss), (bad_target, loss)
    bad_src = src.copy()
    bad_src[3, 1] = VOCAB + 2
    assert np.isnan(model.evaluate([bad_src, dec_in], tgt, batch_size=32, verbose=0))
    bad = tgt.copy()
    bad[5, 0] = VOCAB
    history = model.fit([src, dec_in], bad, batch_size=32, epochs=1, verbose=0)
    assert np.isnan(history.history["loss"][0])


def test_masked_loss_ignores_a_custom_ignore_class_but_not_other_negatives():
    logits = np.random.default_rng(0).normal(size=(1, 3, 5)).astype("float32")
    loss = MaskedSparseCategoricalCrossentropy(ignore_class=-100)
    assert np.isfinite(to_np(loss(np.array([[1, 2, -100]]), logits)))
    assert np.isnan(to_np(loss(np.array([[1, 2, -1]]), logits)))


# --- masks --------------------------------------------------------------------------------------

def qkv(batch=2, query=3, key=5, heads=2, width=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(batch, query, heads, width)).astype("float32"),
            rng.normal(size=(batch, key, heads, width)).astype("float32"),
            rng.normal(size=(batch, key, heads, width)).astype("float32"))


def test_additive_and_negative_float_masks_are_refused_with_the_conversion():
    q, k, v = qkv()
    causal = np.tril(np.ones((3, 5)), k=2)
    additive = np.where(causal > 0, 0.0, -np.inf).astype("float32")  # the seeds' causal form
    for mask in (additive, np.where(causal > 0, 0.0, -1e9), causal - 1.0):
        with pytest.raises(ValueError, match="only 0 and 1.*m == 0.*from_pad_indicator"):
            scaled_dot_product_attention(q, k, v, mask=mask[None])
    layer = MultiHeadSelfAttention(num_heads=2)
    x = np.random.default_rng(1).normal(size=(2, 5, 8)).astype("float32")
    with pytest.raises(ValueError, match="only 0 and 1"):
        layer(x, attention_mask=np.where(np.tril(np.ones((5, 5))) > 0, 0.0, -np.inf))
    # 0/1 floats are accepted as 1 = may attend, and equal the boolean mask
    ones = np.tril(np.ones((5, 5), "float32"))
    np.testing.assert_allclose(to_np(layer(x, attention_mask=ones)),
                               to_np(layer(x, attention_mask=ones > 0)), atol=1e-6)


def test_seed_pad_indicator_as_attention_mask_points_to_mask_and_conversion():
    """The seeds' PAD mask (1 = padding, (B, S)) given as `attention_mask`: refused, naming the
    shape passed and `mask=`; converted with from_pad_indicator and passed as `mask=` it works."""
    x = np.random.default_rng(1).normal(size=(2, 5, 8)).astype("float32")
    pad_indicator = np.array([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], "float32")
    layer = MultiHeadSelfAttention(num_heads=2)
    with pytest.raises(ValueError, match=r"shape \(2, 5\).*padding mask.*`mask=`"):
        layer(x, attention_mask=pad_indicator)
    block = TransformerEncoderBlock(num_heads=2, ff_dim=16)
    with pytest.raises(ValueError, match=r"shape \(2, 5\).*`mask=`"):
        block(x, attention_mask=pad_indicator > 0)
    out = to_np(layer(x, mask=masks.from_pad_indicator(pad_indicator)))
    changed = x.copy()
    changed[0, 3:] += 10.0  # padding keys of row 0
    out_changed = to_np(layer(changed, mask=masks.from_pad_indicator(pad_indicator)))
    np.testing.assert_allclose(out_changed[0, :3], out[0, :3], atol=1e-5)


def test_attention_function_checks_its_mask_shape_on_every_backend():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"`mask` of shape \(2, 5\).*\(2, 3, 5\)"):
        scaled_dot_product_attention(q, k, v, mask=np.ones((2, 5), bool))
    with pytest.raises(ValueError, match=r"`mask` of shape \(2, 4, 5\)"):
        scaled_dot_product_attention(q, k, v, mask=np.ones((2, 4, 5), bool))
    # a (T, S) mask broadcasts over the batch
    causal = np.tril(np.ones((3, 5), bool), k=2)
    np.testing.assert_allclose(to_np(scaled_dot_product_attention(q, k, v, mask=causal)),
                               to_np(scaled_dot_product_attention(q, k, v, mask=causal[None])),
                               atol=1e-6)


# --- files --------------------------------------------------------------------------------------

def test_load_model_names_what_is_wrong_with_a_file_that_is_not_an_archive(tmp_path):
    path = tmp_path / "model.keras"
    path.write_bytes(b"this is not a zip archive")
    with pytest.raises(ValueError, match="exists but is not a .keras archive"):
        saving.load_model(path)
    zipped = tmp_path / "other.keras"
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="holds no config.json"):
        saving.load_model(zipped)


def test_load_model_names_layers_from_a_newer_keras_tfm(tmp_path):
    path, newer = tmp_path / "model.keras", tmp_path / "newer.keras"
    small_model().save(path)
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(newer, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                config = json.loads(data)
                text = json.dumps(config).replace('"keras_tfm>Seq2SeqTransformer"',
                                                  '"keras_tfm>Seq2SeqTransformerV2"')
                data = text.encode()
            target.writestr(item, data)
    with pytest.raises(ValueError, match=r"does not know.*Seq2SeqTransformerV2.*newer"):
        saving.load_model(newer)
    assert saving.load_model(path).name == "transformer"


def test_save_model_is_atomic_and_checks_its_arguments(tmp_path):
    model = small_model()
    path = tmp_path / "model.keras"
    saving.save_model(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.keras"]  # no temporary left
    src, tgt = random_ids((2, 5)), random_ids((2, 4), seed=1)
    np.testing.assert_array_equal(to_np(saving.load_model(path).predict([src, tgt], verbose=0)),
                                  to_np(model.predict([src, tgt], verbose=0)))
    with pytest.raises(FileExistsError):
        saving.save_model(model, path, overwrite=False)
    with pytest.raises(ValueError, match="must end in .keras"):
        saving.save_model(model, tmp_path / "model.h5")


# --- quantization -------------------------------------------------------------------------------

# |quantized - float32| / max|float32 logits|, measured on this model: int8 about 1.5e-2 (tied
# and untied), float8 (e4m3) about 0.1 (untied: the Dense output layer) — the bounds leave ~2x.
LOGITS_BOUND = {"int8": 0.04, "float8": 0.25}


@pytest.mark.parametrize("mode, tie", [("int8", True), ("int8", False), ("float8", True)])
def test_quantized_model_logits_generate_save_and_load(tmp_path, mode, tie):
    model = small_model(tie_embeddings=tie, positional="learned", max_length=8)
    src, tgt = random_ids((4, 7)), random_ids((4, 6), seed=1)
    reference = to_np(model([src, tgt]))
    with pytest.warns(UserWarning):  # Keras: InputLayer / PositionEmbedding have no quantize
        model.quantize(mode)
    logits = to_np(model([src, tgt]))
    error = np.abs(logits - reference).max() / np.abs(reference).max()
    assert error < LOGITS_BOUND[mode], error
    # the KV-cached decoder path uses the quantized layers too: its scores match teacher forcing
    tokens, scores = generate(model, src, start_id=1, end_id=None, max_length=6,
                              return_scores=True)
    decoder_in = np.concatenate([np.ones((4, 1), "int32"), tokens[:, :-1]], axis=1)
    steps = to_np(model([src, decoder_in])).astype("float64")
    steps[..., 0] = -1e9  # padding is never generated
    steps = steps - steps.max(-1, keepdims=True)
    log_probs = steps - np.log(np.exp(steps).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, tokens[..., None].astype("int64"), -1)[..., 0]
    np.testing.assert_allclose(scores, picked.sum(1), atol=2e-3)
    path = tmp_path / "quantized.keras"
    saving.save_model(model, path)
    loaded = saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded([src, tgt])), logits, atol=1e-6)
    kinds = {layer.quantization_mode for layer in loaded._flatten_layers()}
    assert mode in kinds


def test_hand_built_model_of_keras_tfm_layers_quantizes_saves_and_loads(tmp_path):
    """A functional model of keras_tfm layers (no Seq2SeqTransformer): each layer's config
    records its quantized sublayers, so the file reloads quantized."""
    tokens = keras.Input((None,), dtype="int32")
    embedding = TokenAndPositionEmbedding(VOCAB, 16, name="embedding")
    hidden = TransformerEncoderBlock(num_heads=2, ff_dim=32, name="block")(embedding(tokens))
    model = keras.Model(tokens, embedding(hidden, reverse=True))
    ids = random_ids((3, 6))
    reference = to_np(model(ids))
    model.quantize("int8")
    logits = to_np(model(ids))
    assert np.abs(logits - reference).max() / np.abs(reference).max() < LOGITS_BOUND["int8"]
    path = tmp_path / "hand_built.keras"
    saving.save_model(model, path)
    loaded = saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded(ids)), logits, atol=1e-6)
    assert loaded.get_layer("block").self_attention.query_dense.quantization_mode == "int8"
    assert loaded.get_layer("embedding").token_embedding.quantization_mode == "int8"


def test_quantize_an_unsupported_mode_is_a_value_error():
    model = small_model()
    with pytest.raises(ValueError):
        model.quantize("int3")


# --- generate's sources and end ids -------------------------------------------------------------

def test_generate_right_pads_python_lists_of_different_lengths():
    model = small_model()
    rows = [[5, 7, 9, 4], [6, 3], [8]]
    padded = np.array([[5, 7, 9, 4], [6, 3, 0, 0], [8, 0, 0, 0]], "int32")
    np.testing.assert_array_equal(
        generate(model, rows, start_id=1, end_id=2, max_length=4),
        generate(model, padded, start_id=1, end_id=2, max_length=4))


def test_generate_refuses_left_padded_sources_naming_the_row():
    model = small_model()
    right = np.array([[4, 8, 0, 0, 0], [5, 6, 7, 0, 0]], "int32")
    left = keras.utils.pad_sequences([[5, 6, 7], [4, 8]], maxlen=5)  # Keras pads in front
    with pytest.raises(ValueError, match=r"row 0 has padding.*\[0, 0, 5, 6, 7\].*'post'"):
        generate(model, left, start_id=1, end_id=2, max_length=4)
    with pytest.raises(ValueError, match="row 1 has padding"):
        generate(model, np.array([[4, 8, 3], [5, 0, 7]]), start_id=1, end_id=2, max_length=4)
    assert generate(model, right, start_id=1, end_id=2, max_length=4).shape[0] == 2


def test_generate_end_id_none_decodes_to_max_length_and_padding_end_is_refused():
    model = small_model()
    source = random_ids((3, 5))
    tokens = generate(model, source, start_id=1, end_id=None, max_length=6)
    assert tokens.shape == (3, 6) and (tokens != 0).all()  # padding is never generated
    with pytest.raises(ValueError, match="must not be the padding id 0"):
        generate(model, source, start_id=1, end_id=0, max_length=6)
