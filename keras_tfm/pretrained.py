"""One entry point for Hugging Face `transformers` checkpoints: `from_pretrained(path)` reads a
directory (`config.json` + safetensors, sharded or not, or `pytorch_model.bin` with torch) and
hands it to the converter of its `model_type`; `to_pretrained(model, path)` writes one back.

| model_type | transformers class | keras_tfm model | converter |
| --- | --- | --- | --- |
| llama, qwen2, mistral | `*ForCausalLM` | `LanguageModel` | `llama.py` |
| gpt2 | `GPT2LMHeadModel` | `LanguageModel` | `gpt2.py` |
| bert | `BertModel`, `BertForSequenceClassification` | `EncoderModel` | `bert.py` |
| marian | `MarianMTModel` | `Seq2SeqTransformer` | `marian.py` |
"""

import os
import shutil

from keras_tfm import bert, gpt2, llama
from keras_tfm.checkpoints import read_config
from keras_tfm.marian import from_marian, to_marian
from keras_tfm.models import EncoderModel, LanguageModel
from keras_tfm.seq2seq import Seq2SeqTransformer

READERS = {**{name: llama.from_llama for name in llama.MODEL_TYPES},
           "gpt2": gpt2.from_gpt2, "bert": bert.from_bert}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model")


def from_pretrained(path, dtype=None, verbose="auto"):
    """Load a Hugging Face `transformers` checkpoint directory as a keras_tfm model.

    Reads `config.json` and the weights with NumPy (no transformers, no torch, no download):
    `model.safetensors`, or the shards listed in `model.safetensors.index.json`, or a
    `pytorch_model.bin` (with torch). Tensors are read one at a time into the model's
    variables, so loading holds about one copy of the weights; bfloat16 / float16 weights stay
    exact under a matching `dtype` policy. The model remembers the checkpoint's special ids
    (`model.special_ids`: `start_id` = bos, `end_id` = eos, `pad_id` = the pad token unless the
    checkpoint has none or it is its bos / eos), so `keras_tfm.generate` needs none.

    | checkpoint (`model_type`) | returns |
    | --- | --- |
    | `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM` | `LanguageModel`: tokens `(B, T)` → logits `(B, T, V)` |
    | `GPT2LMHeadModel` (`gpt2`) | `LanguageModel` (learned positions, tied head) |
    | `BertModel` (`bert`; other BERT heads load as it) | `EncoderModel`: `[token_ids, segment_ids]` → features `(B, T, d)`; `model.pooled_output(...)` the pooler's |
    | `BertForSequenceClassification` | `EncoderModel`: `[token_ids, segment_ids]` → logits `(B, k)` |
    | `MarianMTModel` (`marian`) | `Seq2SeqTransformer` (`from_marian`) |

    Args:
        path: a directory written by transformers' `save_pretrained` (or downloaded from the
            hub).
        dtype: the models' dtype policy (e.g. `"bfloat16"`); None: Keras's global policy.
        verbose: a progress bar over the tensors; "auto": for a checkpoint of several files.

    Returns:
        A `LanguageModel`, `EncoderModel` or `Seq2SeqTransformer` with the checkpoint's
        weights.

    Raises:
        ValueError: not a transformers directory; another `model_type`; options keras_tfm
            cannot represent (scaled rotary embeddings, a sliding window shorter than the
            model's positions, ... all named); missing, unexpected or mis-shaped tensors
            (named).

    Example:

    >>> lm = keras_tfm.from_pretrained("Qwen2.5-0.5B")  # doctest: +SKIP
    >>> keras_tfm.generate(lm, [prompt_ids], max_length=32)  # doctest: +SKIP
    """
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type == "marian":
        if dtype is not None:
            raise ValueError("from_pretrained reads Marian checkpoints in float32 "
                             f"(from_marian); received dtype={dtype!r}.")
        return from_marian(path)
    if model_type not in READERS:
        raise ValueError(f"{os.path.join(path, 'config.json')} is a {model_type!r} model; "
                         f"from_pretrained reads model_type {sorted(READERS) + ['marian']}.")
    return READERS[model_type](path, config, dtype=dtype, verbose=verbose)


def _copy_tokenizer(source, destination):
    present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    if not present:
        raise ValueError(f"tokenizer_dir={source!r} holds no tokenizer files (looked for "
                         f"{', '.join(TOKENIZER_FILES)}).")
    for name in present:
        shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))


def to_pretrained(model, path, tokenizer_dir=None, max_position_embeddings=None,
                  max_shard_size="5GB", verbose=False):
    """Write a keras_tfm model as a Hugging Face `transformers` directory.

    `config.json`, `generation_config.json` (the model's special ids) and safetensors weights
    (in the variables' dtype; shards and an index past `max_shard_size`), which
    `transformers.AutoModelForCausalLM.from_pretrained(path)` loads:

    * a rotary, RMSNorm, SwiGLU, bias-free `LanguageModel` (e.g. from a Llama checkpoint) as
      `LlamaForCausalLM`, or `Qwen2ForCausalLM` with `qkv_bias=True`;
    * a learned-position, LayerNorm, tied `LanguageModel` with biases (GPT-2's shape) as
      `GPT2LMHeadModel`;
    * a BERT-shaped `EncoderModel` (post-LN, learned positions, segments, embedding norm) as
      `BertModel`, or with its pooler and classifier as `BertForSequenceClassification`;
    * a Marian-shaped `Seq2SeqTransformer` as `MarianMTModel` (`to_marian`).

    Args:
        model: the model to export.
        path: the directory to write (created if needed; files in it are replaced).
        tokenizer_dir: a directory whose tokenizer files (`tokenizer.json`,
            `tokenizer_config.json`, ...) are copied beside the weights.
        max_position_embeddings: the longest sequence transformers will accept (rotary and
            sinusoidal positions have no table; default: the model's `max_length`, else 4096
            for Llama and 512 for Marian).
        max_shard_size: the largest weights file, bytes or a string such as `"5GB"`.
        verbose: a progress bar over the tensors.

    Raises:
        ValueError: a model no supported checkpoint can represent (what differs is named).

    Example:

    >>> keras_tfm.to_pretrained(lm, "my-llama", tokenizer_dir="TinyLlama")  # doctest: +SKIP
    """
    if isinstance(model, Seq2SeqTransformer):
        to_marian(model, path, max_position_embeddings=max_position_embeddings or 512,
                  tokenizer_dir=tokenizer_dir)
        return
    elif isinstance(model, LanguageModel):
        config = model.get_config()
        llama_problems = llama.check_exportable(config)
        gpt2_problems = gpt2.check_exportable(config)
        if not llama_problems:
            llama.to_llama(model, path, max_position_embeddings=max_position_embeddings,
                           max_shard_size=max_shard_size, verbose=verbose)
        elif not gpt2_problems:
            gpt2.to_gpt2(model, path, max_shard_size=max_shard_size, verbose=verbose)
        else:
            raise ValueError("This LanguageModel is neither a Llama-family checkpoint ("
                             + "; ".join(llama_problems) + ") nor a GPT-2 one ("
                             + "; ".join(gpt2_problems) + ").")
    elif isinstance(model, EncoderModel):
        bert.to_bert(model, path, max_shard_size=max_shard_size, verbose=verbose)
    else:
        raise ValueError(f"to_pretrained exports keras_tfm LanguageModel, EncoderModel and "
                         f"Seq2SeqTransformer models; received {type(model).__name__}.")
    if tokenizer_dir is not None:
        _copy_tokenizer(tokenizer_dir, path)
