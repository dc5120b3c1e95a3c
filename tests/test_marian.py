"""from_marian / to_marian against transformers' MarianMTModel (random weights, built from a
config, saved to a temporary directory: the outside oracle), and Marian's special ids."""

import json
import os

import keras
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import MarianConfig, MarianMTModel

import keras_tfm
from helpers import jit_options, to_np

VOCAB = 40
CONFIGS = {
    # opus-mt's usual layout: one matrix for encoder, decoder and output; swish; scaled.
    "shared_tied_swish": dict(activation_function="swish", scale_embedding=True),
    # separate vocabularies, an untied output projection, gelu, unequal depths.
    "separate_untied_gelu": dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=30,
                                 tie_word_embeddings=False, activation_function="gelu",
                                 encoder_layers=1, decoder_layers=2),
    "shared_untied_relu": dict(tie_word_embeddings=False, activation_function="relu"),
}


def marian_config(**overrides):
    target_vocab = overrides.get("decoder_vocab_size", VOCAB)
    config = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                  decoder_ffn_dim=24, max_position_embeddings=64, pad_token_id=target_vocab - 1,
                  decoder_start_token_id=target_vocab - 1, eos_token_id=0, dropout=0.0)
    return MarianConfig(**(config | overrides))


def write_marian(path, seed=0, zero_pad_row=False, **overrides):
    """A MarianMTModel with random weights large enough to give varied tokens (the default
    init, std 0.02, decodes one repeated token), a non-zero final_logits_bias, saved to path."""
    torch.manual_seed(seed)
    model = MarianMTModel(marian_config(**overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" not in name and "embed_positions" not in name:  # (fixed sinusoids)
                parameter.normal_(0.0, 0.1)
        model.final_logits_bias.normal_(0.0, 0.1)
        if zero_pad_row:  # as real checkpoints have it (torch's padding_idx)
            for embedding in (model.get_input_embeddings(), model.get_decoder().embed_tokens):
                embedding.weight[model.config.pad_token_id] = 0.0
    model.save_pretrained(path)
    return model


def sources(pad, vocab=VOCAB, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, pad, (3, 7)).astype("int32")
    src[1, 4:] = pad
    src[2, 2:] = pad
    return src


def hf_logits(hf, src, dec, pad):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != pad),
                  decoder_input_ids=torch.tensor(dec)).logits.numpy()


def hf_generate(hf, src, pad, max_new_tokens, **kwargs):
    with torch.no_grad():
        return hf.generate(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != pad),
                           max_new_tokens=max_new_tokens, suppress_tokens=[pad],
                           forced_eos_token_id=None, renormalize_logits=True, **kwargs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_greedy_tokens_equal_transformers(tmp_path, name):
    hf = write_marian(tmp_path, **CONFIGS[name])
    pad = hf.config.pad_token_id
    model = keras_tfm.from_marian(str(tmp_path))
    assert model.special_ids == {"pad_id": pad, "start_id": pad, "end_id": 0}
    src = sources(pad, hf.config.vocab_size)
    target_vocab = hf.config.decoder_vocab_size
    dec = np.random.default_rng(1).integers(1, target_vocab - 1, (3, 5)).astype("int32")
    dec[:, 0] = pad  # the decoder starts from the padding id and must still attend to it
    np.testing.assert_allclose(to_np(model([src, dec])), hf_logits(hf, src, dec, pad),
                               atol=1e-4, rtol=1e-4)

    ours = keras_tfm.generate(model, src, max_length=12)
    theirs = hf_generate(hf, src, pad, 12, num_beams=1, do_sample=False).numpy()[:, 1:]
    assert len(np.unique(ours)) >= 2  # not one repeated id
    width = max(ours.shape[1], theirs.shape[1])
    pad_to = lambda t: np.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=pad)  # noqa
    np.testing.assert_array_equal(pad_to(ours), pad_to(theirs))
    # Finished rows are padded with Marian's padding id, which is never generated.
    for row in ours:
        ends = np.flatnonzero(row == 0)
        if len(ends):
            assert (row[ends[0] + 1:] == pad).all()
        assert pad not in row[:ends[0] + 1 if len(ends) else None]


def sequence_log_prob(hf, src, tokens, pad):
    """transformers' log-probability of `tokens` after the start token (padding excluded from
    the softmax, as keras_tfm and `renormalize_logits` do), up to and including <EOS>."""
    total = []
    for row, seq in enumerate(tokens):
        end = np.flatnonzero(seq == 0)
        seq = seq[:end[0] + 1] if len(end) else seq
        dec = np.concatenate([[pad], seq])[None]
        logits = hf_logits(hf, src[row:row + 1], dec[:, :-1], pad)[0]
        logits[:, pad] = -np.inf
        log_probs = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        total.append(log_probs[np.arange(len(seq)), seq].sum())
    return np.asarray(total)


