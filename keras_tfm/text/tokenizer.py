"""Tokenizers trained on the user's text: byte-level BPE for translation, characters for a
character-level language model, both Hugging Face `tokenizers` (a `tokenizer.json` that
transformers and other tools read), with the special ids a keras_tfm model takes."""

import json
import os

SPECIAL_TOKENS = {"pad_id": "<pad>", "start_id": "<s>", "end_id": "</s>", "unk_id": "<unk>"}
KINDS = ("bpe", "char")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:  # an optional dependency: the `text` extra
        raise ImportError("keras_tfm.text needs the `tokenizers` package: "
                          'pip install "keras-tfm[text]".') from error
    return tokenizers


class Tokenizer:
    """Text ↔ token ids with a model's special ids, around a Hugging Face `tokenizers.Tokenizer`.

    Train one with `Tokenizer.train` (seconds on a corpus of 100,000 sentences), or load a
    `tokenizer.json` (yours or a checkpoint's) with `Tokenizer.load`. The special tokens
    `<pad>`, `<s>`, `</s>`, `<unk>` of a trained subword tokenizer take ids 0, 1, 2, 3, which
    are `pad_id`, `start_id`, `end_id` and `unk_id` (`special_ids` gives the first three in the
    form `build_transformer(**tokenizer.special_ids)` takes); a tokenizer without one of them
    has None there.

    Args:
        tokenizer: a `tokenizers.Tokenizer`.
        special_tokens: `{"pad_id": "<pad>", ...}`: which token plays each special role
            (default `SPECIAL_TOKENS`; a role whose token is not in the vocabulary is None).

    Example:

    >>> tok = Tokenizer.train(["¿Cómo estás?", "How are you?"] * 50, vocab_size=300)
    >>> tok.decode(tok.encode("¿Cómo estás?"))
    '¿Cómo estás?'
    """

    def __init__(self, tokenizer, special_tokens=None):
        self.tokenizer = tokenizer
        self.special_tokens = dict(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        for role in SPECIAL_TOKENS:
            token = self.special_tokens.get(role)
            setattr(self, role, None if token is None else tokenizer.token_to_id(token))

    @classmethod
    def train(cls, texts, vocab_size=8000, kind="bpe", min_frequency=2, special_tokens=True,
              show_progress=False):
        """Train a tokenizer on `texts` (an iterable of strings, or one string).

        Args:
            texts: the training text: strings (sentences, lines), or one string.
            vocab_size: the vocabulary size of `"bpe"`, special tokens included.
            kind: `"bpe"`: byte-level BPE (NFC-normalized; any text round-trips, no unknown
                tokens); `"char"`: one token per character, numbered in sorted order as
                nanoGPT's (a character absent from `texts` is `<unk>`, or an error without
                special tokens).
            min_frequency: a BPE merge needs a pair seen this often.
            special_tokens: add `<pad>`, `<s>`, `</s>`, `<unk>` (ids 0-3). A character-level
                model of packed text needs none (`special_tokens=False`, `pad_id=None`).
            show_progress: the trainer's progress bar.

        Returns:
            A `Tokenizer`.

        Raises:
            ValueError: an unknown `kind`, no text, or a `vocab_size` too small for the
                special tokens and the 256 bytes of byte-level BPE.
        """
        tk = _tokenizers()
        if kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}; received kind={kind!r}.")
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not any(texts):
            raise ValueError("Tokenizer.train needs some text; received none (an empty file?).")
        specials = list(SPECIAL_TOKENS.values()) if special_tokens else []
        if kind == "char":
            chars = sorted(set("".join(texts)) - set(specials))
            vocab = {token: i for i, token in enumerate(specials + chars)}
            unk = SPECIAL_TOKENS["unk_id"] if special_tokens else None
            tokenizer = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token=unk))
            # every character its own piece, the newline included
            tokenizer.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(r"[\s\S]"), "isolated")
            tokenizer.decoder = tk.decoders.Fuse()
        else:
            alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
            if vocab_size < len(alphabet) + len(specials):
                least = len(alphabet) + len(specials)
                raise ValueError(f"Byte-level BPE needs vocab_size >= {least} (256 bytes and the "
                                 f"special tokens); received {vocab_size}.")
            tokenizer = tk.Tokenizer(tk.models.BPE())
            tokenizer.normalizer = tk.normalizers.NFC()
            tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = tk.decoders.ByteLevel()
            trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                             special_tokens=specials, initial_alphabet=alphabet,
                                             show_progress=show_progress)
            tokenizer.train_from_iterator(texts, trainer, length=len(texts))
        if specials:
            tokenizer.add_special_tokens(specials)
        return cls(tokenizer, None if special_tokens else {})

    @classmethod
    def load(cls, path, special_tokens=None):
        """A tokenizer from a `tokenizer.json` file, or a directory holding one."""
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"No tokenizer file at {path!r}.")
        return cls(_tokenizers().Tokenizer.from_file(path), special_tokens)

    @classmethod
    def from_pretrained(cls, path, special_ids):
        """The `tokenizer.json` of a Hugging Face checkpoint directory, its special roles
        those of the model's `special_ids` (`{"start_id": bos, "end_id": eos, ...}`, e.g.
        `model.special_ids` of `keras_tfm.from_pretrained`); `unk_id` is the tokenizer
        config's `unk_token`."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{path!r} has no tokenizer.json (a Hugging Face `tokenizers` "
                             "file); older checkpoints with only a SentencePiece model or "
                             "vocab files are not read.")
        tokenizer = _tokenizers().Tokenizer.from_file(file)
        roles = {role: tokenizer.id_to_token(int(value)) for role, value in special_ids.items()
                 if role in SPECIAL_TOKENS and value is not None}
        unk = _token_text(_read_tokenizer_config(path).get("unk_token"))
        if unk is not None:
            roles["unk_id"] = unk
        return cls(tokenizer, roles)

    def adds_start(self, path=None):
        """Whether this tokenizer puts its start token first (a checkpoint's
        `add_bos_token` in `tokenizer_config.json` in `path`, else what the `tokenizer.json`
        post-processor does to a text)."""
        if self.start_id is None:
            return False
        setting = _read_tokenizer_config(path).get("add_bos_token") if path else None
        if setting is not None:
            return bool(setting)
        ids = self.tokenizer.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.start_id

    def save(self, path):
        """Write the tokenizer to `path` (a `tokenizer.json` file; a directory gets one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        self.tokenizer.save(path)
        return path

    @property
    def vocab_size(self):
        """The number of token ids (special tokens included)."""
        return self.tokenizer.get_vocab_size()

    @property
    def special_ids(self):
        """`{"pad_id": …, "start_id": …, "end_id": …}` for a model's arguments (None where
        the tokenizer has no such token)."""
        return {role: getattr(self, role) for role in ("pad_id", "start_id", "end_id")}

    def encode(self, texts, add_start=False, add_end=False):
        """Token ids of a string (a list of ints) or of a list of strings (a list of lists),
        with `start_id` before and `end_id` after when asked.

        Raises:
            ValueError: a character the tokenizer cannot represent (a character tokenizer
                without `<unk>`), or `add_start` / `add_end` without such a token.
        """
        single = isinstance(texts, str)
        for flag, role in ((add_start, "start_id"), (add_end, "end_id")):
            if flag and getattr(self, role) is None:
                raise ValueError(f"This tokenizer has no {SPECIAL_TOKENS[role]} token "
                                 f"({role} is None).")
        try:
            encodings = self.tokenizer.encode_batch([texts] if single else list(texts),
                                                    add_special_tokens=False)
        except Exception as error:  # (the Rust error, e.g. a character outside the vocabulary)
            raise ValueError(f"Could not tokenize the text: {error}") from error
        head = [self.start_id] if add_start else []
        tail = [self.end_id] if add_end else []
        ids = [head + encoding.ids + tail for encoding in encodings]
        return ids[0] if single else ids

    def decode(self, ids, skip_special_tokens=True):
        """Text of token ids `(T,)` (a string) or `(B, T)` (a list of strings); the special
        tokens are left out, and each row stops at its first `end_id`."""
        rows = [list(map(int, row)) for row in ids] if _is_batch(ids) else [list(map(int, ids))]
        if skip_special_tokens and self.end_id is not None:
            rows = [row[:row.index(self.end_id)] if self.end_id in row else row for row in rows]
        texts = self.tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)
        return texts if _is_batch(ids) else texts[0]


def _read_tokenizer_config(path):
    file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _token_text(token):
    """A special token of a tokenizer config: a string, or an AddedToken's `content`."""
    return token.get("content") if isinstance(token, dict) else token


def _is_batch(ids):
    first = next(iter(ids), None)
    return first is not None and hasattr(first, "__len__")
