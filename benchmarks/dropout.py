"""Dropout alone, forward + backward: keras_tfm.Dropout against keras.layers.Dropout.

    python benchmarks/dropout.py --backend jax [--json out.json]
    python benchmarks/dropout.py --all [--output-dir benchmarks/results]

By default the two shapes a transformer drops out most, at the small training config
(benchmarks/train_throughput.py): a (64, 32, 128) activation and (64, 4, 32, 32) attention
weights (`DROPOUT_SHAPES` sets others); rate 0.1. One step is `sum(dropout(x) · x)` and its
gradient with respect to x, compiled as Keras compiles a training step on this machine:
`jax.jit` under JAX, a `tf.function` graph under TensorFlow (no XLA on a CPU-only machine),
eager under torch (synchronized on CUDA). Both layers are unseeded, as `keras_tfm` builds them.
Reported: the device, microseconds per step, median of 7 timings of 20 steps after a warm-up,
and the ratio.
"""

import os
import statistics
import time

import per_backend

# DROPOUT_SHAPES=64x32x128,16x512x1024 runs other shapes (e.g. larger ones on a GPU).
SHAPES = tuple(tuple(int(n) for n in shape.split("x")) for shape in
               os.environ.get("DROPOUT_SHAPES", "64x32x128,64x4x32x32").split(","))
RATE, REPEATS, STEPS = 0.1, 7, 20


def step_function(layer):
    """`x -> gradient of sum(layer(x) * x)` for this backend, compiled as Keras would."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        state = [v.value for v in layer.non_trainable_variables]  # the seed generator's

        @jax.jit
        def grad(x, state):
            def total(x):
                y, new_state = layer.stateless_call([], state, x, training=True)
                return keras.ops.sum(y * x), new_state

            g, new_state = jax.grad(total, has_aux=True)(x)
            return g, new_state

        def run(x):
            nonlocal state
            g, state = grad(x, state)
            g.block_until_ready()

        return run
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.function
        def grad(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                total = tf.reduce_sum(layer(x, training=True) * x)
            return tape.gradient(total, x)

        return lambda x: grad(x).numpy()

    import torch

    def run(x):
        x = x.detach().requires_grad_(True)
        keras.ops.sum(layer(x, training=True) * x).backward()
        if x.is_cuda:  # CUDA runs asynchronously: wait for the step
            torch.cuda.synchronize()

    return run


def run(backend):
    os.environ["KERAS_BACKEND"] = backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import keras_tfm

    device = per_backend.device_name()
    rows = []
    for shape in SHAPES:
        x = keras.ops.convert_to_tensor(
            np.random.default_rng(0).standard_normal(shape).astype("float32"))
        steps = {"keras": step_function(keras.layers.Dropout(RATE)),
                 "keras_tfm": step_function(keras_tfm.Dropout(RATE))}
        times = {name: [] for name in steps}
        for step in steps.values():
            step(x)  # warm-up: compilation
        for _ in range(REPEATS):  # in turns, so that slow spells fall on both
            for name, step in steps.items():
                start = time.perf_counter()
                for _ in range(STEPS):
                    step(x)
                times[name].append((time.perf_counter() - start) / STEPS)
        row = {"backend": backend, "shape": list(shape),
               **{f"{name}_us": 1e6 * statistics.median(t) for name, t in times.items()}}
        row["speedup"] = row["keras_us"] / row["keras_tfm_us"]
        rows.append(row)
        print(f"{backend:10s} {device:5.5s} {shape!s:18s} "
              f"keras.layers.Dropout {row['keras_us']:8.0f} us  "
              f"keras_tfm.Dropout {row['keras_tfm_us']:8.0f} us  {row['speedup']:.2f}x",
              flush=True)
    return {"backend": backend, "keras": keras.__version__, "date": time.strftime("%Y-%m-%d"),
            "device": device, "rate": RATE, "rows": rows}


if __name__ == "__main__":
    per_backend.main(run, __doc__, "dropout", __file__)
