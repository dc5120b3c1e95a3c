"""Hugging Face BERT checkpoints (`BertModel`, `BertForSequenceClassification`) → keras_tfm
`EncoderModel`s.

BERT is a post-LN encoder: learned positions, token-type (segment) embeddings, a LayerNorm
of the summed embeddings, biases everywhere, GELU; its pooler is a dense layer with tanh on
the first token, and the classifier a dense layer on the pooler's output. Checkpoints of other
BERT heads (masked LM, pre-training) load as `BertModel` (the head's tensors are skipped).
"""

from keras_tfm import checkpoints as ckpt
from keras_tfm.models import EncoderModel

_DEFAULTS = dict(hidden_act="gelu", hidden_dropout_prob=0.1, max_position_embeddings=512,
                 type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0,
                 position_embedding_type="absolute", is_decoder=False,
                 add_cross_attention=False)
_FIXED = dict(position_embedding_type="absolute", is_decoder=False, add_cross_attention=False)
CLASSIFIER = "BertForSequenceClassification"


def _old_names(name):
    """Names as transformers saves them: TF-era checkpoints call LayerNorm's weights gamma
    and beta; a bare `BertModel`'s have no `bert.` prefix."""
    if ".LayerNorm." in name:
        name = name.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(
            ".LayerNorm.beta", ".LayerNorm.bias")
    return name


def _model_kwargs(config, checkpoint):
    config = _DEFAULTS | config
    problems = [f"{key}={config[key]!r} (keras_tfm: {value!r})" for key, value in _FIXED.items()
                if config[key] != value]
    activation = config["hidden_act"]
    if activation not in ckpt.ACTIVATIONS:
        problems.append(f"hidden_act={activation!r} (supported: {sorted(ckpt.ACTIVATIONS)})")
    if not config.get("type_vocab_size"):
        problems.append(f"type_vocab_size={config.get('type_vocab_size')!r} (at least 1)")
    classifier = CLASSIFIER in (config.get("architectures") or [])
    num_classes = None
    if classifier:
        num_classes = len(config.get("id2label") or {}) or config.get("num_labels", 2)
        if config.get("problem_type") not in (None, "single_label_classification",
                                              "multi_label_classification"):
            problems.append(f"problem_type={config['problem_type']!r} (a regression head)")
    ckpt.refuse("BERT config", problems)
    return dict(
        vocab_size=config["vocab_size"], d_model=config["hidden_size"],
        num_heads=config["num_attention_heads"], ff_dim=config["intermediate_size"],
        num_layers=config["num_hidden_layers"], positional="learned",
        max_length=config["max_position_embeddings"], norm_first=False,
        dropout=float(config["hidden_dropout_prob"]), activation=ckpt.ACTIVATIONS[activation],
        normalization="layer_norm", layer_norm_epsilon=float(config["layer_norm_eps"]),
        use_bias=True, scale_embeddings=False, pad_id=config["pad_token_id"],
        num_classes=num_classes, pooling="first",
        segment_vocab_size=config["type_vocab_size"], embedding_norm=True,
        pooler="bert.pooler.dense.weight" in checkpoint.names, name="bert")


def _norm(prefix, norm):
    return [ckpt.same(f"{prefix}.weight", norm.gamma), ckpt.same(f"{prefix}.bias", norm.beta)]


def _dense(prefix, dense, in_axes=1):
    return [ckpt.linear(f"{prefix}.weight", dense.kernel, in_axes),
            ckpt.bias(f"{prefix}.bias", dense.bias)]


def _tensors(model):
    """The checkpoint tensors of a BERT `EncoderModel`."""
    layers = {layer.name: layer for layer in model.layers}
    config = model.get_config()
    tensors = [
        ckpt.same("bert.embeddings.word_embeddings.weight", layers["token_embedding"].embeddings),
        ckpt.same("bert.embeddings.position_embeddings.weight",
                  layers["position_embedding"].position_embeddings),
        ckpt.same("bert.embeddings.token_type_embeddings.weight",
                  layers["segment_embedding"].embeddings),
        *_norm("bert.embeddings.LayerNorm", layers["embedding_norm"]),
    ]
    for i in range(config["num_layers"]):
        block, prefix = layers[f"encoder_block_{i}"], f"bert.encoder.layer.{i}."
        attention, feed_forward = block.self_attention, block.feed_forward
        tensors += [
            *_dense(f"{prefix}attention.self.query", attention.query_dense),
            *_dense(f"{prefix}attention.self.key", attention.key_dense),
            *_dense(f"{prefix}attention.self.value", attention.value_dense),
            *_dense(f"{prefix}attention.output.dense", attention.output_dense, in_axes=2),
            *_norm(f"{prefix}attention.output.LayerNorm", block.self_attention_norm),
            *_dense(f"{prefix}intermediate.dense", feed_forward.intermediate_dense),
            *_dense(f"{prefix}output.dense", feed_forward.output_dense),
            *_norm(f"{prefix}output.LayerNorm", block.feed_forward_norm),
        ]
    if config["pooler"]:
        pooler = layers["pooler"] if config["num_classes"] else model.pooler
        tensors += _dense("bert.pooler.dense", pooler)
    if config["num_classes"]:
        tensors += _dense("classifier", layers["classifier"])
    return tensors


