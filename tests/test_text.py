"""Real text in and out (keras_tfm.text): tokenizers, batches, BLEU, text-in/text-out objects,
language models without padding, and the two example command lines on real sentences
(tests/data/spa_eng_400.tsv, from the keras.io tutorial's spa-eng corpus)."""

import csv
import importlib.util
import itertools
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import sacrebleu

import keras_tfm
from keras_tfm import text

from conftest import BACKEND

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PAIRS = os.path.join(HERE, "data", "spa_eng_400.tsv")
OTHER_BACKEND = {"jax": "torch", "torch": "tensorflow", "tensorflow": "jax"}[BACKEND]


def _numpy(x):
    return keras.ops.convert_to_numpy(x)


def _example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pairs():
    sources, targets, skipped = text.read_pairs(PAIRS)
    assert len(sources) == 400 and skipped == 0
    return sources, targets


# --- tokenizers ---------------------------------------------------------------------------------

ROUND_TRIP = ["¿Cómo estás?", "¡Ñandú!  Dos  espacios, y\tuna tabulación.",
              "MAYÚSCULAS minúsculas", "Ça va? Über naïve café — «comillas» 'y' \"otras\"…",
              " leading and trailing ",
              "日本語 и кириллица 🙂"]  # the last line's characters are not in the training text


def test_bpe_round_trips_and_special_ids(pairs):
    sources, targets = pairs
    tokenizer = text.Tokenizer.train(sources + targets, vocab_size=600)
    assert tokenizer.special_ids == {"pad_id": 0, "start_id": 1, "end_id": 2}
    assert tokenizer.unk_id == 3 and tokenizer.vocab_size == 600
    for line in ROUND_TRIP + targets[:50]:
        ids = tokenizer.encode(line)
        assert min(ids) > 3, "text never encodes to a special id"
        assert tokenizer.decode(ids) == line
    batch = tokenizer.encode(ROUND_TRIP[:2], add_start=True, add_end=True)
    assert [row[0] for row in batch] == [1, 1] and [row[-1] for row in batch] == [2, 2]
    assert tokenizer.decode(batch) == ROUND_TRIP[:2]
    # decoding stops at the end id; padding after it is dropped
    assert tokenizer.decode(batch[0] + [0, 0, 57]) == ROUND_TRIP[0]


def test_tokenizer_saves_and_loads(tmp_path, pairs):
    tokenizer = text.Tokenizer.train(pairs[1], vocab_size=400)
    path = tokenizer.save(str(tmp_path))
    assert os.path.basename(path) == "tokenizer.json"
    loaded = text.Tokenizer.load(str(tmp_path))
    assert loaded.special_ids == tokenizer.special_ids
    assert loaded.encode(pairs[1][:20]) == tokenizer.encode(pairs[1][:20])
    with pytest.raises(ValueError, match="No tokenizer file"):
        text.Tokenizer.load(str(tmp_path / "missing.json"))


def test_character_tokenizer_is_nanogpts_vocabulary():
    corpus = "First Citizen:\nBefore we proceed, hear me speak.\n"
    tokenizer = text.Tokenizer.train(corpus, kind="char", special_tokens=False)
    chars = sorted(set(corpus))
    assert tokenizer.vocab_size == len(chars)
    assert tokenizer.encode(corpus) == [chars.index(c) for c in corpus]
    assert tokenizer.encode("\n") == [0]  # the newline is id 0, a real token
    assert tokenizer.special_ids == {"pad_id": None, "start_id": None, "end_id": None}
    assert tokenizer.decode(tokenizer.encode(corpus)) == corpus
    with pytest.raises(ValueError, match="Could not tokenize"):
        tokenizer.encode("Zebra")  # 'Z' never occurs
    with_unknown = text.Tokenizer.train(corpus, kind="char")
    assert with_unknown.encode("Z") == [with_unknown.unk_id]


def test_tokenizer_refuses_bad_arguments():
    with pytest.raises(ValueError, match="needs some text"):
        text.Tokenizer.train(["", ""])
    with pytest.raises(ValueError, match="vocab_size >= 260"):
        text.Tokenizer.train(["some text"], vocab_size=100)
    with pytest.raises(ValueError, match="kind"):
        text.Tokenizer.train(["some text"], kind="words")
    chars = text.Tokenizer.train("abc", kind="char", special_tokens=False)
    with pytest.raises(ValueError, match="no </s> token"):
        chars.encode("abc", add_end=True)


