"""Hugging Face GPT-2 checkpoints (`GPT2LMHeadModel`) ↔ keras_tfm `LanguageModel`s.

GPT-2 is a pre-LN decoder with learned positions, biases on every projection, a final
LayerNorm, a GELU with the tanh approximation (`gelu_new`) and an output projection tied to
the token embedding (no bias). Its linear layers are `Conv1D`s, whose weights are stored
`(in, out)` (the transpose of `torch.nn.Linear`'s), and one `c_attn` tensor holds the query,
key and value projections side by side. `_tensors` names every tensor both ways.
"""

import numpy as np

from keras_tfm import checkpoints as ckpt
from keras_tfm.models import LanguageModel

_DEFAULTS = dict(n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 activation_function="gelu_new", resid_pdrop=0.1, layer_norm_epsilon=1e-5,
                 scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                 add_cross_attention=False, tie_word_embeddings=True, bos_token_id=50256,
                 eos_token_id=50256)
# Options whose other value changes the computation in a way keras_tfm does not follow.
_FIXED = dict(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
              add_cross_attention=False, tie_word_embeddings=True)
_ACTIVATION_NAMES = {"gelu_approximate": "gelu_new", "gelu": "gelu", "relu": "relu",
                     "silu": "silu"}


def _model_kwargs(path, config):
    config = _DEFAULTS | config
    problems = [f"{key}={config[key]!r} (keras_tfm: {value!r})" for key, value in _FIXED.items()
                if config[key] != value]
    activation = config["activation_function"]
    if activation not in ckpt.ACTIVATIONS:
        problems.append(f"activation_function={activation!r} (supported: "
                        f"{sorted(ckpt.ACTIVATIONS)})")
    if config["n_embd"] % config["n_head"]:
        problems.append(f"n_embd={config['n_embd']} not divisible by n_head={config['n_head']}")
    ckpt.refuse("GPT-2 config", problems)
    bos, eos, pad = ckpt.special_ids(path, config)
    if pad is not None and pad in (bos, eos):
        pad = None
    return dict(
        vocab_size=config["vocab_size"], d_model=config["n_embd"], num_heads=config["n_head"],
        ff_dim=config["n_inner"] or 4 * config["n_embd"], num_layers=config["n_layer"],
        positional="learned", max_length=config["n_positions"], norm_first=True,
        dropout=float(config["resid_pdrop"]), activation=ckpt.ACTIVATIONS[activation],
        normalization="layer_norm", layer_norm_epsilon=float(config["layer_norm_epsilon"]),
        use_bias=True, scale_embeddings=False, tie_embeddings=True, pad_id=pad, start_id=bos,
        end_id=eos, name="gpt2")


def _fused(name, variables, flat):
    """`c_attn`: the query, key and value kernels `(d, heads, k)` (or biases `(heads, k)`)
    side by side in one `(d, 3·d)` weight (or `(3·d,)` bias)."""
    shapes = [tuple(v.shape) for v in variables]

    def load(array):
        return [part.reshape(shape) for part, shape in zip(np.split(array, 3, axis=-1), shapes)]

    def save(arrays):
        if flat:
            return np.concatenate([a.reshape(-1) for a in arrays])
        return np.concatenate([a.reshape(a.shape[0], -1) for a in arrays], axis=-1)

    return ckpt.Tensor(name, list(variables), load, save)