def from_bert(path, config, dtype=None, verbose="auto"):
    """A BERT checkpoint as an `EncoderModel` (see `from_pretrained`)."""
    checkpoint = ckpt.Checkpoint(path)
    checkpoint.rename(_old_names)
    checkpoint.rename(ckpt.add_prefix("bert.", checkpoint.names,
                                      keep=(r"classifier\..*", r"cls\..*")))
    kwargs = _model_kwargs(config, checkpoint)
    model = EncoderModel(**kwargs, dtype=dtype)
    ignore = [r"bert\.embeddings\.position_ids"]  # a buffer older checkpoints store
    if not kwargs["num_classes"]:
        ignore.append(r"cls\..*")  # the heads of BertForMaskedLM / BertForPreTraining
    ckpt.load_tensors(checkpoint, _tensors(model), ignore=ignore, what="the BERT config",
                      verbose=verbose)
    return model


def check_exportable(config):
    """Why an `EncoderModel` config is not a BERT checkpoint (a list, empty if it is)."""
    wanted = dict(positional="learned", norm_first=False, normalization="layer_norm",
                  gated_feed_forward=False, use_bias=True, qkv_bias=None,
                  scale_embeddings=False, embedding_norm=True)
    problems = [f"{key}={config.get(key)!r} (BERT: {value!r})" for key, value in wanted.items()
                if config.get(key) != value]
    if config.get("segment_vocab_size") is None:
        problems.append("segment_vocab_size=None (BERT has token types)")
    if config["num_key_value_heads"] not in (None, config["num_heads"]):
        problems.append(f"num_key_value_heads={config['num_key_value_heads']}")
    if config["num_classes"] is not None and not (config["pooler"]
                                                  and config["pooling"] == "first"):
        problems.append(f"a classifier on pooling={config['pooling']!r} without the pooler "
                        "(BERT's classifier reads the pooler)")
    if config["activation"] not in _ACTIVATION_NAMES:
        problems.append(f"activation={config['activation']!r} (BERT: "
                        f"{sorted(_ACTIVATION_NAMES)})")
    return problems


_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_approximate": "gelu_new", "relu": "relu",
                     "silu": "silu"}


def to_bert(model, path, max_shard_size="5GB", verbose=False):
    """Write a BERT-shaped `EncoderModel` as a transformers directory: `BertModel` (features),
    or `BertForSequenceClassification` with a classifier (see `to_pretrained`)."""
    c = model.get_config()
    ckpt.refuse("model (as a BERT checkpoint)", check_exportable(c))
    classes = c["num_classes"]
    config = dict(
        architectures=[CLASSIFIER if classes else "BertModel"], model_type="bert",
        vocab_size=c["vocab_size"], hidden_size=c["d_model"],
        num_hidden_layers=c["num_layers"], num_attention_heads=c["num_heads"],
        intermediate_size=c["ff_dim"], hidden_act=_ACTIVATION_NAMES[c["activation"]],
        hidden_dropout_prob=c["dropout"], attention_probs_dropout_prob=c["dropout"],
        max_position_embeddings=c["max_length"], type_vocab_size=c["segment_vocab_size"],
        layer_norm_eps=c["layer_norm_epsilon"], pad_token_id=c["pad_id"],
        position_embedding_type="absolute", dtype=ckpt.checkpoint_dtype(model))
    if classes:
        config |= dict(id2label={str(i): f"LABEL_{i}" for i in range(classes)},
                       label2id={f"LABEL_{i}": i for i in range(classes)})
    tensors = _tensors(model)
    if not classes:  # a bare BertModel's names, as its save_pretrained writes them
        for tensor in tensors:
            tensor.name = tensor.name.removeprefix("bert.")
    ckpt.write_tensors(path, tensors, max_shard_size=max_shard_size, verbose=verbose)
    ckpt.write_json(path, "config.json", config)