# --- reading pairs --------------------------------------------------------------------------------

def test_read_pairs_takes_the_anki_format_and_names_bad_lines(tmp_path):
    good = tmp_path / "good.tsv"
    good.write_text("Go.\tVe.\tCC-BY 2.0 (France) Attribution: tatoeba.org #2877272\n"
                    "Hi.\tHola.\n\n", encoding="utf-8")
    assert text.read_pairs(str(good)) == (["Go.", "Hi."], ["Ve.", "Hola."], 0)
    bad = tmp_path / "bad.tsv"
    bad.write_text("Go.\tVe.\nno tab here\nHi.\tHola.\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2 is not 'source<TAB>target'"):
        text.read_pairs(str(bad))
    assert text.read_pairs(str(bad), skip_bad_lines=True) == (["Go.", "Hi."], ["Ve.", "Hola."], 1)
    latin1 = tmp_path / "latin1.tsv"
    latin1.write_bytes("Go.\tVe.\nHow are you?\t¿Cómo estás?\n".encode("latin-1"))
    with pytest.raises(ValueError, match="line 2 is not UTF-8"):
        text.read_pairs(str(latin1))
    empty = tmp_path / "empty.tsv"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no sentence pairs"):
        text.read_pairs(str(empty))


# --- batches --------------------------------------------------------------------------------------

def _pairs_of(batches):
    """Every (source, target) of one epoch's batches, read back from the arrays."""
    seen = []
    for i in range(len(batches)):
        (source, decoder_input), labels = batches[i]
        assert source.shape == decoder_input.shape == labels.shape
        assert source.shape[1] in batches.buckets
        for s, d, y in zip(source, decoder_input, labels):
            if not (s != 0).any():
                assert not (y != 0).any(), "a filler row holds no target"
                continue
            target = y[y != 0]
            assert target[-1] == 2 and d[0] == 1
            np.testing.assert_array_equal(d[1:len(target)], target[:-1])  # shifted by one
            seen.append((tuple(s[s != 0]), tuple(target[:-1])))
    return seen


def test_translation_batches_hold_every_pair_once_per_epoch(pairs):
    sources, targets = pairs
    tokenizer = text.Tokenizer.train(sources + targets, vocab_size=500)
    source_ids = tokenizer.encode(sources, add_end=True)
    target_ids = tokenizer.encode(targets)
    batches = text.TranslationBatches(source_ids, target_ids, max_tokens=256, seed=0,
                                      **tokenizer.special_ids)
    assert len(batches.buckets) <= 5
    expected = sorted(zip(map(tuple, source_ids), map(tuple, target_ids)))
    first = _pairs_of(batches)
    assert sorted(first) == expected
    shapes = {batches[i][1].shape for i in range(len(batches))}
    assert all(rows * length <= 256 for rows, length in shapes)
    assert len(shapes) == len(batches.buckets)  # one shape a bucket: a compile a bucket
    assert batches.padding_fraction < batches.fixed_padding_fraction
    batches.on_epoch_end()
    second = _pairs_of(batches)
    assert sorted(second) == expected and second != first  # reshuffled
    by_count = text.TranslationBatches(source_ids, target_ids, batch_size=32, buckets=[16, 64],
                                       **tokenizer.special_ids)
    assert {by_count[i][1].shape[0] for i in range(len(by_count))} == {32}
    assert sorted(_pairs_of(by_count)) == expected


def test_auto_buckets_pad_the_least():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 12, size=int(rng.integers(1, 25)))
        count = int(rng.integers(1, 4))
        batches = text.TranslationBatches([[5] * n for n in lengths], [[6]] * len(lengths),
                                          pad_id=0, start_id=1, end_id=2, batch_size=1,
                                          num_buckets=count)
        lengths = np.maximum(lengths, 2)  # (a pair's length: its source or its target + 1)

        def padded(buckets):
            return sum(min(b for b in buckets if b >= n) for n in lengths)

        longest = int(lengths.max())
        least = min(padded([*inner, longest]) for r in range(count)
                    for inner in itertools.combinations(range(1, longest), r))
        assert padded(batches.buckets) == least and batches.buckets[-1] == longest
        assert len(batches.buckets) <= count


