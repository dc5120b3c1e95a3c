"""from_pretrained / to_pretrained against transformers (random-weight Llama, Qwen2, Mistral,
GPT-2 and BERT models built from small configs, saved to temporary directories: the outside
oracle), their refusals, a tokenizer.json trained here, fine-tuning and `.keras` files."""

import json
import os

import keras
import numpy as np
import pytest
import torch
import transformers as tf_hf
from safetensors.numpy import load_file, save_file

import keras_tfm
from helpers import jit_options, to_np
from keras_tfm.text import TextGenerator

VOCAB = 96
BOS, EOS = 1, 2
_LLAMA_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=BOS,
                     eos_token_id=EOS)
CAUSAL = {
    # grouped-query attention 4:1 (8 heads, 2 key/value heads), tied output embeddings
    "llama_gqa4_tied": ("LlamaConfig", "LlamaForCausalLM",
                        dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0,
                             tie_word_embeddings=True)),
    # one key/value head (multi-query attention), untied
    "llama_mqa_untied": ("LlamaConfig", "LlamaForCausalLM",
                         dict(num_attention_heads=4, num_key_value_heads=1,
                              tie_word_embeddings=False)),
    # biases on q/k/v only, tied (as Qwen2.5-0.5B)
    "qwen2_qkv_bias": ("Qwen2Config", "Qwen2ForCausalLM",
                       dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                            tie_word_embeddings=True)),
    # Mistral without a sliding window (or one at least as long as its positions)
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=48,
                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)),
    "gpt2_relu_inner": ("GPT2Config", "GPT2LMHeadModel",
                        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=48,
                             n_inner=40, activation_function="relu", bos_token_id=VOCAB - 1,
                             eos_token_id=VOCAB - 1)),
}


def _randomize(model, seed):
    """Weights large enough to give varied tokens (the default init, std 0.02, decodes one
    repeated token); norms away from 1 and 0, so that a misplaced one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                parameter.copy_((1.0 if name.endswith("weight") else 0.0)
                                + 0.1 * torch.randn_like(parameter))
            else:
                parameter.normal_(0.0, 0.15)
    return model


def write_hf(path, name, seed=0, max_shard_size=None, **overrides):
    """A random-weight transformers model of CAUSAL[name] (or a BERT, see write_bert), saved
    to `path`; returns it (eval mode)."""
    config_class, model_class, kwargs = CAUSAL[name]
    common = _LLAMA_COMMON if "Config" in config_class and "GPT2" not in config_class else {}
    config = getattr(tf_hf, config_class)(**(common | kwargs | overrides))
    config._attn_implementation = "eager"
    model = _randomize(getattr(tf_hf, model_class)(config).eval(), seed)
    model.save_pretrained(path, **({} if max_shard_size is None else
                                   {"max_shard_size": max_shard_size}))
    return model


def batch(seed=0, rows=3, length=9, low=3, high=VOCAB - 1):
    """Right-padded token ids `(rows, length)` and their lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(low, high, (rows, length)).astype("int32")
    lengths = np.array([length, 5, 3][:rows])
    for row, n in enumerate(lengths):
        tokens[row, n:] = 0
    return tokens, lengths


def hf_logits(hf, tokens, lengths):
    mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
    with torch.no_grad():
        return hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                  attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy(), mask


def hf_greedy(hf, prompts, new_tokens, eos):
    """transformers' greedy continuation of each prompt (alone: no padding), up to and
    including its end token."""
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt], dtype=torch.long)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)
        rows.append(_until_end(out[0, len(prompt):].numpy(), eos))
    return rows


def _until_end(row, eos):
    row = [int(t) for t in row]
    return row[:row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
@pytest.mark.parametrize("name", sorted(CAUSAL))
def test_causal_lm_logits_and_greedy_tokens_equal_transformers(tmp_path, name, sharded):
    hf = write_hf(tmp_path, name, max_shard_size="12KB" if sharded else None)
    if sharded:
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    model = keras_tfm.from_pretrained(str(tmp_path), verbose=False)
    assert isinstance(model, keras_tfm.LanguageModel)
    eos = hf.config.eos_token_id
    assert model.special_ids == {"start_id": hf.config.bos_token_id, "end_id": eos}
    tokens, lengths = batch(seed=1)
    ours = to_np(model(tokens))
    theirs, mask = hf_logits(hf, tokens, lengths)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=1e-4)

    prompts = [list(tokens[row, :n]) for row, n in enumerate(lengths)]
    generated = keras_tfm.generate(model, prompts, max_length=8)
    expected = hf_greedy(hf, prompts, 8, eos)
    assert len(np.unique(generated)) >= 3  # not one repeated id
    for row, want in zip(generated, expected):
        assert _until_end(row, eos) == want


