"""Text in, text out: a model and its tokenizer(s) in one object, saved as one directory that
loads under any backend.

* `Translator`: an encoder-decoder model with its source and target tokenizers;
  `translator(["How are you?"]) -> ["¿Cómo estás?"]`.
* `TextGenerator`: a language model with its tokenizer; `generator.generate("ROMEO:")`.
"""

import json
import os

from keras_tfm import saving
from keras_tfm.generation import generate
from keras_tfm.models import LanguageModel
from keras_tfm.pretrained import from_pretrained
from keras_tfm.text.tokenizer import Tokenizer

CONFIG = "pipeline.json"
MODEL = "model.keras"


def _check_target(directory, overwrite):
    """Refuse to write into a directory holding other files than a pipeline of this kind,
    unless `overwrite`."""
    if not os.path.isdir(directory):
        if os.path.exists(directory):
            raise ValueError(f"{directory!r} exists and is not a directory.")
        os.makedirs(directory)
        return
    if overwrite or not os.listdir(directory):
        return
    names = sorted(os.listdir(directory))
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise ValueError(f"{directory!r} already holds files ({shown}); pass overwrite=True to "
                     "replace them.")


def _save(directory, kind, model, tokenizers, settings, overwrite):
    _check_target(directory, overwrite)
    saving.save_model(model, os.path.join(directory, MODEL))
    for name, tokenizer in tokenizers.items():
        tokenizer.save(os.path.join(directory, f"{name}.json"))
    with open(os.path.join(directory, CONFIG), "w", encoding="utf-8") as file:
        json.dump({"kind": kind, "tokenizers": sorted(tokenizers), **settings}, file, indent=2)


def _read(directory):
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"{directory!r} holds no keras_tfm text model (no {CONFIG}).")
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    model = saving.load_model(os.path.join(directory, MODEL))
    tokenizers = {name: Tokenizer.load(os.path.join(directory, f"{name}.json"))
                  for name in config.pop("tokenizers")}
    return config.pop("kind"), model, tokenizers, config


def load(directory):
    """The `Translator` or `TextGenerator` saved in `directory` (by its `save`)."""
    kind, model, tokenizers, settings = _read(directory)
    cls = {"translator": Translator, "text_generator": TextGenerator}[kind]
    return cls(model, **tokenizers, **settings)


def _load_as(cls, directory):
    """`load(directory)`, which must be a `cls`."""
    loaded = load(directory)
    if not isinstance(loaded, cls):
        raise ValueError(f"{directory!r} holds a {type(loaded).__name__}, not a {cls.__name__}.")
    return loaded


class Translator:
    """An encoder-decoder model with its tokenizers: text in, text out.

    Sources are encoded with `end_id` appended (as the training batches of `translate_text.py`
    and MarianMT have them); translations are decoded with beam search (or greedy with
    `beam_size=1`) and detokenized.

    Args:
        model: a `Seq2SeqTransformer` (its special ids are the target tokenizer's).
        source_tokenizer: a `keras_tfm.text.Tokenizer` of the source language.
        target_tokenizer: the target language's (None: the source's, a shared vocabulary).
        beam_size: beams of a translation (1: greedy search).
        max_length: the most tokens of a translation.
        length_penalty: beam search's length penalty α.

    Call arguments:
        texts: a string or a list of strings. An empty (or blank) line translates to "".
        beam_size, max_length: override the translator's for this call.
        batch_size: sentences decoded at once.
        verbose: a progress bar over the batches.

    Returns:
        A string, or a list of strings (one per input, in order).

    Example:

    >>> translator = Translator(model, english, spanish)  # doctest: +SKIP
    >>> translator(["How are you?"])  # doctest: +SKIP
    ['¿Cómo estás?']
    """

    def __init__(self, model, source_tokenizer, target_tokenizer=None, beam_size=4,
                 max_length=64, length_penalty=0.6):
        self.model = model
        self.source_tokenizer = source_tokenizer
        self.target_tokenizer = target_tokenizer or source_tokenizer
        self.beam_size, self.max_length = int(beam_size), int(max_length)
        self.length_penalty = float(length_penalty)
        table = model.get_config().get("max_length")
        self._source_limit = table if model.get_config().get("positional") == "learned" else None
        if self._source_limit is not None:
            self.max_length = min(self.max_length, self._source_limit)

    def __call__(self, texts, beam_size=None, max_length=None, batch_size=64, verbose=False):
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        keep = [i for i, text in enumerate(texts) if text.strip()]
        outputs = [""] * len(texts)
        if keep:
            sources = self.source_tokenizer.encode([texts[i].strip() for i in keep],
                                                   add_end=True)
            if self._source_limit is not None:  # (the encoder's learned position table)
                sources = [ids[:self._source_limit] for ids in sources]
            beam_size = self.beam_size if beam_size is None else beam_size
            tokens = generate(self.model, sources, max_length=max_length or self.max_length,
                              method="beam" if beam_size > 1 else "greedy",
                              beam_size=beam_size, length_penalty=self.length_penalty,
                              batch_size=batch_size, verbose=verbose)
            for i, text in zip(keep, self.target_tokenizer.decode(tokens)):
                outputs[i] = text.strip()
        return outputs[0] if single else outputs

    def save(self, directory, overwrite=False):
        """Save the model, both tokenizers and the settings into `directory`; `load` reads it
        back (under any backend). A directory holding other files is refused unless
        `overwrite`."""
        tokenizers = {"source_tokenizer": self.source_tokenizer}
        if self.target_tokenizer is not self.source_tokenizer:
            tokenizers["target_tokenizer"] = self.target_tokenizer
        _save(directory, "translator", self.model, tokenizers,
              {"beam_size": self.beam_size, "max_length": self.max_length,
               "length_penalty": self.length_penalty}, overwrite)

    @classmethod
    def load(cls, directory):
        """The `Translator` saved in `directory`."""
        return _load_as(cls, directory)