def test_translation_batches_refuse_or_count_long_pairs():
    source, target = [[5] * 3, [5] * 10, [5] * 12], [[6] * 2, [6] * 3, [6] * 20]
    ids = dict(pad_id=0, start_id=1, end_id=2)
    with pytest.raises(ValueError, match="2 of 3 pairs are longer than max_length=8"):
        text.TranslationBatches(source, target, batch_size=2, max_length=8, **ids)
    dropped = text.TranslationBatches(source, target, batch_size=2, max_length=8,
                                      too_long="drop", **ids)
    assert dropped.num_dropped == 2 and len(_pairs_of(dropped)) == 1
    cut = text.TranslationBatches(source, target, batch_size=2, max_length=8,
                                  too_long="truncate", **ids)
    assert cut.num_truncated == 2 and max(cut.buckets) == 8
    with pytest.raises(ValueError, match="cannot hold one sentence"):
        text.TranslationBatches(source, target, max_tokens=4, **ids)
    with pytest.raises(ValueError, match="one of `max_tokens`"):
        text.TranslationBatches(source, target, **ids)


def test_language_model_windows_are_nanogpts_draws():
    stream = np.arange(1000) % 97
    windows = text.LanguageModelWindows(stream, sequence_length=16, batch_size=4, steps=3,
                                        seed=7)
    rng = np.random.default_rng(7)
    for i in range(3):
        offsets = rng.integers(0, len(stream) - 16, size=4)
        x, y = windows[i]
        np.testing.assert_array_equal(x, stream[offsets[:, None] + np.arange(16)])
        np.testing.assert_array_equal(y, stream[offsets[:, None] + np.arange(1, 17)])
    ordered = text.LanguageModelWindows(stream, 16, batch_size=10, random=False)
    targets = np.concatenate([ordered[i][1].reshape(-1) for i in range(len(ordered))])
    np.testing.assert_array_equal(targets, stream[1:1 + len(targets)])
    assert len(targets) == (len(stream) - 1) // 16 * 16
    with pytest.raises(ValueError, match="shorter than one window"):
        text.LanguageModelWindows(stream[:10], 16, 4)


# --- language models without padding --------------------------------------------------------------

def test_language_model_without_padding_attends_and_counts_id_zero():
    lm = keras_tfm.build_language_model(10, d_model=16, num_heads=2, ff_dim=32, num_layers=1,
                                        pad_id=None)
    tokens = np.array([[0, 3, 0, 4, 5]], "int32")
    changed = tokens.copy()
    changed[0, 0] = 7
    difference = np.abs(_numpy(lm(tokens)) - _numpy(lm(changed)))[0].max(axis=-1)
    assert (difference[1:] > 1e-4).all(), "later positions see the id-0 token at position 0"
    padded = keras_tfm.build_language_model(10, d_model=16, num_heads=2, ff_dim=32,
                                            num_layers=1)
    padded.set_weights(lm.get_weights())
    same = np.abs(_numpy(padded(tokens))[0, 3] - _numpy(lm(tokens))[0, 3]).max()
    assert same > 1e-4, "pad_id=0 masks the id-0 keys that pad_id=None attends to"

    logits = _numpy(lm(tokens[:, :-1])).astype("float64")
    labels = tokens[:, 1:]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, labels[..., None], -1).mean()
    loss = keras_tfm.MaskedSparseCategoricalCrossentropy(ignore_class=None)(labels, logits)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)


def test_language_model_without_padding_generates_like_a_full_forward():
    lm = keras_tfm.build_language_model(12, d_model=16, num_heads=2, ff_dim=32, num_layers=2,
                                        pad_id=None)
    prompts = [[0, 5, 0], [3]]  # id 0 is a token; rows of different lengths as a list
    tokens = keras_tfm.generate(lm, prompts, max_length=4, end_id=None)
    assert tokens.shape == (2, 4)
    for prompt, new in zip(prompts, tokens):
        sequence = list(prompt)
        for _ in range(4):
            logits = _numpy(lm(np.array([sequence], "int32")))[0, -1]
            sequence.append(int(np.argmax(logits)))
        assert sequence[len(prompt):] == new.tolist()