def test_llama_config_options_carried(tmp_path):
    write_hf(tmp_path, "llama_gqa4_tied")
    config = keras_tfm.from_pretrained(str(tmp_path)).get_config()
    assert (config["num_heads"], config["num_key_value_heads"]) == (8, 2)
    assert config["rotary_max_wavelength"] == 500.0 and config["layer_norm_epsilon"] == 1e-6
    assert config["tie_embeddings"] and config["normalization"] == "rms_norm"
    assert config["pad_id"] is None  # Llama has no pad token: generate fills with the end id


@pytest.mark.parametrize("name", ["llama_gqa4_tied", "llama_mqa_untied", "qwen2_qkv_bias",
                                  "gpt2"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, name):
    hf = write_hf(tmp_path / "hf", name)
    model = keras_tfm.from_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "export"
    keras_tfm.to_pretrained(model, str(out), max_shard_size="16KB")
    assert os.path.isfile(out / "model.safetensors.index.json")
    again, info = tf_hf.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(again).__name__ == type(hf).__name__
    assert not info["missing_keys"] and not info["unexpected_keys"]
    again.eval()
    tokens, lengths = batch(seed=2)
    theirs, mask = hf_logits(again, tokens, lengths)
    np.testing.assert_allclose(to_np(model(tokens))[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    # ... and it loads back into keras_tfm unchanged
    back = keras_tfm.from_pretrained(str(out))
    np.testing.assert_allclose(to_np(back(tokens)), to_np(model(tokens)), atol=1e-6)


def test_a_model_built_in_keras_exports_as_llama(tmp_path):
    model = keras_tfm.build_language_model(
        VOCAB, d_model=32, num_heads=4, ff_dim=48, num_layers=1, num_key_value_heads=2,
        activation="silu", gated_feed_forward=True, normalization="rms_norm", use_bias=False,
        pad_id=None, start_id=BOS, end_id=EOS, tie_embeddings=True)
    keras_tfm.to_pretrained(model, str(tmp_path))
    hf = tf_hf.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens, lengths = batch(seed=3)
    theirs, mask = hf_logits(hf, tokens, lengths)
    np.testing.assert_allclose(to_np(model(tokens))[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="neither a Llama-family checkpoint.*nor a GPT-2"):
        keras_tfm.to_pretrained(keras_tfm.build_language_model(
            VOCAB, d_model=16, num_heads=2, ff_dim=32, num_layers=1), str(tmp_path / "x"))


# --- BERT ----------------------------------------------------------------------------------

def write_bert(path, classes=None, seed=0, **overrides):
    config = tf_hf.BertConfig(**(dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=48,
                                      max_position_embeddings=32, type_vocab_size=2)
                                 | ({} if classes is None else {"num_labels": classes})
                                 | overrides))
    config._attn_implementation = "eager"
    cls = tf_hf.BertModel if classes is None else tf_hf.BertForSequenceClassification
    model = _randomize(cls(config).eval(), seed)
    model.save_pretrained(path)
    return model


def bert_batch(seed=0):
    tokens, lengths = batch(seed=seed, length=8)
    segments = np.zeros_like(tokens)
    segments[0, 4:] = 1  # a sentence pair
    segments[1, 3:5] = 1
    mask = np.arange(tokens.shape[1])[None] < lengths[:, None]
    return tokens, segments, mask


def hf_bert(hf, tokens, segments, mask):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                  token_type_ids=torch.tensor(segments, dtype=torch.long),
                  attention_mask=torch.tensor(mask, dtype=torch.long))


def test_bert_features_and_pooled_output_equal_transformers(tmp_path):
    hf = write_bert(tmp_path)
    model = keras_tfm.from_pretrained(str(tmp_path))
    assert isinstance(model, keras_tfm.EncoderModel) and model.special_ids == {"pad_id": 0}
    tokens, segments, mask = bert_batch()
    theirs = hf_bert(hf, tokens, segments, mask)
    features = to_np(model([tokens, segments]))
    assert features.shape == (3, 8, 32)
    np.testing.assert_allclose(features[mask], theirs.last_hidden_state.numpy()[mask],
                               atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(to_np(model.pooled_output([tokens, segments])),
                               theirs.pooler_output.numpy(), atol=1e-4, rtol=1e-4)
    # the segments matter
    assert not np.allclose(to_np(model([tokens, 1 - segments]))[mask], features[mask])


def test_bert_classifier_logits_equal_transformers(tmp_path):
    hf = write_bert(tmp_path, classes=3, hidden_act="gelu_new")
    model = keras_tfm.from_pretrained(str(tmp_path))
    tokens, segments, mask = bert_batch(seed=4)
    logits = to_np(model([tokens, segments]))
    assert logits.shape == (3, 3)
    theirs = hf_bert(hf, tokens, segments, mask)
    np.testing.assert_allclose(logits, theirs.logits.numpy(), atol=1e-4, rtol=1e-4)
    pooled = hf_bert(hf.bert, tokens, segments, mask).pooler_output.numpy()
    np.testing.assert_allclose(to_np(model.pooled_output([tokens, segments])), pooled,
                               atol=1e-4, rtol=1e-4)


def test_bert_masked_lm_checkpoint_loads_as_its_encoder(tmp_path):
    config = tf_hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=4, intermediate_size=48,
                              max_position_embeddings=32)
    hf = _randomize(tf_hf.BertForMaskedLM(config).eval(), 5)
    hf.save_pretrained(tmp_path)
    model = keras_tfm.from_pretrained(str(tmp_path))  # (the masked-LM head is skipped)
    assert not model.get_config()["pooler"]
    tokens, segments, mask = bert_batch(seed=5)
    theirs = hf_bert(hf.bert, tokens, segments, mask).last_hidden_state.numpy()
    np.testing.assert_allclose(to_np(model([tokens, segments]))[mask], theirs[mask],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("classes", [None, 3], ids=["features", "classifier"])
def test_bert_export_loads_in_transformers(tmp_path, classes):
    write_bert(tmp_path / "hf", classes=classes)
    model = keras_tfm.from_pretrained(str(tmp_path / "hf"))
    keras_tfm.to_pretrained(model, str(tmp_path / "out"))
    cls = tf_hf.BertModel if classes is None else tf_hf.BertForSequenceClassification
    again, info = cls.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens, segments, mask = bert_batch(seed=9)
    theirs = hf_bert(again.eval(), tokens, segments, mask)
    ours = to_np(model([tokens, segments]))
    if classes is None:
        np.testing.assert_allclose(ours[mask], theirs.last_hidden_state.numpy()[mask],
                                   atol=1e-5, rtol=1e-5)
    else:
        np.testing.assert_allclose(ours, theirs.logits.numpy(), atol=1e-5, rtol=1e-5)


# --- Marian through the same entry point ---------------------------------------------------

def test_marian_dispatches_to_from_marian(tmp_path):
    config = tf_hf.MarianConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                                encoder_attention_heads=2, decoder_attention_heads=2,
                                encoder_ffn_dim=24, decoder_ffn_dim=24, pad_token_id=39,
                                decoder_start_token_id=39, eos_token_id=0,
                                max_position_embeddings=32)
    tf_hf.MarianMTModel(config).save_pretrained(tmp_path)
    model = keras_tfm.from_pretrained(str(tmp_path))
    assert isinstance(model, keras_tfm.Seq2SeqTransformer)
    assert model.special_ids == {"pad_id": 39, "start_id": 39, "end_id": 0}
    keras_tfm.to_pretrained(model, str(tmp_path / "export"))
    assert json.load(open(tmp_path / "export" / "config.json"))["model_type"] == "marian"


# --- storage: pytorch_model.bin, bfloat16 ---------------------------------------------------

def test_pytorch_bin_checkpoint_loads(tmp_path):
    hf = write_hf(tmp_path, "llama_mqa_untied")
    os.remove(tmp_path / "model.safetensors")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = keras_tfm.from_pretrained(str(tmp_path))
    tokens, lengths = batch(seed=6)
    theirs, mask = hf_logits(hf, tokens, lengths)
    np.testing.assert_allclose(to_np(model(tokens))[mask], theirs[mask], atol=1e-4, rtol=1e-4)


def test_bfloat16_checkpoint_stays_bfloat16(tmp_path):
    hf = write_hf(tmp_path / "f32", "qwen2_qkv_bias")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = keras_tfm.from_pretrained(str(tmp_path / "bf16"), dtype="bfloat16")
    embedding = model.get_layer("token_embedding").embeddings
    assert str(embedding.dtype) == "bfloat16"
    exact = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(to_np(keras.ops.cast(embedding, "float32")), exact)
    # float32 under the default policy, the same values
    widened = keras_tfm.from_pretrained(str(tmp_path / "bf16"))
    np.testing.assert_array_equal(to_np(widened.get_layer("token_embedding").embeddings), exact)
    # and exported as bfloat16
    keras_tfm.to_pretrained(model, str(tmp_path / "out"))
    again = tf_hf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype="auto")
    assert again.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(again.model.embed_tokens.weight, hf.model.embed_tokens.weight)


# --- refusals ---------------------------------------------------------------------------------

def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


def test_mistral_sliding_window_shorter_than_positions_is_refused(tmp_path):
    write_hf(tmp_path, "mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window=16 shorter than "
                                         "max_position_embeddings=64"):
        keras_tfm.from_pretrained(str(tmp_path))
    _edit_config(tmp_path, sliding_window=64)  # a window that never binds: loads
    keras_tfm.from_pretrained(str(tmp_path))


def test_unsupported_configs_are_named(tmp_path):
    write_hf(tmp_path, "llama_mqa_untied")
    _edit_config(tmp_path, rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                            "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rope scaling of type 'llama3'"):
        keras_tfm.from_pretrained(str(tmp_path))
    _edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                 head_dim=16)
    with pytest.raises(ValueError, match="head_dim=16"):
        keras_tfm.from_pretrained(str(tmp_path))
    _edit_config(tmp_path, head_dim=8, model_type="gpt_neox")
    with pytest.raises(ValueError, match="'gpt_neox' model"):
        keras_tfm.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        keras_tfm.from_pretrained(str(tmp_path / "nothing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="no config.json"):
        keras_tfm.from_pretrained(str(tmp_path / "empty"))

    write_hf(tmp_path / "gpt2", "gpt2", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True"):
        keras_tfm.from_pretrained(str(tmp_path / "gpt2"))
    write_bert(tmp_path / "bert")
    _edit_config(tmp_path / "bert", position_embedding_type="relative_key")
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        keras_tfm.from_pretrained(str(tmp_path / "bert"))


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    write_hf(tmp_path, "qwen2_qkv_bias")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.1.self_attn.k_proj.bias"
    save_file({k: v for k, v in tensors.items() if k != name}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"missing \['{name}'\]"):
        keras_tfm.from_pretrained(str(tmp_path))
    save_file(tensors | {"model.extra.weight": np.zeros(3, "float32")}, file,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected \['model.extra.weight'\]"):
        keras_tfm.from_pretrained(str(tmp_path))
    save_file(tensors | {name: np.zeros(15, "float32")}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name} \(15,\) \(expected \(16,\)\)"):
        keras_tfm.from_pretrained(str(tmp_path))
    os.remove(file)
    with pytest.raises(ValueError, match="no weights file"):
        keras_tfm.from_pretrained(str(tmp_path))


# --- text in, text out ----------------------------------------------------------------------

def _train_tokenizer(vocab_size):
    import tokenizers as tk

    text = ("once upon a time there was a little fox who lived in a forest near the river . "
            "the fox liked to run and to play with the other animals of the forest . ") * 20
    tokenizer = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace()
    tokenizer.decoder = tk.decoders.Metaspace()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size,
                                     special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator([text], trainer)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)])  # as Llama's tokenizer: bos first
    return tokenizer


def test_text_generator_from_pretrained_equals_transformers(tmp_path):
    tokenizer = _train_tokenizer(VOCAB)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                   "eos_token": "</s>", "unk_token": "<unk>",
                   "clean_up_tokenization_spaces": False}, f)
    hf = write_hf(tmp_path, "llama_gqa4_tied", vocab_size=tokenizer.get_vocab_size())
    prompt = "once upon a time"

    hf_tokenizer = tf_hf.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert int(ids[0, 0]) == BOS
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=10, do_sample=False, pad_token_id=EOS)
    expected = hf_tokenizer.decode(out[0], skip_special_tokens=True)

    generator = TextGenerator.from_pretrained(str(tmp_path))
    assert generator.add_start and generator.tokenizer.special_ids == {
        "pad_id": None, "start_id": BOS, "end_id": EOS}
    text = generator.generate(prompt, max_length=10, method="greedy")
    assert text == expected and len(text) > len(prompt)