class TextGenerator:
    """A language model with its tokenizer: a prompt in, the prompt and its continuation out.

    A model trained on windows of `context_length` tokens continues beyond that length with a
    sliding window: each call keeps the last `context_length // 2` tokens as the prompt and
    generates up to `context_length` tokens, as nanoGPT's sampling crops its context.

    `TextGenerator.from_pretrained(path)` loads a transformers checkpoint (Llama, Qwen2,
    Mistral, GPT-2: `keras_tfm.from_pretrained`) with its `tokenizer.json`.

    Args:
        model: a `LanguageModel`.
        tokenizer: its `keras_tfm.text.Tokenizer`.
        context_length: the longest context the model was trained on (None: the model's
            learned position table if it has one, else no limit).
        add_start: put the tokenizer's start token (`<s>`, bos) before each prompt, as
            Llama's tokenizer does.

    Example:

    >>> generator = TextGenerator(lm, characters, context_length=64)  # doctest: +SKIP
    >>> generator.generate("ROMEO:", max_length=300, seed=0)  # doctest: +SKIP
    'ROMEO:\\nWhat say you ...'
    """

    def __init__(self, model, tokenizer, context_length=None, add_start=False):
        self.model, self.tokenizer = model, tokenizer
        self.add_start = bool(add_start)
        if context_length is None and model.get_config().get("positional") == "learned":
            context_length = model.get_config()["max_length"]
        self.context_length = None if context_length is None else int(context_length)
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"`context_length` must be >= 2; received {context_length!r}.")

    def generate(self, prompt, max_length=100, method="sample", temperature=1.0, top_k=None,
                 top_p=1.0, seed=None):
        """The prompt followed by up to `max_length` new tokens, as text.

        Args:
            prompt: a string (with at least one token), or a list of strings.
            max_length: new tokens at most (fewer when the model produces its `end_id`).
            method: `"sample"` or `"greedy"`.
            temperature, top_k, top_p, seed: sampling options (see `keras_tfm.generate`).

        Returns:
            A string, or a list of strings.
        """
        if not isinstance(prompt, str):
            return [self.generate(p, max_length, method, temperature, top_k, top_p, seed)
                    for p in prompt]
        ids = self.tokenizer.encode(prompt, add_start=self.add_start)
        if not ids:
            raise ValueError("The prompt holds no token; give some text.")
        end_id = self.model.special_ids.get("end_id")
        new, call = [], 0
        while len(new) < max_length:
            context = ids + new
            count = max_length - len(new)
            if self.context_length is not None:
                if len(context) >= self.context_length:
                    context = context[-(self.context_length // 2):]
                count = min(count, self.context_length - len(context))
            tokens = generate(self.model, [context], max_length=count, end_id=end_id,
                              method=method, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=None if seed is None else seed + call)[0]
            tokens = [int(t) for t in tokens]
            if end_id is not None and end_id in tokens:
                new += tokens[:tokens.index(end_id)]
                break
            new += tokens
            call += 1
        return self.tokenizer.decode(ids + new)

    def save(self, directory, overwrite=False):
        """Save the model, the tokenizer and the settings into `directory` (see `load`)."""
        _save(directory, "text_generator", self.model, {"tokenizer": self.tokenizer},
              {"context_length": self.context_length, "add_start": self.add_start}, overwrite)

    @classmethod
    def from_pretrained(cls, path, dtype=None, context_length=None):
        """A Hugging Face checkpoint directory with its `tokenizer.json` as a `TextGenerator`.

        The model comes from `keras_tfm.from_pretrained(path, dtype)` (a Llama, Qwen2,
        Mistral or GPT-2 language model); the tokenizer is the directory's `tokenizer.json`
        (Hugging Face `tokenizers`), its special tokens those of the model's special ids
        (bos, eos, pad). Prompts start with the start token (bos) when the checkpoint's
        tokenizer adds it (`add_bos_token` in `tokenizer_config.json`, else its
        `tokenizer.json` post-processor), as transformers' tokenizer does. A checkpoint
        without a pad token (Llama) generates with `pad_id=None`: the rows of a batch that
        finish early are filled with the end token.

        Args:
            path: the checkpoint directory (`config.json`, weights, `tokenizer.json`).
            dtype: the model's dtype policy (None: Keras's global policy).
            context_length: as in `TextGenerator` (None: GPT-2's position table, else no
                limit).

        Example:

        >>> generator = TextGenerator.from_pretrained("TinyLlama-1.1B")  # doctest: +SKIP
        >>> generator.generate("Once upon a time", max_length=20, method="greedy")  # doctest: +SKIP
        """
        model = from_pretrained(path, dtype=dtype)
        if not isinstance(model, LanguageModel):
            raise ValueError(f"{path!r} holds a {type(model).__name__}; a TextGenerator needs "
                             "a language model (Llama, Qwen2, Mistral, GPT-2).")
        tokenizer = Tokenizer.from_pretrained(path, model.special_ids)
        return cls(model, tokenizer, context_length=context_length,
                   add_start=tokenizer.adds_start(path))

    @classmethod
    def load(cls, directory):
        """The `TextGenerator` saved in `directory`."""
        return _load_as(cls, directory)
