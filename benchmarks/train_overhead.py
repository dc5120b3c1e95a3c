"""The per-step time that does not depend on the model's size: a training step of nanoGPT's
model shrunk until its arithmetic is negligible, on each engine, beside Keras's own floor.

    python benchmarks/train_overhead.py [--steps 200] [--engines jax,tensorflow,torch,torch_gpt]

The same structure as `train_peers.py`'s gpt shape (4 blocks, 4 heads, learned positions,
AdamW with global-norm clipping, text_lm.py's compile settings), at width 8, context 8,
batch 1: every product is a few hundred multiply-adds, so a step's time is the per-call cost of
the engine (Python, dispatch, the trainer's and optimizer's bookkeeping). Three rows per Keras
backend, each `train_on_batch` on the same batch:

- `keras_tfm`: `build_language_model` as text_lm.py builds it (70 variables; about 60 Keras
  layer calls a forward pass, 15 a block, under `Layer.__call__` before direct calls);
- `keras, 1 Dense`: one `Dense` layer on an embedding with the same optimizer: Keras's trainer
  and optimizer floor for a model of 3 variables;
- `keras, 35 Dense`: `Embedding` then 35 `Dense` layers (71 variables, as many as keras_tfm's
  model): that floor plus Keras's per-layer and per-variable cost, with no keras_tfm code.

and `torch_gpt`, the plain-PyTorch loop (torch_gpt.py's model and AdamW) at the same size.
Median ms a step over `--steps` steps after 20 of warm-up, a process per engine.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = dict(d_model=8, heads=4, layers=4, context=8, batch=1, vocab=65)


def _timed(step, x, y, steps):
    for _ in range(20):
        step(x, y)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def _optimizer(keras):
    return keras.optimizers.AdamW(1e-3, weight_decay=0.1, beta_2=0.99, global_clipnorm=1.0)


def keras_rows(steps):
    """{row: ms a step} of the three Keras models on the current backend."""
    import keras
    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import text_lm

    rng = np.random.default_rng(0)
    x = rng.integers(0, TINY["vocab"], (TINY["batch"], TINY["context"])).astype("int32")
    y = rng.integers(0, TINY["vocab"], (TINY["batch"], TINY["context"])).astype("int32")
    args = text_lm.parse_args(["train", "--text", "-", "--out", "-", "--d-model", "8",
                               "--heads", "4", "--layers", "4", "--context", "8"])
    rows = {"keras_tfm": text_lm.build_model(args, TINY["vocab"])}
    jit_compile = rows["keras_tfm"].jit_compile
    for layers in (1, 35):
        inputs = keras.Input((None,), dtype="int32")
        hidden = keras.layers.Embedding(TINY["vocab"], 8)(inputs)
        for _ in range(layers - 1):
            hidden = keras.layers.Dense(8)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(TINY["vocab"])(hidden))
        model.compile(optimizer=_optimizer(keras), jit_compile=jit_compile,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rows[f"keras, {layers} Dense"] = model
    return {f"{name} ({len(model.trainable_variables)} variables)":
            _timed(lambda a, b, m=model: m.train_on_batch(a, b), x, y, steps)
            for name, model in rows.items()}


def torch_gpt_row(steps):
    import torch

    sys.path.insert(0, HERE)
    import torch_gpt

    torch.manual_seed(0)
    model = torch_gpt.GPT(TINY["vocab"], n_layer=TINY["layers"], n_head=TINY["heads"],
                          n_embd=TINY["d_model"], block_size=TINY["context"]).train()
    opt = torch_gpt.optimizer(model)
    x = torch.randint(0, TINY["vocab"], (TINY["batch"], TINY["context"]))
    y = torch.randint(0, TINY["vocab"], (TINY["batch"], TINY["context"]))

    def step(a, b):
        loss = torch_gpt.loss_fn(model, a, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return {"torch_gpt": _timed(step, x, y, steps)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--engines", default="jax,tensorflow,torch,torch_gpt")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # (one engine, in its own process)
    args = parser.parse_args()
    if args.engine:
        rows = torch_gpt_row(args.steps) if args.engine == "torch_gpt" else keras_rows(args.steps)
        for name, ms in rows.items():
            print(f"RESULT {args.engine} | {name} | {ms:.2f}")
        return
    print("engine | model | ms a step (median)")
    for engine in args.engines.split(","):
        env = dict(os.environ, KERAS_BACKEND="torch" if engine == "torch_gpt" else engine)
        out = subprocess.run([sys.executable, __file__, "--engine", engine, "--steps",
                              str(args.steps)], env=env, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{engine} failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                print(line[len("RESULT "):], flush=True)


if __name__ == "__main__":
    main()
