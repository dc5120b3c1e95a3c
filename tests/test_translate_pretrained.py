"""examples/translate_pretrained.py end to end, without downloads: a SentencePiece model trained
here on the seeds' toy language, a MarianTokenizer built from it, and a MarianMTModel with random
weights in one directory; text in, text out, against transformers' own translation."""

import json
import os
import sys

import numpy as np
import pytest
import sacrebleu
import sentencepiece as spm
import torch
from transformers import MarianMTModel, MarianTokenizer

from test_marian import marian_config

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)

import toy_data  # noqa: E402
import translate_pretrained  # noqa: E402

import keras_tfm  # noqa: E402

SENTENCES = ["a b 3 c", "d 5 5 a b", "8 c"]


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("opus-mt-toy")
    words = toy_data.sample_sentences(300, seed=0)
    corpus = [" ".join(w) for w in words] + [" ".join(toy_data.translate(w)) for w in words]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(path / "sp"), vocab_size=24,
        model_type="unigram", character_coverage=1.0, hard_vocab_limit=False,
        bos_id=-1, eos_id=-1, unk_id=0, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_file=str(path / "sp.model"))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    # Marian's vocabulary: </s> = 0, <unk> = 1, the pieces, <pad> = the last id.
    vocab = ["</s>", "<unk>"] + [p for p in pieces if p != "<unk>"] + ["<pad>"]
    (path / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(vocab)}))
    for name in ("source.spm", "target.spm"):
        (path / name).write_bytes((path / "sp.model").read_bytes())
    tokenizer = MarianTokenizer(source_spm=str(path / "source.spm"),
                                target_spm=str(path / "target.spm"),
                                vocab=str(path / "vocab.json"))
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = marian_config(vocab_size=len(vocab), pad_token_id=len(vocab) - 1,
                           decoder_start_token_id=len(vocab) - 1, activation_function="swish",
                           scale_embedding=True)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "layer_norm" not in name and "embed_positions" not in name:
                parameter.normal_(0.0, 0.1)
        model.get_input_embeddings().weight[config.pad_token_id] = 0.0  # as torch initialises it
    model.save_pretrained(path)
    return path


def test_tokenizer_round_trip(marian_dir):
    tokenizer = MarianTokenizer.from_pretrained(marian_dir)
    ids = tokenizer(SENTENCES, padding=True, return_tensors="np")["input_ids"]
    assert ids.shape[0] == 3 and (ids[:, -1] == tokenizer.pad_token_id).any()  # right-padded
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == SENTENCES


def test_example_translates_as_transformers_does(marian_dir):
    model, tokenizer = translate_pretrained.load(str(marian_dir))
    ours = translate_pretrained.translate(model, tokenizer, SENTENCES, beam_size=1, max_length=10)
    hf = MarianMTModel.from_pretrained(marian_dir).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        tokens = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=10,
                             suppress_tokens=[tokenizer.pad_token_id], forced_eos_token_id=None)
    assert ours == tokenizer.batch_decode(tokens, skip_special_tokens=True)
    assert any(ours)  # some text came out


def test_example_command_line_prints_translations_and_scores(marian_dir, tmp_path, capsys):
    sources = tmp_path / "sources.txt"
    sources.write_text("\n".join(SENTENCES[1:]) + "\n")
    translations = translate_pretrained.main(
        [str(marian_dir), SENTENCES[0], "--sources", str(sources), "--beam-size", "2",
         "--max-length", "8"])
    assert len(translations) == 3
    # Scored against themselves, the translations get a chrF of 100 (BLEU too where they hold
    # 4-grams; a random model's short outputs may not).
    references = tmp_path / "references.txt"
    references.write_text("\n".join(translations) + "\n")
    translate_pretrained.main([str(marian_dir), *SENTENCES, "--beam-size", "2",
                               "--max-length", "8", "--references", str(references)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[:3] == translations and lines[3:6] == translations
    bleu = sacrebleu.corpus_bleu(translations, [translations]).score
    assert lines[-1] == f"BLEU {bleu:.2f}  chrF 100.00  (3 sentences)"
    with pytest.raises(ValueError, match="3 translations but 2 references"):
        translate_pretrained.score(translations, translations[:2])


def test_an_export_with_its_tokenizer_converts_to_ctranslate2(marian_dir, tmp_path):
    """to_marian(..., tokenizer_dir=) writes what CTranslate2's converter reads; its greedy
    translation of the exported weights equals keras_tfm's."""
    import ctranslate2

    model, tokenizer = translate_pretrained.load(str(marian_dir))
    export = tmp_path / "export"
    keras_tfm.to_marian(model, str(export), tokenizer_dir=str(marian_dir))
    ctranslate2.converters.TransformersConverter(str(export)).convert(str(tmp_path / "ct2"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    ids = tokenizer(SENTENCES, padding=True, return_tensors="np")["input_ids"]
    pieces = [tokenizer.convert_ids_to_tokens([t for t in row if t != tokenizer.pad_token_id])
              for row in ids]
    results = translator.translate_batch(pieces, beam_size=1, max_decoding_length=10)
    theirs = [tokenizer.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
    ours = keras_tfm.generate(model, ids, max_length=10)
    for mine, other in zip(ours, theirs):
        mine = [t for t in mine.tolist() if t not in (0, tokenizer.pad_token_id)]
        assert mine == other
    with pytest.raises(ValueError, match="holds no MarianTokenizer"):
        keras_tfm.to_marian(model, str(tmp_path / "x"), tokenizer_dir=str(tmp_path))