def test_special_ids_from_the_tokenizer_when_the_config_has_none(tmp_path):
    tokenizer = _train_tokenizer(VOCAB)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": {"content": "</s>"}, "pad_token": "</s>"}, f)
    write_hf(tmp_path, "qwen2_qkv_bias", vocab_size=tokenizer.get_vocab_size(),
             bos_token_id=None, eos_token_id=None)
    model = keras_tfm.from_pretrained(str(tmp_path))
    # eos from the tokenizer; its pad token is eos, which must stay generable: no padding
    assert model.special_ids == {"end_id": EOS}


# --- fine-tuning and .keras files -------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama_gqa4_tied", "gpt2"])
def test_fine_tune_lowers_the_loss_and_keras_file_keeps_predictions(tmp_path, name):
    write_hf(tmp_path, name)
    model = keras_tfm.from_pretrained(str(tmp_path))
    tokens = np.random.default_rng(7).integers(3, VOCAB - 1, (8, 12)).astype("int32")
    model.compile(keras.optimizers.Adam(1e-2),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(ignore_class=None),
                  **jit_options())
    history = model.fit(tokens[:, :-1], tokens[:, 1:], epochs=15, batch_size=8,
                        verbose=0).history["loss"]
    assert np.isfinite(history).all() and history[-1] < 0.7 * history[0]
    path = tmp_path / "tuned.keras"
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.special_ids == model.special_ids
    assert len(restored.weights) == len(model.weights)  # (the tied matrix stored once)
    np.testing.assert_allclose(to_np(restored(tokens)), to_np(model(tokens)), atol=1e-5)
    np.testing.assert_array_equal(keras_tfm.generate(restored, [list(tokens[0, :4])],
                                                     max_length=5),
                                  keras_tfm.generate(model, [list(tokens[0, :4])],
                                                     max_length=5))


