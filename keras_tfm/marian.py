"""Hugging Face MarianMT (opus-mt) checkpoints ↔ keras_tfm models.

MarianMT is the paper's transformer: post-LN blocks, sinusoidal positions (sines in the first
half of the channels, cosines in the second), scaled embeddings, biases on every projection.
`from_marian(path)` reads a `transformers` directory (`config.json` + `model.safetensors`, or
its shards, or `pytorch_model.bin` where torch is installed; `checkpoints.py`) with NumPy and returns a `Seq2SeqTransformer`;
`to_marian(model, path)` writes one back, which `transformers.MarianMTModel.from_pretrained`
and CTranslate2's converter load. One table, `_weight_map`, names every tensor both ways.
"""

import json
import os
import shutil
import warnings

import keras
import numpy as np

from keras_tfm.checkpoints import Checkpoint
from keras_tfm.seq2seq import Seq2SeqTransformer
from keras_tfm.positional import sinusoidal_encoding

# MarianConfig's defaults, for config files that omit a field (older transformers versions).
_DEFAULTS = dict(activation_function="gelu", scale_embedding=False, share_encoder_decoder_embeddings=True,
                 tie_word_embeddings=True, dropout=0.1, attention_dropout=0.0,
                 activation_dropout=0.0, max_position_embeddings=1024, eos_token_id=0)
# transformers activation names → Keras activation names.
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}
# Options of older (BART-derived) Marian configs that current transformers ignores; keras_tfm
# refuses a value other than the one every opus-mt checkpoint has, rather than guess.
_FIXED = {"normalize_before": False, "normalize_embedding": False, "add_final_layer_norm": False,
          "static_position_embeddings": True, "add_bias_logits": False}
_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "target_vocab.json",
                    "tokenizer_config.json", "special_tokens_map.json")


def _read_config(path):
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(f"from_marian needs a directory written by transformers "
                         f"(config.json + model.safetensors); {path!r} is not a directory.")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} has no config.json: not a transformers model directory.")
    with open(config_path) as f:
        config = json.load(f)
    if config.get("model_type") != "marian":
        raise ValueError(f"{config_path} is a {config.get('model_type')!r} model; from_marian "
                         "reads MarianMT checkpoints (model_type 'marian').")
    return _DEFAULTS | config