def test_packed_text_language_model_trains():
    stream = np.tile(np.array([0, 1, 2, 3, 0, 4], "int32"), 200)  # id 0 a token
    lm = keras_tfm.build_language_model(5, d_model=16, num_heads=2, ff_dim=32, num_layers=1,
                                        pad_id=None)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2),
               loss=keras_tfm.MaskedSparseCategoricalCrossentropy(ignore_class=None))
    windows = text.LanguageModelWindows(stream, 8, batch_size=8, steps=30, seed=0)
    history = lm.fit(windows, epochs=2, verbose=0).history["loss"]
    assert history[-1] < 0.6 * history[0]


# --- scores and the callback ----------------------------------------------------------------------

def test_corpus_scores_are_sacrebleus():
    hypotheses = ["el gato se sentó en la alfombra", "hola", "¿cómo estás?"]
    references = ["el gato se sentó sobre la alfombra", "hola .", "¿Cómo estás?"]
    scores = text.corpus_scores(hypotheses, references)
    assert scores["bleu"] == sacrebleu.corpus_bleu(hypotheses, [references]).score
    assert scores["chrf"] == sacrebleu.corpus_chrf(hypotheses, [references]).score
    assert 0 < scores["bleu"] < 100
    with pytest.raises(ValueError, match="as many hypotheses"):
        text.corpus_scores(["a"], ["a", "b"])


def _tiny_translator(pairs, vocab_size=300):
    sources, targets = pairs
    source_tokenizer = text.Tokenizer.train(sources, vocab_size=vocab_size)
    target_tokenizer = text.Tokenizer.train(targets, vocab_size=vocab_size)
    model = keras_tfm.build_transformer(
        source_tokenizer.vocab_size, target_tokenizer.vocab_size, d_model=32, num_heads=2,
        ff_dim=64, num_encoder_layers=1, num_decoder_layers=1, dropout=0.0,
        **target_tokenizer.special_ids)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras_tfm.MaskedSparseCategoricalCrossentropy(pad_id=0))
    return text.Translator(model, source_tokenizer, target_tokenizer, beam_size=2,
                           max_length=12)


def test_translation_scores_callback_logs_and_keeps_the_best(tmp_path, pairs):
    translator = _tiny_translator(pairs)
    sources, targets = pairs
    batches = text.TranslationBatches(
        translator.source_tokenizer.encode(sources[:200], add_end=True),
        translator.target_tokenizer.encode(targets[:200]), max_tokens=512, seed=0,
        **translator.target_tokenizer.special_ids)
    best = str(tmp_path / "best")
    callback = text.TranslationScores(translator, sources[200:230], targets[200:230],
                                      filepath=best, monitor="val_chrf")
    log = str(tmp_path / "log.csv")
    history = translator.model.fit(batches, epochs=2, verbose=0,
                                   callbacks=[callback, keras.callbacks.CSVLogger(log)])
    hypotheses = translator(sources[200:230])
    assert history.history["val_bleu"][-1] == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [targets[200:230]]).score)
    assert history.history["val_chrf"][-1] == pytest.approx(
        sacrebleu.corpus_chrf(hypotheses, [targets[200:230]]).score)
    with open(log) as file:
        rows = list(csv.DictReader(file))
    assert [float(r["val_chrf"]) for r in rows] == pytest.approx(history.history["val_chrf"])
    assert callback.best == max(history.history["val_chrf"])
    reloaded = text.Translator.load(best)
    assert isinstance(reloaded, text.Translator)


# --- text in, text out ----------------------------------------------------------------------------

def test_translator_saved_here_translates_the_same_under_another_backend(tmp_path, pairs):
    translator = _tiny_translator(pairs)  # random weights: outputs are arbitrary but not empty
    sentences = ["How are you?", "", "I know all about it.", "   ", "She gave us a present."]
    outputs = translator(sentences)
    assert outputs[1] == outputs[3] == "" and all(outputs[i] for i in (0, 2, 4))
    assert translator("How are you?") == outputs[0]
    directory = str(tmp_path / "translator")
    translator.save(directory)
    with pytest.raises(ValueError, match="already holds files"):
        translator.save(directory)
    inputs, result = tmp_path / "in.txt", tmp_path / "out.txt"
    inputs.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    env = dict(os.environ, KERAS_BACKEND=OTHER_BACKEND)
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "translate_text.py"),
                    "translate", directory, "--input", str(inputs), "--output", str(result)],
                   check=True, env=env, capture_output=True)
    assert result.read_text(encoding="utf-8").splitlines() == outputs


