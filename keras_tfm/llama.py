"""Hugging Face Llama-family checkpoints (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
`MistralForCausalLM`) ↔ keras_tfm `LanguageModel`s.

The three share one architecture: pre-RMSNorm decoder blocks with rotary positions (the
"halves" rotation), grouped-query attention, a SwiGLU feed-forward, a final RMSNorm and an
output projection tied to the token embedding or not. Qwen2 adds biases to the query, key and
value projections; Mistral may limit attention to a sliding window, which keras_tfm does not
(a window shorter than the model's positions is refused). `_tensors` names every tensor both
ways.
"""

from keras_tfm import checkpoints as ckpt
from keras_tfm.models import LanguageModel

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "mistral": "MistralForCausalLM"}
_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
                 attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                 max_position_embeddings=2048)


def rope_theta(config):
    """The rotary base of a config (transformers 5's `rope_parameters`, or the older
    `rope_theta` / `rope_scaling`); a ValueError for a scaled rotary embedding."""
    parameters = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    for source in (parameters, scaling):
        kind = source.get("rope_type", source.get("type", "default"))
        if kind not in ("default", None):
            raise ValueError(f"This checkpoint uses rope scaling of type {kind!r} "
                             f"({source}); keras_tfm implements the unscaled rotary embedding "
                             "only (rope_type 'default').")
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _model_kwargs(path, config):
    model_type = config.get("model_type")
    config = _DEFAULTS | config
    problems = []
    d_model, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim not in (None, d_model // heads) or d_model % heads:
        problems.append(f"head_dim={head_dim} with hidden_size={d_model} and "
                        f"num_attention_heads={heads} (keras_tfm: hidden_size / heads)")
    activation = config["hidden_act"]
    if activation not in ckpt.ACTIVATIONS:
        problems.append(f"hidden_act={activation!r} (supported: {sorted(ckpt.ACTIVATIONS)})")
    if config["attention_bias"] or config["mlp_bias"]:
        problems.append(f"attention_bias={config['attention_bias']}, mlp_bias="
                        f"{config['mlp_bias']} (keras_tfm reads bias-free Llama projections)")
    positions = config["max_position_embeddings"]
    window = config.get("sliding_window")
    sliding_layers = [kind for kind in config.get("layer_types") or [] if kind != "full_attention"]
    uses_window = config.get("use_sliding_window", model_type == "mistral") or sliding_layers
    if uses_window and window is not None and window < positions:
        problems.append(f"sliding_window={window} shorter than max_position_embeddings="
                        f"{positions} (keras_tfm attends to every earlier position)")
    try:
        theta = rope_theta(config)
    except ValueError as error:
        problems.append(str(error).rstrip("."))
        theta = None
    ckpt.refuse(f"{model_type} config", problems)
    bos, eos, pad = ckpt.special_ids(path, config)
    if pad is not None and pad in (bos, eos):
        pad = None  # (a pad token that is also the end token must stay generable)
    return dict(
        vocab_size=config["vocab_size"], d_model=d_model, num_heads=heads,
        ff_dim=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        positional="rotary", num_key_value_heads=config.get("num_key_value_heads") or heads,
        norm_first=True, dropout=float(config["attention_dropout"]),
        activation=ckpt.ACTIVATIONS[activation], gated_feed_forward=True,
        normalization="rms_norm", layer_norm_epsilon=float(config["rms_norm_eps"]),
        use_bias=False, qkv_bias=True if model_type == "qwen2" else None,
        rotary_max_wavelength=theta, scale_embeddings=False,
        tie_embeddings=bool(config["tie_word_embeddings"]), pad_id=pad, start_id=bos,
        end_id=eos, name=model_type)


def _tensors(model):
    """The checkpoint tensors of a Llama-family `LanguageModel`."""
    layers = {layer.name: layer for layer in model.layers}
    config = model.get_config()
    tensors = [ckpt.same("model.embed_tokens.weight", layers["token_embedding"].embeddings)]
    for i in range(config["num_layers"]):
        block, prefix = layers[f"decoder_block_{i}"], f"model.layers.{i}."
        attention = block.self_attention
        for name, dense in (("q_proj", attention.query_dense), ("k_proj", attention.key_dense),
                            ("v_proj", attention.value_dense)):
            tensors.append(ckpt.linear(f"{prefix}self_attn.{name}.weight", dense.kernel))
            if dense.bias is not None:
                tensors.append(ckpt.bias(f"{prefix}self_attn.{name}.bias", dense.bias))
        tensors.append(ckpt.linear(f"{prefix}self_attn.o_proj.weight",
                                   attention.output_dense.kernel, in_axes=2))
        tensors.append(ckpt.same(f"{prefix}input_layernorm.weight",
                                 block.self_attention_norm.scale))
        tensors.append(ckpt.same(f"{prefix}post_attention_layernorm.weight",
                                 block.feed_forward_norm.scale))
        feed_forward = block.feed_forward
        for name, dense in (("gate_proj", feed_forward.intermediate_dense),
                            ("up_proj", feed_forward.up_dense),
                            ("down_proj", feed_forward.output_dense)):
            tensors.append(ckpt.linear(f"{prefix}mlp.{name}.weight", dense.kernel))
    tensors.append(ckpt.same("model.norm.weight", layers["final_norm"].scale))
    if not config["tie_embeddings"]:
        tensors.append(ckpt.linear("lm_head.weight", layers["logits"].kernel))
    return tensors


def from_llama(path, config, dtype=None, verbose="auto"):
    """A Llama / Qwen2 / Mistral checkpoint as a `LanguageModel` (see `from_pretrained`)."""
    kwargs = _model_kwargs(path, config)
    checkpoint = ckpt.Checkpoint(path)
    checkpoint.rename(ckpt.add_prefix("model.", checkpoint.names, keep=(r"lm_head\..*",)))
    model = LanguageModel(**kwargs, dtype=dtype)
    ignore = [r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq"]  # older buffers
    if kwargs["tie_embeddings"]:
        ignore.append(r"lm_head\.weight")  # a stored copy of the tied matrix
    ckpt.load_tensors(checkpoint, _tensors(model), ignore=ignore,
                      what=f"the {config.get('model_type')} config", verbose=verbose)
    return model


def check_exportable(config):
    """Why a `LanguageModel` config is not a Llama-family checkpoint (a list, empty if it is)."""
    wanted = dict(positional="rotary", norm_first=True, normalization="rms_norm",
                  gated_feed_forward=True, use_bias=False, scale_embeddings=False)
    problems = [f"{key}={config[key]!r} (Llama: {value!r})" for key, value in wanted.items()
                if config[key] != value]
    if config["activation"] not in ("silu", "gelu", "relu", "gelu_approximate"):
        problems.append(f"activation={config['activation']!r}")
    if config["qkv_bias"] not in (None, True):
        problems.append(f"qkv_bias={config['qkv_bias']!r}")
    return problems


def to_llama(model, path, max_position_embeddings=None, model_type=None,
             max_shard_size="5GB", verbose=False):
    """Write a Llama-family `LanguageModel` as a transformers directory (see `to_pretrained`)."""
    c = model.get_config()
    qwen = bool(c["qkv_bias"])
    model_type = model_type or ("qwen2" if qwen else "llama")
    problems = check_exportable(c)
    if model_type not in MODEL_TYPES:
        problems.append(f"model_type={model_type!r} (one of {sorted(MODEL_TYPES)})")
    elif qwen != (model_type == "qwen2"):
        problems.append(f"qkv_bias={c['qkv_bias']} as model_type={model_type!r} (query, key "
                        "and value biases are Qwen2's)")
    ckpt.refuse("model (as a Llama-family checkpoint)", problems)
    activations = {"silu": "silu", "gelu": "gelu", "relu": "relu",
                   "gelu_approximate": "gelu_pytorch_tanh"}
    heads = c["num_heads"]
    config = dict(
        architectures=[MODEL_TYPES[model_type]], model_type=model_type,
        vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["ff_dim"],
        num_hidden_layers=c["num_layers"], num_attention_heads=heads,
        num_key_value_heads=c["num_key_value_heads"] or heads, head_dim=c["d_model"] // heads,
        hidden_act=activations[c["activation"]],
        max_position_embeddings=int(max_position_embeddings or c["max_length"] or 4096),
        rms_norm_eps=c["layer_norm_epsilon"], rope_theta=c["rotary_max_wavelength"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rotary_max_wavelength"]},
        tie_word_embeddings=c["tie_embeddings"], bos_token_id=c["start_id"],
        eos_token_id=c["end_id"], pad_token_id=c["pad_id"], attention_dropout=c["dropout"],
        dtype=ckpt.checkpoint_dtype(model))
    if model_type == "llama":
        config |= dict(attention_bias=False, mlp_bias=False)
    else:
        config |= dict(use_sliding_window=False, sliding_window=None,
                       max_window_layers=c["num_layers"])
    ckpt.write_tensors(path, _tensors(model), max_shard_size=max_shard_size, verbose=verbose)
    ckpt.write_json(path, "config.json", config)
    ckpt.write_json(path, "generation_config.json",
                    {key: config[key] for key in ("bos_token_id", "eos_token_id",
                                                  "pad_token_id")})
