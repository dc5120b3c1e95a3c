"""Real text in and out: tokenizers trained on the user's text, batches of sentences and of
packed text, BLEU / chrF, and text-in/text-out objects (docs/text.md).

Needs the `text` extra (`tokenizers`, `sacrebleu`), imported when first used.
"""

from keras_tfm.text.data import LanguageModelWindows, TranslationBatches, read_pairs
from keras_tfm.text.evaluation import TranslationScores, corpus_scores
from keras_tfm.text.pipelines import TextGenerator, Translator, load
from keras_tfm.text.tokenizer import Tokenizer

__all__ = ["LanguageModelWindows", "TextGenerator", "Tokenizer", "TranslationBatches",
           "TranslationScores", "Translator", "corpus_scores", "load", "read_pairs"]