def test_beam_search_finds_transformers_best_hypotheses(tmp_path):
    """Beam search ranks by the same score as transformers' when the length penalty is 0
    (keras_tfm: log p / ((5 + len) / 6)^0; transformers: log p / len^0), padding excluded
    from the softmax in both (`renormalize_logits=True`). Both expand 2k candidates a step;
    transformers keeps an ended candidate only if it ranks among the top k, keras_tfm among
    the top 2k, which can only differ when such a candidate would be the best overall. The
    scores are checked against transformers' own scoring of each sequence."""
    hf = write_marian(tmp_path, **CONFIGS["shared_tied_swish"])
    pad = hf.config.pad_token_id
    model = keras_tfm.from_marian(str(tmp_path))
    src = sources(pad, seed=3)
    ours, scores = keras_tfm.generate(model, src, max_length=10, method="beam", beam_size=3,
                                      length_penalty=0.0, return_scores=True)
    out = hf_generate(hf, src, pad, 10, num_beams=3, num_return_sequences=1,
                      length_penalty=0.0, output_scores=True, return_dict_in_generate=True)
    theirs = out.sequences.numpy()[:, 1:]
    for row in range(len(src)):
        a, b = ours[row], theirs[row]
        a, b = a[a != pad], b[b != pad]
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(scores, out.sequences_scores.numpy(), atol=1e-4)
    np.testing.assert_allclose(scores, sequence_log_prob(hf, src, ours, pad), atol=1e-4)


@pytest.mark.parametrize("name", ["shared_tied_swish", "separate_untied_gelu",
                                  "shared_untied_relu"])
def test_to_marian_round_trip_loads_in_transformers(tmp_path, name):
    hf = write_marian(tmp_path / "original", **CONFIGS[name])
    pad = hf.config.pad_token_id
    model = keras_tfm.from_marian(str(tmp_path / "original"))
    keras_tfm.to_marian(model, str(tmp_path / "export"))
    exported, info = MarianMTModel.from_pretrained(str(tmp_path / "export"),
                                                   output_loading_info=True)
    exported.eval()
    assert not info["missing_keys"] and not info["mismatched_keys"]
    src = sources(pad, seed=4)
    dec = np.full((3, 4), pad, "int32")
    dec[:, 1:] = np.arange(1, 4)
    np.testing.assert_allclose(hf_logits(exported, src, dec, pad), hf_logits(hf, src, dec, pad),
                               atol=1e-5, rtol=1e-5)
    # A reload of the export is the same keras_tfm model.
    again = keras_tfm.from_marian(str(tmp_path / "export"))
    np.testing.assert_allclose(to_np(again([src, dec])), to_np(model([src, dec])), atol=1e-6)


def test_a_model_trained_in_keras_exports_to_marian(tmp_path):
    model = keras_tfm.build_transformer(
        VOCAB, VOCAB, d_model=16, num_heads=2, ff_dim=24, num_encoder_layers=1,
        num_decoder_layers=1, dropout=0.0, positional_layout="halves", activation="silu",
        share_embeddings=True, tie_embeddings=True, logits_bias=True, pad_id=VOCAB - 1,
        start_id=VOCAB - 1, end_id=0)
    src = sources(VOCAB - 1, seed=5)
    dec = np.concatenate([np.full((3, 1), VOCAB - 1), src[:, :4]], axis=1).astype("int32")
    loss = keras_tfm.MaskedSparseCategoricalCrossentropy(ignore_class=VOCAB - 1)
    model.compile(keras.optimizers.Adam(1e-2), loss=loss, **jit_options())
    model.fit([src, dec], src[:, :5], epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="padding id's embedding row is not zero.*CTranslate2"):
        keras_tfm.to_marian(model, str(tmp_path))
    hf = MarianMTModel.from_pretrained(str(tmp_path)).eval()
    # transformers masks no decoder padding: compare the real decoder positions.
    real = dec != VOCAB - 1
    real[:, 0] = True
    np.testing.assert_allclose(hf_logits(hf, src, dec, VOCAB - 1)[real],
                               to_np(model([src, dec]))[real], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="norm_first=True.*positional_layout='interleaved'"):
        keras_tfm.to_marian(keras_tfm.build_transformer(
            VOCAB, VOCAB, d_model=16, num_heads=2, ff_dim=24, num_encoder_layers=1,
            num_decoder_layers=1, norm_first=True, start_id=1, end_id=2), str(tmp_path / "x"))


