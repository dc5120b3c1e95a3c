"""Helpers shared by the tests: conversion to NumPy, references and a Keras layer test."""

import keras
import numpy as np
from keras import ops

BACKEND = keras.backend.backend()


def to_np(x):
    return np.asarray(ops.convert_to_numpy(x))


def np_softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def np_attention(q, k, v, mask=None):
    """NumPy softmax(QKᵀ/√d_k)V on (B, T, H, d) arrays; mask (B, T, S), True = allowed.

    Returns (output (B, T, H, d_v), weights (B, H, T, S)). Rows with no allowed key give zeros
    (the package's documented convention)."""
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    m = np.ones(scores.shape, bool) if mask is None else np.broadcast_to(mask[:, None], scores.shape)
    has_key = m.any(-1, keepdims=True)
    weights = np_softmax(np.where(m, scores, -1e30)) * m
    weights = np.where(has_key, weights, 0.0)
    return np.einsum("bhts,bshd->bthd", weights, v), weights


def np_dense(x, dense):
    """Apply an EinsumDense sublayer with NumPy, from its own weights."""
    kernel = to_np(dense.kernel)
    out = np.einsum(dense.equation, x, kernel)
    if dense.bias is not None:
        out = out + to_np(dense.bias)
    return out


def np_mha(layer, query, context, mask=None):
    """NumPy reference of a keras_tfm attention layer, built from the layer's own weights."""
    q = np_dense(query, layer.query_dense)
    k = np_dense(context, layer.key_dense)
    v = np_dense(context, layer.value_dense)
    attended, _ = np_attention(q, k, v, mask)
    return np_dense(attended, layer.output_dense)


def jit_options():
    """jit_compile for `fit`: on for JAX and TensorFlow (torch.compile is not exercised)."""
    return {"jit_compile": BACKEND in ("jax", "tensorflow")}


def record_traces(monkeypatch, shape_of=lambda shape: shape):
    """Patch `keras_tfm.search.search` to note `shape_of(shape)` each time a search runs (under
    JAX and TensorFlow, once per trace), the shape of its sources (a translation: its source
    padding mask) or prompts (a language model). Returns the list of notes."""
    from keras_tfm import search

    traces = []
    original = search.search

    def recorded(decoder, settings, cache, prompts, *args, **kwargs):
        tokens = cache["source_mask"] if "source_mask" in cache else prompts
        traces.append(shape_of(tuple(tokens.shape)))
        return original(decoder, settings, cache, prompts, *args, **kwargs)

    monkeypatch.setattr(search, "search", recorded)
    return traces


def assert_config_round_trip(layer):
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    # Serialization through the registered name, as a .keras file does it.
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert type(restored) is type(layer)
    assert restored.get_config() == config
    return clone


def run_layer_test(make_layer, call, arrays, *, expected_shape, fit=True):
    """A layer test in the spirit of Keras' `run_layer_test`.

    `make_layer()` builds a fresh layer, `call(layer, *tensors)` calls it and returns its main
    output; `arrays` are NumPy inputs with a leading batch axis. Checks: config round trip,
    eager output shape, symbolic shape equal to the eager one, one `fit` step (jit-compiled on
    JAX and TensorFlow) that changes the weights. Mixed precision: `run_mixed_precision_test`.
    """
    layer = make_layer()
    eager = call(layer, *arrays)
    assert tuple(eager.shape) == tuple(expected_shape)
    assert_config_round_trip(layer)

    symbolic_inputs = [keras.Input(a.shape[1:], dtype=str(a.dtype)) for a in arrays]
    fresh = make_layer()
    symbolic = call(fresh, *symbolic_inputs)
    assert tuple(symbolic.shape) == (None,) + tuple(expected_shape[1:])
    assert tuple(fresh.compute_output_shape(*[(None,) + a.shape[1:] for a in arrays])) == (
        (None,) + tuple(expected_shape[1:]))

    if fit:
        model = keras.Model(symbolic_inputs, symbolic)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", **jit_options())
        before = [to_np(w).copy() for w in fresh.trainable_weights]
        assert before, "the layer has no trainable weights to fit"
        target = np.random.default_rng(0).normal(size=expected_shape).astype("float32")
        history = model.fit(list(arrays), target, batch_size=len(arrays[0]), epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        after = [to_np(w) for w in fresh.trainable_weights]
        assert any(not np.allclose(a, b) for a, b in zip(before, after))



def run_mixed_precision_test(make_layer, call, arrays, policy):
    """Under `policy`, eager and jit-compiled outputs are finite and in the compute dtype, and
    the weights stay float32.

    The jit-compiled half is skipped for JAX with float16 on the CPU only: XLA there has no
    float16 matmul under jit (dot_general F16_F16_F32 is unsupported)."""
    import pytest

    compute_dtype = policy.split("_")[1]
    keras.config.set_dtype_policy(policy)
    try:
        layer = make_layer()
        out = call(layer, *arrays)
        assert keras.backend.standardize_dtype(out.dtype) == compute_dtype
        assert np.isfinite(to_np(ops.cast(out, "float32"))).all()
        assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in layer.weights)
        if BACKEND == "jax" and compute_dtype == "float16":
            import jax

            if jax.default_backend() == "cpu":
                pytest.skip("eager float16 checked; under jit, XLA on JAX's CPU has no float16 "
                            "matmul (dot_general F16_F16_F32 unsupported)")
        inputs = [keras.Input(a.shape[1:], dtype=str(a.dtype)) for a in arrays]
        model = keras.Model(inputs, call(make_layer(), *inputs))
        model.compile(jit_compile=BACKEND != "torch")
        jitted = model.predict(list(arrays), verbose=0)
        assert np.isfinite(np.asarray(jitted, "float32")).all()
    finally:
        keras.config.set_dtype_policy("float32")