def _tensors(model):
    """The checkpoint tensors of a GPT-2 `LanguageModel`."""
    layers = {layer.name: layer for layer in model.layers}
    config = model.get_config()
    tensors = [ckpt.same("transformer.wte.weight", layers["token_embedding"].embeddings),
               ckpt.same("transformer.wpe.weight",
                         layers["position_embedding"].position_embeddings)]
    for i in range(config["num_layers"]):
        block, prefix = layers[f"decoder_block_{i}"], f"transformer.h.{i}."
        attention, feed_forward = block.self_attention, block.feed_forward
        projections = (attention.query_dense, attention.key_dense, attention.value_dense)
        tensors += [
            ckpt.same(f"{prefix}ln_1.weight", block.self_attention_norm.gamma),
            ckpt.same(f"{prefix}ln_1.bias", block.self_attention_norm.beta),
            _fused(f"{prefix}attn.c_attn.weight", [d.kernel for d in projections], flat=False),
            _fused(f"{prefix}attn.c_attn.bias", [d.bias for d in projections], flat=True),
            ckpt.conv1d(f"{prefix}attn.c_proj.weight", attention.output_dense.kernel, in_axes=2),
            ckpt.bias(f"{prefix}attn.c_proj.bias", attention.output_dense.bias),
            ckpt.same(f"{prefix}ln_2.weight", block.feed_forward_norm.gamma),
            ckpt.same(f"{prefix}ln_2.bias", block.feed_forward_norm.beta),
            ckpt.conv1d(f"{prefix}mlp.c_fc.weight", feed_forward.intermediate_dense.kernel),
            ckpt.bias(f"{prefix}mlp.c_fc.bias", feed_forward.intermediate_dense.bias),
            ckpt.conv1d(f"{prefix}mlp.c_proj.weight", feed_forward.output_dense.kernel),
            ckpt.bias(f"{prefix}mlp.c_proj.bias", feed_forward.output_dense.bias),
        ]
    norm = layers["final_norm"]
    tensors += [ckpt.same("transformer.ln_f.weight", norm.gamma),
                ckpt.same("transformer.ln_f.bias", norm.beta)]
    return tensors


def from_gpt2(path, config, dtype=None, verbose="auto"):
    """A GPT-2 checkpoint as a `LanguageModel` (see `from_pretrained`)."""
    kwargs = _model_kwargs(path, config)
    checkpoint = ckpt.Checkpoint(path)
    # The original checkpoints name the tensors without `transformer.` (a bare GPT2Model).
    checkpoint.rename(ckpt.add_prefix("transformer.", checkpoint.names, keep=(r"lm_head\..*",)))
    model = LanguageModel(**kwargs, dtype=dtype)
    ignore = [r"lm_head\.weight",  # the tied matrix's stored copy
              r"transformer\.h\.\d+\.attn\.(masked_)?bias"]  # older checkpoints' mask buffers
    ckpt.load_tensors(checkpoint, _tensors(model), ignore=ignore, what="the GPT-2 config",
                      verbose=verbose)
    return model


def check_exportable(config):
    """Why a `LanguageModel` config is not a GPT-2 checkpoint (a list, empty if it is)."""
    wanted = dict(positional="learned", norm_first=True, normalization="layer_norm",
                  gated_feed_forward=False, use_bias=True, qkv_bias=None,
                  scale_embeddings=False, tie_embeddings=True)
    problems = [f"{key}={config[key]!r} (GPT-2: {value!r})" for key, value in wanted.items()
                if config[key] != value]
    if config["num_key_value_heads"] not in (None, config["num_heads"]):
        problems.append(f"num_key_value_heads={config['num_key_value_heads']} (GPT-2: one "
                        "per head)")
    if config["activation"] not in _ACTIVATION_NAMES:
        problems.append(f"activation={config['activation']!r} (GPT-2: "
                        f"{sorted(_ACTIVATION_NAMES)})")
    return problems


def to_gpt2(model, path, max_shard_size="5GB", verbose=False):
    """Write a GPT-2 `LanguageModel` as a transformers directory (see `to_pretrained`)."""
    c = model.get_config()
    ckpt.refuse("model (as a GPT-2 checkpoint)", check_exportable(c))
    config = dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c["vocab_size"],
        n_embd=c["d_model"], n_head=c["num_heads"], n_layer=c["num_layers"],
        n_positions=c["max_length"], n_inner=c["ff_dim"],
        activation_function=_ACTIVATION_NAMES[c["activation"]],
        layer_norm_epsilon=c["layer_norm_epsilon"], resid_pdrop=c["dropout"],
        embd_pdrop=c["dropout"], attn_pdrop=c["dropout"], scale_attn_weights=True,
        tie_word_embeddings=True, bos_token_id=c["start_id"], eos_token_id=c["end_id"],
        pad_token_id=c["pad_id"], dtype=ckpt.checkpoint_dtype(model))
    ckpt.write_tensors(path, _tensors(model), max_shard_size=max_shard_size, verbose=verbose)
    ckpt.write_json(path, "config.json", config)
    ckpt.write_json(path, "generation_config.json",
                    {key: config[key] for key in ("bos_token_id", "eos_token_id",
                                                  "pad_token_id")})
