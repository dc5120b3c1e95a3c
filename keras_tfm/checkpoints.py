"""Hugging Face `transformers` checkpoint directories, read and written with NumPy, one tensor at
a time: `config.json` and its companions, safetensors weights (one `model.safetensors`, or
shards listed by `model.safetensors.index.json`), `pytorch_model.bin` (read with torch where
it is installed), and the table (`Tensor`) that names each checkpoint tensor and the Keras
variables it fills, which loading and exporting both follow.

Memory: a tensor is read from its file when it is assigned (`np.fromfile` at its offset, or
torch's memory-mapped load), so loading holds the model's variables plus one tensor; exporting
writes each variable as it is converted.
"""

import dataclasses
import json
import math
import os
import re

import keras
import numpy as np

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_INDEX, SAFETENSORS, PICKLE_INDEX, PICKLE)

# safetensors dtype names → NumPy dtypes (bfloat16 is read as uint16 and widened by hand).
_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
_SAFETENSORS_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# transformers' activation names → keras_tfm's.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_approximate", "gelu_pytorch_tanh":
               "gelu_approximate", "relu": "relu", "silu": "silu", "swish": "silu"}


def read_json(path, name, required=False):
    """`path/name` parsed, `{}` when it is absent (a ValueError when `required`)."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        if required:
            raise ValueError(f"{path!r} has no {name}: not a transformers model directory.")
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def read_config(path):
    """`config.json` of a transformers directory; a ValueError for anything else."""
    if not os.path.isdir(path):
        raise ValueError(f"Expected a directory written by transformers (config.json + "
                         f"model.safetensors); {path!r} is not a directory.")
    return read_json(path, "config.json", required=True)


def _bfloat16_to_float32(bits):
    """bfloat16 bit patterns (uint16) as float32: the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bfloat16(values):
    """float32 → bfloat16 bit patterns (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return np.where(np.isnan(values), 0x7FC0, rounded >> 16).astype(np.uint16)


class _SafetensorsFile:
    """One `.safetensors` file: its header, and tensors read one at a time."""

    def __init__(self, file):
        self.file = file
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.start, self.header = 8 + size, header

    def shape(self, name):
        return tuple(self.header[name]["shape"])

    def dtype(self, name):
        return self.header[name]["dtype"]

    def read(self, name):
        info = self.header[name]
        if info["dtype"] not in _NUMPY:
            raise ValueError(f"Tensor {name} in {self.file} has dtype {info['dtype']}, which "
                             "keras_tfm does not read.")
        dtype = np.dtype(_NUMPY[info["dtype"]])
        begin, end = info["data_offsets"]
        array = np.fromfile(self.file, dtype=dtype, count=(end - begin) // dtype.itemsize,
                            offset=self.start + begin).reshape(info["shape"])
        return _bfloat16_to_float32(array) if info["dtype"] == "BF16" else array


class _PickleFile:
    """One `pytorch_model.bin` (torch's zip format), memory-mapped by torch."""

    def __init__(self, file):
        try:
            import torch
        except ImportError as error:
            raise ValueError(f"{file} is a PyTorch pickle, which needs torch to read; install "
                             "torch or save the model with safetensors.") from error
        self.file = file
        try:
            self.state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # an old (non-zip) pickle cannot be memory-mapped
            self.state = torch.load(file, map_location="cpu", weights_only=True)
        self.header = self.state

    def shape(self, name):
        return tuple(self.state[name].shape)

    def dtype(self, name):
        return str(self.state[name].dtype).removeprefix("torch.")

    def read(self, name):
        tensor = self.state[name]
        return (tensor.float() if tensor.is_floating_point() else tensor).numpy()


class Checkpoint:
    """The tensors of a transformers directory, by name, read one at a time (`read`).

    Looks for `model.safetensors.index.json` (shards), `model.safetensors`,
    `pytorch_model.bin.index.json`, `pytorch_model.bin`, in that order. `rename` maps the
    stored names to the ones a converter expects (a prefix added, old LayerNorm names).
    """

    def __init__(self, path):
        self.path = path
        files = None
        for name in WEIGHT_FILES:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                continue
            if name.endswith(".index.json"):
                with open(file, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            else:
                files = [name]
            break
        if files is None:
            raise ValueError(f"{path!r} has no weights file (looked for "
                             f"{', '.join(WEIGHT_FILES)}).")
        self.files = files
        self._where = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise ValueError(f"{path!r} lists the weights file {name} in its index, but "
                                 "the file is missing.")
            reader = (_SafetensorsFile if name.endswith(".safetensors") else _PickleFile)(file)
            self._where.update({tensor: (reader, tensor) for tensor in reader.header})

    @property
    def names(self):
        return set(self._where)

    def rename(self, function):
        """Rename every tensor `name → function(name)` (None drops it)."""
        renamed = {}
        for name, place in self._where.items():
            new = function(name)
            if new is not None:
                renamed[new] = place
        self._where = renamed

    def shape(self, name):
        reader, stored = self._where[name]
        return reader.shape(stored)

    def dtype(self, name):
        reader, stored = self._where[name]
        return reader.dtype(stored)

    def read(self, name):
        """The tensor as a NumPy array (floats as float32: bfloat16 and float16 widen
        exactly)."""
        reader, stored = self._where[name]
        array = reader.read(stored)
        return array.astype(np.float32) if array.dtype == np.float16 else array


def add_prefix(prefix, names, keep=()):
    """A `rename` function that adds `prefix` to every name when none has it (a base model's
    checkpoint, e.g. `BertModel` or `LlamaModel`, holds the names without it), except the
    names matching a pattern of `keep`."""
    if any(name.startswith(prefix) for name in names):
        return lambda name: name
    return lambda name: (name if any(re.fullmatch(p, name) for p in keep) else prefix + name)


@dataclasses.dataclass
class Tensor:
    """A checkpoint tensor and the Keras variables it fills.

    `load(array)` turns the checkpoint's array into one array per variable (in the variables'
    shapes); `save(arrays)` does the reverse. Most tensors fill one variable; GPT-2's fused
    query-key-value projection fills three.
    """

    name: str
    variables: list
    load: object
    save: object

    def checkpoint_shape(self):
        empty = [np.empty(tuple(v.shape), np.float32) for v in self.variables]
        return tuple(self.save(empty).shape)


def _prod(shape):
    return int(math.prod(shape))


def same(name, variable):
    """A tensor stored as the variable is (embeddings, norm scales and offsets)."""
    shape = tuple(variable.shape)
    return Tensor(name, [variable], lambda a: [a.reshape(shape)], lambda arrays: arrays[0])


def bias(name, variable):
    """A bias stored flat: `(out,)` for a variable of shape `(heads, head_dim)` too."""
    shape = tuple(variable.shape)
    return Tensor(name, [variable], lambda a: [a.reshape(shape)],
                  lambda arrays: arrays[0].reshape(-1))


def linear(name, variable, in_axes=1):
    """A `torch.nn.Linear` weight `(out, in)` for a kernel `(in..., out...)` whose first
    `in_axes` axes are the inputs (a Dense kernel, an attention projection `(d, heads, k)`, an
    attention output `(heads, k, d)` with `in_axes=2`)."""
    shape = tuple(variable.shape)
    return Tensor(name, [variable], lambda a: [a.T.reshape(shape)],
                  lambda arrays: arrays[0].reshape(_prod(shape[:in_axes]), -1).T)


def conv1d(name, variable, in_axes=1):
    """A GPT-2 `Conv1D` weight `(in, out)`: the kernel's own layout, flattened."""
    shape = tuple(variable.shape)
    return Tensor(name, [variable], lambda a: [a.reshape(shape)],
                  lambda arrays: arrays[0].reshape(_prod(shape[:in_axes]), -1))


def load_tensors(checkpoint, tensors, ignore=(), what="the config", verbose="auto"):
    """Assign every tensor of `tensors` from `checkpoint`, one at a time.

    Args:
        checkpoint: a `Checkpoint`.
        tensors: the `Tensor` table of the model.
        ignore: regular expressions of stored names that are not weights of the model (tied
            copies, buffers) and are skipped.
        what: how the error messages name the model's configuration.
        verbose: a progress bar (`keras.utils.Progbar`); "auto": for a checkpoint of several
            files.

    Raises:
        ValueError: missing, unexpected or mis-shaped tensors, all named, before any variable
            is assigned.
    """
    expected = {tensor.name for tensor in tensors}
    skip = [re.compile(pattern) for pattern in ignore]
    missing = sorted(expected - checkpoint.names)
    unexpected = sorted(name for name in checkpoint.names - expected
                        if not any(p.fullmatch(name) for p in skip))
    if missing or unexpected:
        raise ValueError(f"The weights in {checkpoint.path!r} do not fit {what}: missing "
                         f"{missing or 'none'}; unexpected {unexpected or 'none'}.")
    wrong = [f"{t.name} {checkpoint.shape(t.name)} (expected {t.checkpoint_shape()})"
             for t in tensors if checkpoint.shape(t.name) != t.checkpoint_shape()]
    if wrong:
        raise ValueError(f"Tensors of {checkpoint.path!r} have shapes that do not fit {what}: "
                         + "; ".join(wrong) + ".")
    verbose = len(checkpoint.files) > 1 if verbose == "auto" else bool(verbose)
    progress = keras.utils.Progbar(len(tensors), unit_name="tensor") if verbose else None
    for i, tensor in enumerate(tensors):
        arrays = tensor.load(checkpoint.read(tensor.name))
        for variable, array in zip(tensor.variables, arrays):
            if str(array.dtype) != str(variable.dtype):
                array = keras.ops.cast(array, variable.dtype)
            variable.assign(array)
        del arrays
        if progress is not None:
            progress.update(i + 1)


def _variable_array(variable):
    """A variable's value as float32 NumPy (bfloat16 and float16 widen exactly)."""
    return keras.ops.convert_to_numpy(keras.ops.cast(variable, "float32"))


def _encode(array, dtype):
    if dtype == "BF16":
        return _float32_to_bfloat16(array)
    return np.ascontiguousarray(array, np.float16 if dtype == "F16" else np.float32)


def _shard_size(max_shard_size):
    if isinstance(max_shard_size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)\s*", max_shard_size.upper())
        if not match:
            raise ValueError(f"`max_shard_size` must be bytes (int) or like '5GB' / '2GiB'; "
                             f"received {max_shard_size!r}.")
        scale = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10,
                 "MIB": 2 ** 20, "GIB": 2 ** 30}[match.group(2)]
        return int(float(match.group(1)) * scale)
    return int(max_shard_size)


def write_tensors(path, tensors, extra=None, max_shard_size="5GB", verbose=False):
    """Write `tensors` (a `Tensor` table) as safetensors in `path`: `model.safetensors`, or
    shards `model-0000i-of-0000n.safetensors` and `model.safetensors.index.json` when the
    weights exceed `max_shard_size`. Each tensor is converted when it is written; `extra` maps
    further names to arrays (tied copies)."""
    items = [(t.name, t) for t in tensors] + sorted((extra or {}).items())
    entries = []  # (name, shape, dtype, source)
    for name, source in items:
        if isinstance(source, Tensor):
            dtypes = {_SAFETENSORS_NAMES.get(str(v.dtype), "F32") for v in source.variables}
            entries.append((name, source.checkpoint_shape(), dtypes.pop(), source))
        else:
            entries.append((name, tuple(source.shape), "F32", source))
    limit = _shard_size(max_shard_size)
    shards, current, size = [], [], 0
    for entry in entries:
        nbytes = _prod(entry[1]) * (4 if entry[2] == "F32" else 2)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):  # weights of an earlier export would confuse a reader
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", old):
            os.remove(os.path.join(path, old))
    names = ([SAFETENSORS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    progress = keras.utils.Progbar(len(entries), unit_name="tensor") if verbose else None
    written, weight_map = 0, {}
    for file, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, _ in shard:
            nbytes = _prod(shape) * (4 if dtype == "F32" else 2)
            header[name] = {"dtype": dtype, "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(os.path.join(path, file), "wb") as f:
            f.write(len(encoded).to_bytes(8, "little"))
            f.write(encoded)
            for name, shape, dtype, source in shard:
                if isinstance(source, Tensor):
                    arrays = [_variable_array(v) for v in source.variables]
                    array = source.save(arrays)
                else:
                    array = source
                f.write(_encode(np.asarray(array), dtype).tobytes())
                written += 1
                if progress is not None:
                    progress.update(written)
    if len(shards) > 1:
        total = sum(_prod(shape) * (4 if dtype == "F32" else 2)
                    for _, shape, dtype, _ in entries)
        with open(os.path.join(path, SAFETENSORS_INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2)


def write_json(path, name, content):
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)


def first_id(value):
    """A special id of a config: an int, None, or the first of a list (several end ids)."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _tokenizer_special_ids(path):
    """`{"bos": id, "eos": id, "pad": id}` of the special tokens that `tokenizer_config.json`
    (or `special_tokens_map.json`) names, looked up in `tokenizer.json` (plain JSON: no
    tokenizers library needed); None where a token or the files are absent."""
    names = read_json(path, "special_tokens_map.json") | read_json(path, "tokenizer_config.json")
    tokenizer = read_json(path, "tokenizer.json")
    vocab = tokenizer.get("model", {}).get("vocab")
    vocab = dict(vocab) if isinstance(vocab, dict) else {}
    vocab.update({token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])})
    found = {}
    for role in ("bos", "eos", "pad"):
        token = names.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        found[role] = vocab.get(token)
    return found


def special_ids(path, config):
    """`(bos, eos, pad)` of a checkpoint: `generation_config.json`'s where it names them
    (what transformers' `generate` uses), else `config.json`'s, else the tokenizer's special
    tokens (`tokenizer_config.json` looked up in `tokenizer.json`); a list of end ids gives
    its first."""
    generation = read_json(path, "generation_config.json")
    found = []
    tokenizer = None
    for key in ("bos", "eos", "pad"):
        value = generation.get(f"{key}_token_id")
        value = first_id(config.get(f"{key}_token_id") if value is None else value)
        if value is None:
            tokenizer = _tokenizer_special_ids(path) if tokenizer is None else tokenizer
            value = tokenizer[key]
        found.append(value)
    return tuple(found)


def refuse(what, problems):
    """A ValueError naming every option of `what` keras_tfm cannot represent."""
    if problems:
        raise ValueError(f"This {what} has options keras_tfm cannot represent: "
                         + "; ".join(problems) + ".")


def checkpoint_dtype(model):
    """The `dtype` a config names for a model's weights: its variables' float dtype."""
    dtype = str(model.weights[0].dtype) if model.weights else "float32"
    return dtype if dtype in _SAFETENSORS_NAMES else "float32"