# --- torch.nn oracles carrying a keras_tfm layer's weights (float64) ---------------------------

def _t(array):
    import torch

    return torch.from_numpy(np.asarray(array, "float64"))


def copy_attention_to_torch(layer, mha):
    """Copy a keras_tfm attention layer into a torch.nn.MultiheadAttention (d_k = d_model / H)."""
    import torch

    d_model = mha.embed_dim
    kernels = [to_np(d.kernel).reshape(d_model, d_model).T
               for d in (layer.query_dense, layer.key_dense, layer.value_dense)]
    biases = [to_np(d.bias).reshape(d_model)
              for d in (layer.query_dense, layer.key_dense, layer.value_dense)]
    with torch.no_grad():
        mha.in_proj_weight.copy_(_t(np.concatenate(kernels, 0)))
        mha.in_proj_bias.copy_(_t(np.concatenate(biases, 0)))
        mha.out_proj.weight.copy_(_t(to_np(layer.output_dense.kernel).reshape(d_model, d_model).T))
        mha.out_proj.bias.copy_(_t(to_np(layer.output_dense.bias)))


def copy_dense_to_torch(dense, linear):
    import torch

    with torch.no_grad():
        linear.weight.copy_(_t(to_np(dense.kernel).T))
        linear.bias.copy_(_t(to_np(dense.bias)))


def copy_norm_to_torch(norm, torch_norm):
    import torch

    with torch.no_grad():
        torch_norm.weight.copy_(_t(to_np(norm.gamma)))
        torch_norm.bias.copy_(_t(to_np(norm.beta)))


def torch_block_from(block, d_model, decoder=False):
    """torch.nn.TransformerEncoderLayer / TransformerDecoderLayer with a keras_tfm block's weights."""
    import torch

    cls = torch.nn.TransformerDecoderLayer if decoder else torch.nn.TransformerEncoderLayer
    ref = cls(d_model, block.num_heads, dim_feedforward=block.ff_dim, dropout=0.0,
              batch_first=True, norm_first=block.norm_first, dtype=torch.float64)
    copy_attention_to_torch(block.self_attention, ref.self_attn)
    copy_dense_to_torch(block.feed_forward.intermediate_dense, ref.linear1)
    copy_dense_to_torch(block.feed_forward.output_dense, ref.linear2)
    copy_norm_to_torch(block.self_attention_norm, ref.norm1)
    if decoder:
        copy_attention_to_torch(block.cross_attention, ref.multihead_attn)
        copy_norm_to_torch(block.cross_attention_norm, ref.norm2)
        copy_norm_to_torch(block.feed_forward_norm, ref.norm3)
    else:
        copy_norm_to_torch(block.feed_forward_norm, ref.norm2)
    return ref.eval()


# --- transformers Llama carried into a keras_tfm language model --------------------------------

def llama_and_language_model(vocab_size=64, d_model=32, num_heads=4, num_key_value_heads=2,
                             ff_dim=48, num_layers=2, rope_theta=500.0, seed=0, **kwargs):
    """A random-weight `transformers.LlamaForCausalLM` (rotary, GQA, SwiGLU, RMSNorm, pre-LN,
    untied) and a `build_language_model` model carrying its weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from keras_tfm import build_language_model

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=ff_dim,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads,
                         num_key_value_heads=num_key_value_heads, rope_theta=rope_theta,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         max_position_embeddings=128, attn_implementation="eager")
    llama = LlamaForCausalLM(config).eval()
    lm = build_language_model(
        vocab_size, d_model=d_model, num_heads=num_heads, ff_dim=ff_dim, num_layers=num_layers,
        positional="rotary", num_key_value_heads=num_key_value_heads, norm_first=True,
        activation="silu", gated_feed_forward=True, normalization="rms_norm",
        layer_norm_epsilon=1e-6, use_bias=False, rotary_max_wavelength=rope_theta, **kwargs)
    weights = {k: v.detach().numpy() for k, v in llama.state_dict().items()}
    head = d_model // num_heads

    def assign(variable, value):
        assert tuple(variable.shape) == value.shape, (variable.path, value.shape)
        variable.assign(value)

    assign(lm.get_layer("token_embedding").embeddings, weights["model.embed_tokens.weight"])
    for i in range(num_layers):
        block, prefix = lm.get_layer(f"decoder_block_{i}"), f"model.layers.{i}."
        attention = block.self_attention
        for dense, name, heads in ((attention.query_dense, "q_proj", num_heads),
                                   (attention.key_dense, "k_proj", num_key_value_heads),
                                   (attention.value_dense, "v_proj", num_key_value_heads)):
            assign(dense.kernel,
                   weights[prefix + f"self_attn.{name}.weight"].T.reshape(d_model, heads, head))
        assign(attention.output_dense.kernel,
               weights[prefix + "self_attn.o_proj.weight"].T.reshape(num_heads, head, d_model))
        assign(block.self_attention_norm.scale, weights[prefix + "input_layernorm.weight"])
        assign(block.feed_forward_norm.scale, weights[prefix + "post_attention_layernorm.weight"])
        ffn = block.feed_forward
        assign(ffn.intermediate_dense.kernel, weights[prefix + "mlp.gate_proj.weight"].T)
        assign(ffn.up_dense.kernel, weights[prefix + "mlp.up_proj.weight"].T)
        assign(ffn.output_dense.kernel, weights[prefix + "mlp.down_proj.weight"].T)
    assign(lm.get_layer("final_norm").scale, weights["model.norm.weight"])
    assign(lm.get_layer("logits").kernel, weights["lm_head.weight"].T)
    return llama, lm
