"""Translate with a Hugging Face MarianMT (opus-mt) checkpoint, run by keras_tfm.

    huggingface-cli download Helsinki-NLP/opus-mt-en-de --local-dir opus-mt-en-de   # once
    KERAS_BACKEND=jax python examples/translate_pretrained.py opus-mt-en-de "How are you?" ...
        [--sources FILE] [--references FILE] [--beam-size 4] [--max-length 128]
        [--batch-size 16]

Loads the directory with `keras_tfm.from_marian`, tokenizes with `transformers.MarianTokenizer`
(the directory's `source.spm`, `target.spm`, `vocab.json`), translates with KV-cached beam
search (greedy with `--beam-size 1`) and prints one translation per line. With `--references`
(one line per sentence) it also prints corpus BLEU and chrF (sacrebleu). Needs the `examples`
extra (transformers, sentencepiece, sacrebleu, safetensors); no network once the model is on disk.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_tfm  # noqa: E402


def load(directory):
    """The keras_tfm model and the MarianTokenizer of a transformers directory."""
    from transformers import MarianTokenizer

    return keras_tfm.from_marian(directory), MarianTokenizer.from_pretrained(directory)


def translate(model, tokenizer, sentences, beam_size=4, max_length=128, batch_size=16):
    """Translations of `sentences` (a list of str), in order."""
    ids = tokenizer(list(sentences), padding=True, return_tensors="np")["input_ids"]
    method = "beam" if beam_size > 1 else "greedy"
    tokens = keras_tfm.generate(model, ids, max_length=max_length, method=method,
                                beam_size=beam_size, batch_size=batch_size)
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)


def score(hypotheses, references):
    """Corpus BLEU and chrF of the hypotheses against one reference each (sacrebleu)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} translations but {len(references)} references.")
    return (sacrebleu.corpus_bleu(hypotheses, [references]).score,
            sacrebleu.corpus_chrf(hypotheses, [references]).score)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="a MarianMT directory written by transformers")
    parser.add_argument("sentences", nargs="*", help="sentences to translate")
    parser.add_argument("--sources", help="a file of sentences, one per line")
    parser.add_argument("--references", help="a file of reference translations, one per line")
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args(argv)
    sentences = list(args.sentences) + (read_lines(args.sources) if args.sources else [])
    if not sentences:
        parser.error("give sentences to translate, or --sources FILE")
    model, tokenizer = load(args.directory)
    translations = translate(model, tokenizer, sentences, args.beam_size, args.max_length,
                             args.batch_size)
    for translation in translations:
        print(translation)
    if args.references:
        bleu, chrf = score(translations, read_lines(args.references))
        print(f"BLEU {bleu:.2f}  chrF {chrf:.2f}  ({len(translations)} sentences)")
    return translations


if __name__ == "__main__":
    main()
