"""Sentence classification with a keras_tfm encoder (BERT-shaped) on the seeds' toy language.

    KERAS_BACKEND=jax python examples/classify_toy.py [--epochs N] [--num-samples N]
        [--output-dir DIR] [--seed S] [--quick]

The sentences of seed 003's source language X (examples/toy_data.py: 7 words, random lengths
5-20, padded) are labelled with a property that depends on word order: does the word "a" occur
before the first "b" (or in a sentence without "b")? `build_encoder` (bidirectional
self-attention, mean pooling over the real tokens, a dense classifier) is trained with
`model.fit`, evaluated on 1,000 held-out sentences, saved and reloaded. Only the public API of keras_tfm is used.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tfm  # noqa: E402
import toy_data  # noqa: E402

HELD_OUT = 1000


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-samples", type=int, default=8000)
    parser.add_argument("--output-dir", default="outputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run (for tests): few samples, one epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.num_samples = 1, 512
    return args


def label(words):
    """1 when "a" occurs before the first "b" of the sentence (or there is no "b"), else 0."""
    first_b = words.index("b") if "b" in words else len(words)
    return int("a" in words[:first_b])


def make_dataset(num, seed):
    sentences = toy_data.sample_sentences(num, seed)
    tokens = np.array([toy_data.encode(s, toy_data.SOURCE_IDS, toy_data.SOURCE_LENGTH)
                       for s in sentences], "int32")
    return tokens, np.array([label(s) for s in sentences], "int32")


def build_model():
    model = keras_tfm.build_encoder(len(toy_data.SOURCE_VOCAB), d_model=32, num_heads=4,
                                    ff_dim=64, num_layers=2, num_classes=2, pooling="mean",
                                    dropout=0.0, name="toy_classifier")
    model.compile(optimizer=keras.optimizers.Adam(2e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main(argv=None):
    args = parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    tokens, labels = make_dataset(args.num_samples, args.seed)
    test_tokens, test_labels = make_dataset(HELD_OUT, args.seed + 10_000)
    print(f"label 1 in {labels.mean():.0%} of the training sentences")
    model = build_model()
    start = time.perf_counter()
    model.fit(tokens, labels, batch_size=64, epochs=args.epochs, validation_split=0.1,
              verbose=1 if sys.stdout.isatty() else 2)
    elapsed = time.perf_counter() - start
    predicted = model.predict(test_tokens, batch_size=500, verbose=0).argmax(-1)
    accuracy = float((predicted == test_labels).mean())
    print(f"\nheld-out accuracy: {accuracy:.2%} on {HELD_OUT} sentences "
          f"(training {elapsed:.1f} s)")
    for i in range(5):
        words = " ".join(toy_data.decode(test_tokens[i], toy_data.SOURCE_VOCAB))
        print(f"  {words:40s} expected {test_labels[i]}, predicted {predicted[i]}")
    path = os.path.join(args.output_dir, "toy_classifier.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    same = bool((reloaded.predict(test_tokens, batch_size=500, verbose=0).argmax(-1)
                 == predicted).all())
    print(f"saved {path}; the reloaded model predicts the same: {same}")
    return {"accuracy": accuracy, "elapsed": elapsed, "reloaded_same": same}


if __name__ == "__main__":
    main()