def test_text_generator_continues_past_its_context_and_reloads(tmp_path):
    corpus = "to be or not to be\n" * 20
    tokenizer = text.Tokenizer.train(corpus, kind="char", special_tokens=False)
    lm = keras_tfm.build_language_model(tokenizer.vocab_size, d_model=16, num_heads=2,
                                        ff_dim=32, num_layers=1, positional="learned",
                                        max_length=8, pad_id=None)
    generator = text.TextGenerator(lm, tokenizer)
    assert generator.context_length == 8
    output = generator.generate("to be", max_length=30, seed=3)
    assert output.startswith("to be") and len(output) == len("to be") + 30
    assert generator.generate("to be", max_length=30, seed=3) == output  # seeded
    greedy = generator.generate(["to", "be"], max_length=5, method="greedy")
    assert [len(g) for g in greedy] == [7, 7]
    generator.save(str(tmp_path / "lm"))
    loaded = text.load(str(tmp_path / "lm"))
    assert isinstance(loaded, text.TextGenerator)
    assert loaded.generate("to be", max_length=30, seed=3) == output
    with pytest.raises(ValueError, match="holds a TextGenerator"):
        text.Translator.load(str(tmp_path / "lm"))
    with pytest.raises(ValueError, match="no keras_tfm text model"):
        text.load(str(tmp_path))


# --- the example command lines --------------------------------------------------------------------

def _fails(main, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert message in str(exit_info.value)


def test_translate_text_command_line(tmp_path):
    example = _example("translate_text")
    out = str(tmp_path / "model")
    small = ["--vocab-size", "300", "--d-model", "32", "--layers", "1", "--ff-dim", "64",
             "--heads", "2", "--max-tokens", "512", "--validation", "20", "--max-length", "24"]
    example.main(["train", "--pairs", PAIRS, "--out", out, "--epochs", "1", *small])
    assert sorted(os.listdir(out)) == ["log.csv", "model.keras", "pipeline.json",
                                       "source_tokenizer.json", "target_tokenizer.json",
                                       "training.json"]
    _fails(example.main, ["train", "--pairs", PAIRS, "--out", out, *small],
           "already holds files")
    sources = tmp_path / "sources.txt"
    sources.write_text("How are you?\n\nI know all about it.\n", encoding="utf-8")
    translated = tmp_path / "translated.txt"
    example.main(["translate", out, "--input", str(sources), "--output", str(translated)])
    lines = translated.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 lines, the empty kept
    # bad inputs: one clear line each
    no_tab = tmp_path / "no_tab.tsv"
    no_tab.write_text("Go.\tVe.\nGo on\n", encoding="utf-8")
    _fails(example.main, ["train", "--pairs", str(no_tab), "--out", str(tmp_path / "a")],
           "line 2 is not 'source<TAB>target'")
    empty = tmp_path / "empty.tsv"
    empty.write_text("", encoding="utf-8")
    _fails(example.main, ["train", "--pairs", str(empty), "--out", str(tmp_path / "b")],
           "no sentence pairs")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("¿Qué?\n".encode("latin-1"))
    _fails(example.main, ["translate", out, "--input", str(latin1), "--output",
                          str(translated)], "line 1 is not UTF-8")


def test_text_lm_command_line(tmp_path, capsys):
    example = _example("text_lm")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40,
                      encoding="utf-8")
    out = str(tmp_path / "lm")
    example.main(["train", "--text", str(corpus), "--out", out, "--iters", "30", "--layers",
                  "1", "--d-model", "32", "--context", "16"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("val_loss=") and 0 < float(last.split("=")[1]) < 4.0
    example.main(["sample", out, "--prompt", "First", "--length", "40"])
    sample = capsys.readouterr().out
    assert sample.startswith("First") and len(sample) == len("First") + 40 + len("\n")
    _fails(example.main, ["train", "--text", str(corpus), "--out", out], "already holds files")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n", encoding="utf-8")
    _fails(example.main, ["train", "--text", str(empty), "--out", str(tmp_path / "x")],
           "holds no text")
