"""Train a translator on a file of sentence pairs, translate files with it, score it.

    python examples/translate_text.py train --pairs FILE --out DIR [--minutes M] [--epochs E]
    python examples/translate_text.py translate DIR --input SOURCES.txt --output OUT.txt
    python examples/translate_text.py evaluate DIR --pairs FILE

FILE: UTF-8, one pair a line, source TAB target (further TAB columns ignored: the
manythings.org / Anki format, e.g. spa.txt of the keras.io tutorial). `train` trains a
byte-level BPE tokenizer per language, batches the pairs by length under a token budget,
trains a transformer with `model.fit` (validation BLEU / chrF each epoch on held-out pairs,
the best model kept) and saves a `keras_tfm.text.Translator` in DIR; `--minutes` stops at a
wall-clock budget and still saves the best model. The defaults suit a 2-core CPU
(benchmarks/README.md: how they were chosen, and what they score on spa-eng).
Pick the backend with KERAS_BACKEND=jax|tensorflow|torch.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402
from keras_tfm import text  # noqa: E402


class TimeLimit(keras.callbacks.Callback):
    """Stop training once `minutes` of wall-clock time have passed since training began."""

    def __init__(self, minutes):
        super().__init__()
        self.seconds = None if minutes is None else 60.0 * minutes
        self.stopped_at = None

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self.seconds is not None and time.perf_counter() - self.start > self.seconds:
            self.model.stop_training = True
            self.stopped_at = time.perf_counter() - self.start


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a translator on sentence pairs")
    train.add_argument("--pairs", required=True, help="UTF-8 file: source TAB target a line")
    train.add_argument("--out", required=True, help="directory of the translator")
    train.add_argument("--minutes", type=float, default=None, help="wall-clock budget")
    train.add_argument("--epochs", type=int, default=20)
    train.add_argument("--overwrite", action="store_true", help="replace a model in --out")
    train.add_argument("--skip-bad-lines", action="store_true",
                       help="skip (and count) lines without a TAB instead of stopping")
    train.add_argument("--vocab-size", type=int, default=2000, help="BPE tokens per language")
    train.add_argument("--d-model", type=int, default=256)
    train.add_argument("--layers", type=int, default=3, help="encoder and decoder blocks each")
    train.add_argument("--heads", type=int, default=4)
    train.add_argument("--ff-dim", type=int, default=1024)
    train.add_argument("--dropout", type=float, default=0.0,
                       help="0 suits a budget of about an epoch; 0.1 for runs of many epochs")
    train.add_argument("--max-tokens", type=int, default=2048, help="token budget of a batch")
    train.add_argument("--max-length", type=int, default=64,
                       help="longest sentence in tokens; longer pairs are dropped (counted)")
    train.add_argument("--warmup", type=int, default=300, help="learning-rate warm-up steps")
    train.add_argument("--validation", type=int, default=500, help="held-out pairs scored")
    train.add_argument("--beam-size", type=int, default=4)
    train.add_argument("--seed", type=int, default=0)
    translate = commands.add_parser("translate", help="translate a file, one sentence a line")
    translate.add_argument("model_dir")
    translate.add_argument("--input", required=True)
    translate.add_argument("--output", required=True)
    translate.add_argument("--beam-size", type=int, default=None)
    translate.add_argument("--batch-size", type=int, default=64)
    evaluate = commands.add_parser("evaluate", help="BLEU and chrF on a file of pairs")
    evaluate.add_argument("model_dir")
    evaluate.add_argument("--pairs", required=True)
    evaluate.add_argument("--beam-size", type=int, default=None)
    evaluate.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args(argv)


def refuse_existing(directory, overwrite):
    """`--out` holding another model (or other files) is refused unless `--overwrite`."""
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        sys.exit(f"error: {directory} already holds files (a model?); pass --overwrite to "
                 "replace them.")


def build_model(args, source_tokenizer, target_tokenizer):
    model = keras_tfm.build_transformer(
        source_tokenizer.vocab_size, target_tokenizer.vocab_size, d_model=args.d_model,
        num_heads=args.heads, ff_dim=args.ff_dim, num_encoder_layers=args.layers,
        num_decoder_layers=args.layers, dropout=args.dropout, norm_first=True,
        tie_embeddings=True, name="translator", **target_tokenizer.special_ids)
    schedule = keras_tfm.TransformerSchedule(args.d_model, warmup_steps=args.warmup, scale=0.5)
    model.compile(
        optimizer=keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9,
                                        clipnorm=1.0),
        loss=keras_tfm.MaskedSparseCategoricalCrossentropy(
            pad_id=target_tokenizer.pad_id, label_smoothing=0.1),
        metrics=[keras_tfm.MaskedAccuracy(pad_id=target_tokenizer.pad_id)])
    return model


def train(args):
    refuse_existing(args.out, args.overwrite)
    sources, targets, skipped = text.read_pairs(args.pairs, skip_bad_lines=args.skip_bad_lines)
    print(f"{len(sources)} pairs read from {args.pairs}"
          + (f" ({skipped} lines without a TAB skipped)" if skipped else ""))
    order = np.random.default_rng(args.seed).permutation(len(sources))
    held = order[:min(args.validation, len(sources) // 10)]
    used = order[len(held):]
    started = time.perf_counter()
    source_tokenizer = text.Tokenizer.train([sources[i] for i in used], args.vocab_size)
    target_tokenizer = text.Tokenizer.train([targets[i] for i in used], args.vocab_size)
    batches = text.TranslationBatches(
        source_tokenizer.encode([sources[i] for i in used], add_end=True),
        target_tokenizer.encode([targets[i] for i in used]),
        max_tokens=args.max_tokens, max_length=args.max_length, too_long="drop",
        seed=args.seed, **target_tokenizer.special_ids)
    print(f"tokenizers and batches: {time.perf_counter() - started:.1f} s; vocabularies "
          f"{source_tokenizer.vocab_size} / {target_tokenizer.vocab_size}; {len(batches)} "
          f"batches an epoch in buckets {batches.buckets}; padding "
          f"{100 * batches.padding_fraction:.1f}% (one shape: "
          f"{100 * batches.fixed_padding_fraction:.1f}%); {batches.num_dropped} pairs over "
          f"{args.max_length} tokens dropped")
    model = build_model(args, source_tokenizer, target_tokenizer)
    print(f"model: {model.count_params():,} parameters")
    translator = text.Translator(model, source_tokenizer, target_tokenizer,
                                 beam_size=args.beam_size, max_length=args.max_length)
    scores = text.TranslationScores(translator, [sources[i] for i in held],
                                    [targets[i] for i in held], filepath=args.out)
    limit = TimeLimit(args.minutes)
    os.makedirs(args.out, exist_ok=True)
    log = keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv"))
    started = time.perf_counter()
    history = model.fit(batches, epochs=args.epochs, callbacks=[limit, scores, log],
                        verbose=1 if sys.stdout.isatty() else 2)
    seconds = time.perf_counter() - started
    steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    with open(os.path.join(args.out, "training.json"), "w") as file:
        json.dump({"steps": steps, "fit_seconds": seconds, "s_per_step": seconds / max(steps, 1),
                   "epochs": len(history.epoch), "parameters": model.count_params(),
                   "validation": scores.history}, file, indent=2)
    if not scores.history:  # (stopped before an epoch ended: the model as it is)
        translator.save(args.out, overwrite=True)
        print(f"translator saved in {args.out} (not scored)")
        return
    print(f"best validation BLEU {scores.best:.2f} (chrF "
          f"{max(h['val_chrf'] for h in scores.history):.2f}); translator saved in {args.out}")


def read_lines(path):
    with open(path, "rb") as file:
        raw = file.read()
    try:  # (lines end at "\n" only, as the output's do: the line counts match)
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        sys.exit(f"error: {path} line {line} is not UTF-8; save the file as UTF-8.")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def translate(args):
    translator = text.Translator.load(args.model_dir)
    lines = read_lines(args.input)
    outputs = translator(lines, beam_size=args.beam_size, batch_size=args.batch_size,
                         verbose=True)
    with open(args.output, "w", encoding="utf-8") as file:
        file.writelines(line + "\n" for line in outputs)
    print(f"{len(outputs)} lines translated into {args.output}")


def evaluate(args):
    translator = text.Translator.load(args.model_dir)
    sources, targets, _ = text.read_pairs(args.pairs)
    hypotheses = translator(sources, beam_size=args.beam_size, batch_size=args.batch_size,
                            verbose=True)
    scores = text.corpus_scores(hypotheses, targets)
    print(f"BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  ({len(sources)} pairs)")


def main(argv=None):
    args = parse_args(argv)
    try:
        {"train": train, "translate": translate, "evaluate": evaluate}[args.command](args)
    except ValueError as error:  # bad input: one clear line, no traceback
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