def test_bert_classifier_fine_tunes_and_round_trips(tmp_path):
    write_bert(tmp_path, classes=2)
    model = keras_tfm.from_pretrained(str(tmp_path))
    tokens, segments, _ = bert_batch(seed=8)
    labels = np.array([0, 1, 1])
    model.compile(keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **jit_options())
    history = model.fit([tokens, segments], labels, epochs=15, verbose=0).history["loss"]
    assert history[-1] < 0.7 * history[0]
    model.save(tmp_path / "tuned.keras")
    restored = keras.models.load_model(tmp_path / "tuned.keras")
    np.testing.assert_allclose(to_np(restored([tokens, segments])),
                               to_np(model([tokens, segments])), atol=1e-5)


def test_new_model_options_round_trip_in_configs():
    lm = keras_tfm.build_language_model(
        VOCAB, d_model=16, num_heads=2, ff_dim=32, num_layers=1, positional="learned",
        max_length=16, activation="gelu_approximate", tie_embeddings=True, qkv_bias=True,
        use_bias=False, pad_id=None)
    again = keras_tfm.LanguageModel.from_config(lm.get_config())
    assert again.get_config() == lm.get_config()
    block = lm.get_layer("decoder_block_0")
    assert block.self_attention.query_dense.bias is not None
    assert block.self_attention.output_dense.bias is None
    assert block.feed_forward.output_dense.bias is None
    block_again = keras_tfm.TransformerDecoderBlock.from_config(block.get_config())
    assert block_again.qkv_bias and block_again.activation is block.activation
    encoder = keras_tfm.build_encoder(
        VOCAB, d_model=16, num_heads=2, ff_dim=32, num_layers=1, positional="learned",
        max_length=16, segment_vocab_size=2, embedding_norm=True, pooler=True,
        pooling="first", num_classes=3)
    assert keras_tfm.EncoderModel.from_config(encoder.get_config()).get_config() == \
        encoder.get_config()
    with pytest.raises(ValueError, match='pooling="first"'):
        keras_tfm.build_encoder(VOCAB, d_model=16, num_heads=2, ff_dim=32, num_layers=1,
                                pooler=True)
