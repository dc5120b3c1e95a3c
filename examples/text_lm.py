"""Train a language model on a text file (nanoGPT's character-level Shakespeare by default),
and sample from it.

    python examples/text_lm.py train --text FILE --out DIR [--iters N] [--tokenizer char|bpe]
    python examples/text_lm.py sample DIR --prompt "ROMEO:" --length 300

The defaults are nanoGPT's CPU run of `train_shakespeare_char`: 4 layers, 4 heads, width 128,
context 64, batch 12, 2,000 iterations, AdamW (lr 1e-3, warm-up 100, cosine to 1e-4, beta2
0.99, weight decay 0.1 on matrices, gradient clip 1.0), no dropout, learned positions, pre-LN,
GELU. The model trains on windows of the first 90% of the tokens at random offsets, with no
padding (`pad_id=None`: the newline, id 0 of the character vocabulary, is a token like any
other); `train`'s last line is `val_loss=<value>`, the mean loss over the last 10% (every
target once). Pick the backend with KERAS_BACKEND=jax|tensorflow|torch; TensorFlow's training step
is compiled with XLA (`jit_compile=True`), as JAX's is.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402
from keras_tfm import text  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """Wall time of each training batch (the first ones include compiling)."""

    def on_train_begin(self, logs=None):
        self.times, self.start = [], time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._batch_start)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a language model on a text file")
    train.add_argument("--text", required=True, help="a UTF-8 text file")
    train.add_argument("--out", required=True, help="directory of the model")
    train.add_argument("--iters", type=int, default=2000, help="training steps")
    train.add_argument("--tokenizer", choices=("char", "bpe"), default="char")
    train.add_argument("--vocab-size", type=int, default=1024, help="BPE tokens (bpe only)")
    train.add_argument("--layers", type=int, default=4)
    train.add_argument("--heads", type=int, default=4)
    train.add_argument("--d-model", type=int, default=128)
    train.add_argument("--context", type=int, default=64)
    train.add_argument("--batch-size", type=int, default=12)
    train.add_argument("--dropout", type=float, default=0.0)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--overwrite", action="store_true", help="replace a model in --out")
    sample = commands.add_parser("sample", help="continue a prompt")
    sample.add_argument("model_dir")
    sample.add_argument("--prompt", default="\n")
    sample.add_argument("--length", type=int, default=300, help="new tokens")
    sample.add_argument("--temperature", type=float, default=0.8)
    sample.add_argument("--top-k", type=int, default=200)
    sample.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def read_text(path):
    with open(path, "rb") as file:
        raw = file.read()
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line} is not UTF-8; save the file as UTF-8.") from None
    if not content.strip():
        raise ValueError(f"{path} holds no text.")
    return content


def build_model(args, vocab_size):
    keras.utils.set_random_seed(args.seed)
    model = keras_tfm.build_language_model(
        vocab_size, d_model=args.d_model, num_heads=args.heads, ff_dim=4 * args.d_model,
        num_layers=args.layers, positional="learned", max_length=args.context,
        dropout=args.dropout, activation="gelu", pad_id=None, name="text_lm")
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, decay_steps=max(args.iters - 100, 1), alpha=0.1, warmup_target=args.lr,
        warmup_steps=min(100, args.iters))
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.1, beta_1=0.9, beta_2=0.99,
                                       epsilon=1e-8, global_clipnorm=1.0)
    # nanoGPT decays the matrices (embeddings and kernels), not the biases and norms.
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if len(v.shape) < 2])
    # XLA under TensorFlow too: Keras's "auto" leaves it off on a CPU, where it made this run's
    # step about 2x faster (benchmarks/README.md); JAX compiles with XLA anyway, torch stays eager.
    jit_compile = True if keras.backend.backend() == "tensorflow" else "auto"
    model.compile(optimizer=optimizer,
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(ignore_class=None),
                  jit_compile=jit_compile)
    return model


def train(args):
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        raise ValueError(f"{args.out} already holds files (a model?); pass --overwrite to "
                         "replace them.")
    content = read_text(args.text)
    if args.tokenizer == "char":
        tokenizer = text.Tokenizer.train(content, kind="char", special_tokens=False)
    else:
        tokenizer = text.Tokenizer.train(content.splitlines(keepends=True), args.vocab_size)
    ids = np.asarray(tokenizer.encode(content), "int32")
    split = int(0.9 * len(ids))
    print(f"{len(ids):,} tokens ({tokenizer.vocab_size} in the vocabulary): {split:,} to train, "
          f"{len(ids) - split:,} to validate")
    windows = text.LanguageModelWindows(ids[:split], args.context, args.batch_size,
                                        steps=args.iters, seed=args.seed)
    model = build_model(args, tokenizer.vocab_size)
    print(f"model: {model.count_params():,} parameters")
    timer = StepTimer()
    model.fit(windows, epochs=1, callbacks=[timer], verbose=1 if sys.stdout.isatty() else 2)
    train_seconds = time.perf_counter() - timer.start
    validation = text.LanguageModelWindows(ids[split:], args.context, 64, random=False)
    val_loss = model.evaluate(validation, verbose=0, return_dict=True)["loss"]
    text.TextGenerator(model, tokenizer, context_length=args.context).save(
        args.out, overwrite=args.overwrite)
    print(f"model saved in {args.out}")
    warm = timer.times[20:] or timer.times
    print(f"ms_per_step={1000 * float(np.median(warm)):.1f}")
    print(f"train_seconds={train_seconds:.1f}")
    print(f"val_loss={val_loss:.4f}")


def sample(args):
    generator = text.TextGenerator.load(args.model_dir)
    print(generator.generate(args.prompt, max_length=args.length, temperature=args.temperature,
                             top_k=args.top_k, seed=args.seed))


def main(argv=None):
    args = parse_args(argv)
    try:
        {"train": train, "sample": sample}[args.command](args)
    except ValueError as error:  # bad input: one clear line, no traceback
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