@pytest.mark.parametrize("name", ["shared_tied_swish", "separate_untied_gelu"])
def test_fine_tune_save_and_load_keep_predictions(tmp_path, name):
    hf = write_marian(tmp_path, **CONFIGS[name])
    pad = hf.config.pad_token_id
    model = keras_tfm.from_marian(str(tmp_path))
    src = sources(pad, seed=6)
    targets = np.where(src[:, :6] == pad, pad, src[:, :6]).astype("int32")
    dec = np.concatenate([np.full((3, 1), pad), targets[:, :-1]], axis=1).astype("int32")
    loss = keras_tfm.MaskedSparseCategoricalCrossentropy(pad_id=model.special_ids["pad_id"])
    assert loss.ignore_class == pad and loss.get_config()["ignore_class"] == pad
    model.compile(keras.optimizers.Adam(1e-2), loss=loss,
                  metrics=[keras_tfm.MaskedAccuracy(pad_id=pad)], **jit_options())
    table = lambda: to_np(keras_tfm.Seq2SeqParts.from_model(  # noqa: E731
        model).decoder_embedding.token_embedding.embeddings)
    before = table()
    history = model.fit([src, dec], targets, epochs=15, verbose=0).history
    # As torch's padding_idx: the lookup of the padding id (the decoder's start) sends no
    # gradient to its row; a tied output projection still does (in transformers too).
    changed = np.abs(table() - before).max(axis=1) > 0
    assert changed[pad] == CONFIGS[name].get("tie_word_embeddings", True)
    assert changed[src[0, 0]]
    assert np.isfinite(history["loss"]).all() and history["loss"][-1] < 0.5 * history["loss"][0]
    assert history["masked_accuracy"][-1] > history["masked_accuracy"][0]
    model.save(tmp_path / "tuned.keras")
    restored = keras.models.load_model(tmp_path / "tuned.keras")
    assert restored.special_ids == model.special_ids
    np.testing.assert_allclose(to_np(restored([src, dec])), to_np(model([src, dec])), atol=1e-5)
    np.testing.assert_array_equal(keras_tfm.generate(restored, src, max_length=6),
                                  keras_tfm.generate(model, src, max_length=6))


def test_bad_directories_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        keras_tfm.from_marian(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no config.json"):
        keras_tfm.from_marian(str(tmp_path))
    write_marian(tmp_path)
    config_path = tmp_path / "config.json"
    original = json.loads(config_path.read_text())

    def with_config(**changes):
        config_path.write_text(json.dumps(original | changes))
        return str(tmp_path)

    with pytest.raises(ValueError, match="'bart' model"):
        keras_tfm.from_marian(with_config(model_type="bart"))
    with pytest.raises(ValueError, match=r"activation_function='tanh'"):
        keras_tfm.from_marian(with_config(activation_function="tanh"))
    with pytest.raises(ValueError, match="encoder_attention_heads=2 != decoder_attention_heads=4"):
        keras_tfm.from_marian(with_config(decoder_attention_heads=4))
    with pytest.raises(ValueError, match="normalize_before=True"):
        keras_tfm.from_marian(with_config(normalize_before=True))
    config_path.write_text(json.dumps(original))

    weights = load_file(tmp_path / "model.safetensors")
    name = "model.decoder.layers.0.fc1.weight"
    save_file({k: v for k, v in weights.items() if k != name}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"missing \['{name}'\]"):
        keras_tfm.from_marian(str(tmp_path))
    save_file(weights | {name: weights[name][:, :-1].copy()}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{name} has shape \(24, 15\).*\(24, 16\)"):
        keras_tfm.from_marian(str(tmp_path))
    save_file(weights | {"model.encoder.layernorm_embedding.weight": np.ones(16, "float32")},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected.*layernorm_embedding"):
        keras_tfm.from_marian(str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no weights file"):
        keras_tfm.from_marian(str(tmp_path))


def test_older_checkpoint_layout_with_position_tables_and_copies(tmp_path):
    """Checkpoints saved by older transformers carry the sinusoid tables and every tied copy."""
    hf = write_marian(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    for key in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight",
                "model.encoder.embed_tokens.weight", "lm_head.weight"):
        weights[key] = state[key].copy()
    save_file(weights, tmp_path / "model.safetensors")
    model = keras_tfm.from_marian(str(tmp_path))
    pad = hf.config.pad_token_id
    src = sources(pad)
    dec = np.full((3, 3), pad, "int32")
    dec[:, 1:] = [5, 6]
    np.testing.assert_allclose(to_np(model([src, dec])), hf_logits(hf, src, dec, pad), atol=1e-4)
    weights["model.decoder.embed_positions.weight"] = weights[
        "model.decoder.embed_positions.weight"] + 0.5
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="decoder.embed_positions.weight is not the sinusoidal"):
        keras_tfm.from_marian(str(tmp_path))


def test_token_ids_outside_the_checkpoint_vocabulary_are_refused(tmp_path):
    write_marian(tmp_path)
    model = keras_tfm.from_marian(str(tmp_path))
    src = sources(VOCAB - 1)
    src[1, 2] = VOCAB + 3
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 3} at \(row, column\) \(1, 2\).*"
                                         rf"vocab_size={VOCAB}"):
        keras_tfm.generate(model, src, max_length=4)


def test_a_quantized_model_is_not_exported(tmp_path):
    write_marian(tmp_path)
    model = keras_tfm.from_marian(str(tmp_path))
    model.quantize("int8")
    with pytest.raises(ValueError, match=r"quantized \(int8\)"):
        keras_tfm.to_marian(model, str(tmp_path / "export"))