def _model_kwargs(config):
    """Seq2SeqTransformer arguments for a Marian config; ValueError for what they cannot say."""
    unsupported = [f"{key}={config[key]!r}" for key, value in _FIXED.items()
                   if key in config and config[key] != value]
    for stack_a, stack_b in (("encoder_attention_heads", "decoder_attention_heads"),
                             ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config[stack_a] != config[stack_b]:
            unsupported.append(f"{stack_a}={config[stack_a]} != {stack_b}={config[stack_b]}")
    activation = config["activation_function"]
    if activation not in _ACTIVATIONS:
        unsupported.append(f"activation_function={activation!r} (supported: "
                           f"{sorted(_ACTIVATIONS)})")
    if not isinstance(config["eos_token_id"], int):
        unsupported.append(f"eos_token_id={config['eos_token_id']!r} (one id is supported)")
    if unsupported:
        raise ValueError("This Marian config has options keras_tfm cannot represent: "
                         + "; ".join(unsupported) + ".")
    # transformers ties the encoder's and decoder's embeddings to `model.shared` only when
    # tie_word_embeddings is set too; otherwise the three matrices are separate.
    share = bool(config["share_encoder_decoder_embeddings"] and config["tie_word_embeddings"])
    vocab = config["vocab_size"]
    return dict(
        src_vocab_size=vocab,
        tgt_vocab_size=(vocab if config["share_encoder_decoder_embeddings"]
                        else config.get("decoder_vocab_size") or vocab),
        d_model=config["d_model"], num_heads=config["encoder_attention_heads"],
        ff_dim=config["encoder_ffn_dim"], num_encoder_layers=config["encoder_layers"],
        num_decoder_layers=config["decoder_layers"], dropout=float(config["dropout"]),
        attention_dropout=float(config["attention_dropout"]),
        activation_dropout=float(config["activation_dropout"]),
        activation=_ACTIVATIONS[activation], positional_layout="halves",
        scale_embeddings=bool(config["scale_embedding"]), share_embeddings=share,
        tie_embeddings=bool(config["tie_word_embeddings"]), logits_bias=True,
        layer_norm_epsilon=1e-5, freeze_pad_embedding=True, pad_id=config["pad_token_id"],
        start_id=config.get("decoder_start_token_id", config["pad_token_id"]),
        end_id=config["eos_token_id"], name="marian",
    )


def _read_weights(path):
    """Every tensor of the checkpoint (safetensors, sharded or not, or `pytorch_model.bin`
    with torch), as float32 NumPy arrays: Marian's checks look at the whole set at once."""
    checkpoint = Checkpoint(path)
    return {name: checkpoint.read(name) for name in sorted(checkpoint.names)}


def _attention(prefix, attention):
    pairs = []
    for hf, dense in (("q_proj", attention.query_dense), ("k_proj", attention.key_dense),
                      ("v_proj", attention.value_dense), ("out_proj", attention.output_dense)):
        kernel, bias = dense.kernel, dense.bias
        if hf == "out_proj":  # kernel (H, d_head, d_model): torch weight (d_model, H·d_head)
            to_hf = lambda k: k.reshape(-1, k.shape[-1]).T  # noqa: E731
        else:  # kernel (d_model, H, d_head): torch weight (H·d_head, d_model)
            to_hf = lambda k: k.reshape(k.shape[0], -1).T  # noqa: E731
        pairs.append((f"{prefix}.{hf}.weight", kernel, lambda w, s: w.T.reshape(s), to_hf))
        pairs.append((f"{prefix}.{hf}.bias", bias, lambda b, s: b.reshape(s),
                      lambda b: b.reshape(-1)))
    return pairs


def _norm(prefix, norm):
    same = lambda w, s: w.reshape(s)  # noqa: E731
    return [(f"{prefix}.weight", norm.gamma, same, lambda w: w),
            (f"{prefix}.bias", norm.beta, same, lambda b: b)]


def _dense(prefix, dense):
    return [(f"{prefix}.weight", dense.kernel, lambda w, s: w.T.reshape(s), lambda k: k.T),
            (f"{prefix}.bias", dense.bias, lambda b, s: b.reshape(s), lambda b: b)]


def _weight_map(model):
    """(HF tensor name, Keras variable, from_hf(array, shape), to_hf(array)) for every weight."""
    by_name = {layer.name: layer for layer in model.layers}
    config = model.get_config()
    same = lambda w, s: w.reshape(s)  # noqa: E731
    pairs = []
    if config["share_embeddings"]:
        embedding = by_name["shared_embedding"]
        pairs.append(("model.shared.weight", embedding.token_embedding.embeddings, same,
                      lambda w: w))
        target = embedding
    else:
        pairs.append(("model.encoder.embed_tokens.weight",
                      by_name["encoder_embedding"].token_embedding.embeddings, same, lambda w: w))
        target = by_name["decoder_embedding"]
        pairs.append(("model.decoder.embed_tokens.weight", target.token_embedding.embeddings,
                      same, lambda w: w))
    if config["tie_embeddings"]:
        pairs.append(("final_logits_bias", target.logits_bias, lambda b, s: b.reshape(s),
                      lambda b: b[None]))
    else:
        logits = by_name["logits"]
        pairs.append(("lm_head.weight", logits.kernel, lambda w, s: w.T.reshape(s),
                      lambda k: k.T))
        pairs.append(("final_logits_bias", logits.bias, lambda b, s: b.reshape(s),
                      lambda b: b[None]))
    for i in range(config["num_encoder_layers"]):
        block, prefix = by_name[f"encoder_block_{i}"], f"model.encoder.layers.{i}"
        pairs += _attention(f"{prefix}.self_attn", block.self_attention)
        pairs += _norm(f"{prefix}.self_attn_layer_norm", block.self_attention_norm)
        pairs += _dense(f"{prefix}.fc1", block.feed_forward.intermediate_dense)
        pairs += _dense(f"{prefix}.fc2", block.feed_forward.output_dense)
        pairs += _norm(f"{prefix}.final_layer_norm", block.feed_forward_norm)
    for i in range(config["num_decoder_layers"]):
        block, prefix = by_name[f"decoder_block_{i}"], f"model.decoder.layers.{i}"
        pairs += _attention(f"{prefix}.self_attn", block.self_attention)
        pairs += _norm(f"{prefix}.self_attn_layer_norm", block.self_attention_norm)
        pairs += _attention(f"{prefix}.encoder_attn", block.cross_attention)
        pairs += _norm(f"{prefix}.encoder_attn_layer_norm", block.cross_attention_norm)
        pairs += _dense(f"{prefix}.fc1", block.feed_forward.intermediate_dense)
        pairs += _dense(f"{prefix}.fc2", block.feed_forward.output_dense)
        pairs += _norm(f"{prefix}.final_layer_norm", block.feed_forward_norm)
    return pairs


def _normalise_names(weights):
    """Names as MarianMTModel saves them: a bare MarianModel's (no `model.` prefix) get one."""
    if any(name.startswith("model.") for name in weights):
        return dict(weights)
    return {name if name == "final_logits_bias" else f"model.{name}": value
            for name, value in weights.items()}


def _check_positions(weights, config):
    """A stored position table must be the sinusoid keras_tfm computes (halves layout)."""
    for stack in ("encoder", "decoder"):
        table = weights.pop(f"model.{stack}.embed_positions.weight", None)
        if table is None:
            continue
        expected = keras.ops.convert_to_numpy(sinusoidal_encoding(
            table.shape[0], config["d_model"], layout="halves"))  # (np.asarray: not CUDA torch)
        error = float(np.max(np.abs(table - expected))) if table.shape == expected.shape else None
        if error is None or error > 1e-3:
            raise ValueError(f"model.{stack}.embed_positions.weight is not the sinusoidal table "
                             "(sines, then cosines) that keras_tfm computes "
                             f"(shape {table.shape}, largest difference {error}).")


def from_marian(path):
    """Load a Hugging Face MarianMT (opus-mt) checkpoint as a keras_tfm `Seq2SeqTransformer`.

    Reads `config.json` and the weights with NumPy (the `marian` extra: safetensors); no torch,
    no transformers, no download. The model remembers Marian's special ids (padding = the last
    id, which also starts the decoder, `<EOS>` = 0), so `generate(model, source,
    max_length=...)` needs no ids; fine-tune with
    `MaskedSparseCategoricalCrossentropy(pad_id=model.special_ids["pad_id"])`.

    Args:
        path: a directory written by `transformers` (`save_pretrained`): `config.json` and
            `model.safetensors` (or `pytorch_model.bin`, read with torch if it is installed).

    Returns:
        A `Seq2SeqTransformer` mapping `[encoder_tokens (B, S), decoder_tokens (B, T)]` to
        logits `(B, T, vocab)`, built from keras_tfm layers with the checkpoint's weights.

    Raises:
        ValueError: a directory without a Marian config; options keras_tfm cannot represent
            (named); missing, unexpected or mis-shaped tensors (named).

    Example:

    >>> model = keras_tfm.from_marian("opus-mt-en-de")  # doctest: +SKIP
    >>> keras_tfm.generate(model, token_ids, max_length=64, method="beam")  # doctest: +SKIP
    """
    config = _read_config(path)
    kwargs = _model_kwargs(config)
    weights = _normalise_names(_read_weights(path))
    _check_positions(weights, config)
    model = Seq2SeqTransformer(**kwargs)
    pairs = _weight_map(model)
    expected = {name for name, *_ in pairs}
    # Tied copies of a matrix that the map reads once: transformers may store them or not.
    shared = weights.pop("model.shared.weight", None)
    for alias in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
        if alias in expected and alias not in weights and shared is not None:
            weights[alias] = shared
    if "model.shared.weight" in expected and shared is not None:
        weights["model.shared.weight"] = shared
    for alias in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "lm_head.weight"):
        if alias not in expected:
            weights.pop(alias, None)
    if "final_logits_bias" not in weights:  # a buffer transformers fills with zeros if absent
        weights["final_logits_bias"] = np.zeros((1, kwargs["tgt_vocab_size"]), "float32")
    missing = sorted(expected - set(weights))
    unexpected = sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(f"The weights in {path!r} do not fit the Marian config: missing "
                         f"{missing or 'none'}; unexpected {unexpected or 'none'}.")
    for name, variable, from_hf, to_hf in pairs:
        value = weights[name]
        shape = tuple(variable.shape)
        if value.size != int(np.prod(shape)) or to_hf(np.zeros(shape)).shape != value.shape:
            raise ValueError(f"Tensor {name} has shape {value.shape}; the config needs "
                             f"{to_hf(np.zeros(shape)).shape}.")
        variable.assign(from_hf(np.asarray(value, "float32"), shape))
    return model


