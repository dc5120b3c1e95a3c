"""One self-attention layer, forward + backward, sequence lengths 64 → 1024.

    python benchmarks/attention.py --backend jax [--json out.json]
    python benchmarks/attention.py --all [--output-dir benchmarks/results]

Batch 8, d_model 256, 4 heads, the last quarter of every other sequence padding, no dropout;
each layer alone in a `keras.Model` trained with `train_on_batch` (MSE, SGD, `compile()`
defaults). Variants: keras_tfm fused (`MultiHeadSelfAttention` as is, on
`keras.ops.dot_product_attention`), keras_tfm explicit (the same layer with
`return_attention_scores=True`), and `keras.layers.MultiHeadAttention` with the same padding.
Reported: ms per step (median after a warm-up) and memory: the peak device memory under torch
and TensorFlow where the backend reports it (GPUs), XLA's plan for the step under JAX.
Results: benchmarks/README.md.
"""

import os
import statistics
import time

import per_backend

# ATTENTION_LENGTHS=64,256 runs a subset (a quick check); ATTENTION_POLICY=mixed_bfloat16 runs
# the layers under that Keras dtype policy (default float32).
LENGTHS = tuple(int(n) for n in
                os.environ.get("ATTENTION_LENGTHS", "64,128,256,512,1024").split(","))
POLICY = os.environ.get("ATTENTION_POLICY", "float32")
BATCH, D_MODEL, HEADS, REPEATS = 8, 256, 4, 5


def build(variant, length):
    import keras
    from keras import ops

    import keras_tfm

    x = keras.Input((length, D_MODEL))
    mask = keras.Input((length,), dtype="bool")
    if variant == "keras_mha":
        y = keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS)(x, x, query_mask=mask,
                                                                      value_mask=mask)
    else:
        layer = keras_tfm.MultiHeadSelfAttention(HEADS)
        pair = ops.logical_and(mask[:, None, :], mask[:, :, None])
        if variant == "keras_tfm_explicit":
            y, _ = layer(x, attention_mask=pair, return_attention_scores=True)
        else:
            y = layer(x, attention_mask=pair)
    model = keras.Model([x, mask], y)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def peak_memory_reset():
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
    elif backend == "tensorflow":
        import tensorflow as tf

        if tf.config.list_physical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")


def jax_step_bytes(model, inputs, target):
    """XLA's planned memory (arguments + outputs + temporaries) of the jitted forward + backward.

    JAX keeps no resettable peak per step (its allocator's peak covers the whole process), so
    under JAX the column is what XLA allocates for the gradient computation, on any device."""
    import jax
    from keras import ops

    trainable = [v.value for v in model.trainable_variables]
    fixed = [v.value for v in model.non_trainable_variables]

    def loss(trainable):
        y, _ = model.stateless_call(trainable, fixed, inputs, training=True)
        return ops.mean(ops.square(y - target))

    stats = jax.jit(jax.grad(loss)).lower(trainable).compile().memory_analysis()
    if stats is None:
        return None
    return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def peak_memory():
    """Peak bytes of the steps since `peak_memory_reset` on the first accelerator (torch,
    TensorFlow), or None (CPUs report nothing usable)."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return tf.config.experimental.get_memory_info("GPU:0")["peak"]
    return None


def run(backend):
    os.environ["KERAS_BACKEND"] = backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    keras.config.set_dtype_policy(POLICY)
    device = per_backend.device_name()
    rng = np.random.default_rng(0)
    rows = []
    for length in LENGTHS:
        x = rng.standard_normal((BATCH, length, D_MODEL)).astype("float32")
        mask = np.ones((BATCH, length), bool)
        mask[::2, 3 * length // 4:] = False
        for variant in ("keras_tfm_fused", "keras_tfm_explicit", "keras_mha"):
            keras.utils.set_random_seed(0)
            model = build(variant, length)
            model.train_on_batch([x, mask], x)  # warm-up: compilation
            peak_memory_reset()
            times = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                model.train_on_batch([x, mask], x)
                times.append(time.perf_counter() - start)
            peak = (jax_step_bytes(model, [x, mask], x) if backend == "jax"
                    else peak_memory())
            row = {"backend": backend, "length": length, "variant": variant,
                   "ms": 1000 * statistics.median(times), "peak_bytes": peak}
            rows.append(row)
            memory = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f} MiB"
            print(f"{backend:10s} {device:5.5s} T={length:5d} {variant:20s} "
                  f"{row['ms']:9.2f} ms  memory {memory}", flush=True)
            keras.backend.clear_session()
    return {"backend": backend, "keras": keras.__version__, "date": time.strftime("%Y-%m-%d"),
            "device": device, "dtype_policy": POLICY,
            "batch": BATCH, "d_model": D_MODEL, "heads": HEADS, "rows": rows}


if __name__ == "__main__":
    per_backend.main(run, __doc__, "attention", __file__)
