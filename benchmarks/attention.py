"""One self-attention layer, forward + backward, sequence lengths 64 → 1024.

    python benchmarks/attention.py --backend jax [--json out.json]
    python benchmarks/attention.py --all [--output-dir benchmarks/results]

Batch 8, d_model 256, 4 heads, padded rows (the last quarter of every other sequence is
padding), no dropout. Each layer sits alone in a `keras.Model` trained with `train_on_batch`
(MSE, SGD; `compile()` defaults: XLA under JAX, a tf.function graph under TensorFlow on a
machine without GPU, eager under torch):

* keras_tfm fused: `MultiHeadSelfAttention` as is (`keras.ops.dot_product_attention`);
* keras_tfm explicit: the same layer with `return_attention_scores=True`, which takes the
  explicit path (scores, float32 softmax, weighted sum);
* Keras MHA: `keras.layers.MultiHeadAttention` with the same padding (`query_mask`,
  `value_mask`).

Reported: milliseconds per step (median of repeats after a warm-up) and, where the backend
reports it (GPUs), the peak device memory of the step.
"""

import os
import statistics
import time

import per_backend

LENGTHS = (64, 128, 256, 512, 1024)
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


def peak_memory():
    """Peak bytes on the first accelerator, or None (CPUs report nothing usable)."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        stats = jax.devices()[0].memory_stats()
        return stats.get("peak_bytes_in_use") if stats else None
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
            row = {"backend": backend, "length": length, "variant": variant,
                   "ms": 1000 * statistics.median(times), "peak_bytes": peak_memory()}
            rows.append(row)
            memory = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f} MiB"
            print(f"{backend:10s} T={length:5d} {variant:20s} {row['ms']:9.2f} ms  "
                  f"peak memory {memory}", flush=True)
            keras.backend.clear_session()
    return {"backend": backend, "keras": keras.__version__, "date": time.strftime("%Y-%m-%d"),
            "batch": BATCH, "d_model": D_MODEL, "heads": HEADS, "rows": rows}


if __name__ == "__main__":
    per_backend.main(run, __doc__, "attention", __file__)