def _copy_tokenizer(source, destination):
    present = [name for name in _TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    if "vocab.json" not in present or "source.spm" not in present:
        raise ValueError(f"tokenizer_dir={source!r} holds no MarianTokenizer (vocab.json and "
                         "source.spm are needed).")
    for name in present:
        shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))


def to_marian(model, path, max_position_embeddings=512, tokenizer_dir=None):
    """Write a keras_tfm model as a Hugging Face MarianMT directory (config + safetensors).

    `transformers.MarianMTModel.from_pretrained(path)` loads the result, and so does
    CTranslate2's converter when the directory also holds the tokenizer (`tokenizer_dir`). The
    model must have Marian's architecture: a `Seq2SeqTransformer` (e.g. from `from_marian`)
    with post-LN blocks, sinusoidal positions in the `"halves"` layout, and `start_id` and
    `end_id` set.

    Args:
        model: the `Seq2SeqTransformer` to export.
        path: the directory to write (created if needed; files in it are replaced).
        max_position_embeddings: the longest sequence transformers will accept (keras_tfm's
            sinusoidal positions have no limit; Marian's table needs one).
        tokenizer_dir: a directory whose MarianTokenizer files (`source.spm`, `target.spm`,
            `vocab.json`, `tokenizer_config.json`, ...) are copied beside the weights, e.g. the
            opus-mt directory the model came from.

    Raises:
        ValueError: the model has options Marian cannot represent (named).

    Example:

    >>> keras_tfm.to_marian(model, "my-opus-mt")  # doctest: +SKIP
    """
    if not isinstance(model, Seq2SeqTransformer):
        raise ValueError("to_marian exports a Seq2SeqTransformer (from build_transformer or "
                         f"from_marian); received {type(model).__name__}.")
    quantized = sorted({layer.quantization_mode for layer in model._flatten_layers()
                        if layer.quantization_mode is not None})
    if quantized:
        raise ValueError(f"to_marian writes float weights; this model is quantized "
                         f"({', '.join(quantized)}): export the float model, then quantize "
                         "where it is served (e.g. CTranslate2's int8).")
    c = model.get_config()
    activations = {value: key for key, value in _ACTIVATIONS.items() if key != "silu"}
    activation = c["activation"]
    problems = []
    if c["norm_first"]:
        problems.append("norm_first=True (Marian is post-LN)")
    if c["positional"] != "sinusoidal" or c["positional_layout"] != "halves":
        problems.append(f"positional={c['positional']!r}, positional_layout="
                        f"{c['positional_layout']!r} (Marian: sinusoidal, 'halves')")
    if activation not in activations:
        problems.append(f"activation={activation!r} (Marian: {sorted(activations)})")
    if c["tie_embeddings"] and not c["logits_bias"]:
        problems.append("tie_embeddings without logits_bias (Marian's final_logits_bias)")
    if c["layer_norm_epsilon"] != 1e-5:
        problems.append(f"layer_norm_epsilon={c['layer_norm_epsilon']} (Marian: 1e-5)")
    for key in ("start_id", "end_id"):
        if c[key] is None:
            problems.append(f"{key}=None (Marian needs it)")
    if problems:
        raise ValueError("This model has options a Marian checkpoint cannot represent: "
                         + "; ".join(problems) + ".")
    config = dict(
        model_type="marian", architectures=["MarianMTModel"], vocab_size=c["src_vocab_size"],
        decoder_vocab_size=c["tgt_vocab_size"], d_model=c["d_model"],
        encoder_layers=c["num_encoder_layers"], decoder_layers=c["num_decoder_layers"],
        encoder_attention_heads=c["num_heads"], decoder_attention_heads=c["num_heads"],
        encoder_ffn_dim=c["ff_dim"], decoder_ffn_dim=c["ff_dim"],
        activation_function=activations[activation], dropout=c["dropout"],
        attention_dropout=c["dropout"] if c["attention_dropout"] is None
        else c["attention_dropout"],
        activation_dropout=c["dropout"] if c["activation_dropout"] is None
        else c["activation_dropout"],
        max_position_embeddings=max_position_embeddings, scale_embedding=c["scale_embeddings"],
        share_encoder_decoder_embeddings=c["share_embeddings"] or (
            c["src_vocab_size"] == c["tgt_vocab_size"] and not c["tie_embeddings"]),
        tie_word_embeddings=c["tie_embeddings"], pad_token_id=c["pad_id"],
        decoder_start_token_id=c["start_id"], eos_token_id=c["end_id"],
        forced_eos_token_id=c["end_id"], is_encoder_decoder=True,
    )
    generation = dict(pad_token_id=c["pad_id"], decoder_start_token_id=c["start_id"],
                      eos_token_id=c["end_id"], forced_eos_token_id=c["end_id"],
                      bad_words_ids=[[c["pad_id"]]], num_beams=4,
                      max_length=max_position_embeddings)
    tensors = {name: np.ascontiguousarray(to_hf(np.asarray(keras.ops.convert_to_numpy(variable),
                                                           "float32")))
               for name, variable, _, to_hf in _weight_map(model)}
    embedding = "model.shared.weight" if c["share_embeddings"] else "model.decoder.embed_tokens.weight"
    if c["start_id"] == c["pad_id"] and np.any(tensors[embedding][c["pad_id"]]):
        warnings.warn("The padding id's embedding row is not zero. transformers uses it as it is "
                      "(the decoder starts from that id), but CTranslate2 starts the decoder "
                      "from a zero vector, so its translations will differ. Fine-tune with "
                      "freeze_pad_embedding=True (from_marian's default) to keep the row fixed.",
                      stacklevel=2)
    if c["share_embeddings"]:  # the copies older checkpoints carry; transformers ties them
        for alias in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            tensors[alias] = tensors["model.shared.weight"].copy()
    elif config["share_encoder_decoder_embeddings"]:  # one vocabulary, matrices not tied
        tensors["model.shared.weight"] = tensors["model.encoder.embed_tokens.weight"].copy()
    if c["tie_embeddings"]:
        source = ("model.shared.weight" if c["share_embeddings"]
                  else "model.decoder.embed_tokens.weight")
        tensors["lm_head.weight"] = tensors[source].copy()
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, path)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    for filename, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(path, filename), "w") as f:
            json.dump(content, f, indent=2)
