"""Safetensors checkpoints read tensor by tensor into our stacked params tree (numpy, on the host).

`fill_params` preallocates the tree in the config's dtype and copies each tensor into its place as it
is read, so the host holds the model once plus a tensor in flight, never a second whole copy. Names
and shapes are checked before any data is read; a missing, unexpected or misshapen tensor raises
WeightsError naming the file, the tensor and both shapes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import Callable

import jax
import numpy as np
import safetensors

from orca_jax.config import ModelConfig
from orca_jax.models.fp8_checkpoint import Fp8Scheme
from orca_jax.models.weights import Params, WeightsError, check_params, expected_shapes

# One tensor of the file -> the places in our tree it fills ('{i}' in the name: one per layer):
# file name -> (shape in the file, ((path in our tree, converter to our layout), ...)).
Layouts = dict[str, tuple[tuple[int, ...], tuple[tuple[tuple[str, ...], Callable], ...]]]


# Safetensors dtype names -> numpy dtypes (ml_dtypes' bfloat16, which numpy lacks, comes with jax).
_DTYPES = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
           "BF16": np.dtype(jax.numpy.bfloat16), "F8_E4M3": np.dtype(jax.numpy.float8_e4m3fn)}


# The largest header read: safetensors' own bound (its MAX_HEADER_SIZE). A caller reading files from
# less trusted places (LoRA adapters) passes a smaller one.
MAX_HEADER_BYTES = 100_000_000


class SafetensorsFile:
    """One .safetensors file: its header checked by the safetensors library, data read on demand.

    The header is validated by `safetensors.safe_open` (JSON within a nesting limit, known dtypes,
    integer shapes whose sizes match their byte ranges without overflow, ranges that tile the data
    and end with the file) before we parse it ourselves for the offsets. Data is read with plain
    file reads rather than through safe_open's tensors: those map the file and go through jax
    buffers for bf16, which left the host at twice the model's size at peak; a read into a fresh
    array holds one tensor at a time. Errors name the file and the rule it breaks, never its
    contents (a path may point at any readable file).
    """

    def __init__(self, path: str, max_header_bytes: int = MAX_HEADER_BYTES):
        if not os.path.isfile(path):
            raise WeightsError(f"{path}: no such file")
        self.path = path
        size = os.path.getsize(path)
        corrupt = WeightsError(f"{path}: cannot read safetensors, truncated or corrupt (the format: an 8-byte "
                               f"header length, a JSON header of at most {max_header_bytes} bytes naming each "
                               "tensor's dtype, shape and byte range, then the tensors' bytes)")
        try:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > min(size - 8, max_header_bytes):
                    raise corrupt
                with safetensors.safe_open(path, "numpy"):  # validates the header against the file
                    pass
                header = json.loads(f.read(header_len))
        except (struct.error, OSError, ValueError, safetensors.SafetensorError):
            raise corrupt from None
        header.pop("__metadata__", None)
        self.entries = {name: (info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"]))
                        for name, info in header.items()}
        self.data_start = 8 + header_len

    def read(self, name: str) -> np.ndarray:
        dtype_name, shape, (begin, end) = self.entries[name]
        if dtype_name not in _DTYPES:
            raise WeightsError(f"{self.path}: tensor {name} has dtype {dtype_name}, "
                               f"not one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype_name]
        count = math.prod(shape)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            return np.fromfile(f, dtype=dtype, count=count).reshape(shape)


class SafetensorsDirectory:
    """The tensors of model.safetensors or of a sharded index, read one at a time.

    `strip` is a prefix some files put on every name (GPT-2's 'transformer.'); names are looked up
    without it.
    """

    def __init__(self, directory: str, strip: str = ""):
        single = os.path.join(directory, "model.safetensors")
        index = os.path.join(directory, "model.safetensors.index.json")
        self.source = index if os.path.isfile(index) else single
        self._files: dict[str, SafetensorsFile] = {}
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise WeightsError(f"{index}: not a safetensors index ({err!r})") from err
            stored = {name: os.path.join(directory, file) for name, file in weight_map.items()}
        else:
            stored = {name: single for name in self._open(single).entries}
        self._stored_name = {name.removeprefix(strip): name for name in stored}
        self.files = {name.removeprefix(strip): file for name, file in stored.items()}  # name -> file

    def _open(self, path: str) -> SafetensorsFile:
        if path not in self._files:
            if not os.path.isfile(path):
                raise WeightsError(f"{path}: no such file (listed in {self.source})")
            self._files[path] = SafetensorsFile(path)
        return self._files[path]

    def dtype_name(self, name: str) -> str | None:
        """The safetensors dtype ("BF16", "F8_E4M3", ...) of tensor `name`; None if it is not stored."""
        if name not in self.files:
            return None
        entry = self._open(self.files[name]).entries.get(self._stored_name[name])
        return None if entry is None else entry[0]

    def read_fp8_values(self, name: str, shape: tuple[int, ...], scheme: Fp8Scheme) -> np.ndarray:
        """An FP8 checkpoint's weight `name` as its values (f32: stored e4m3 times its scales); any
        other tensor as read()."""
        if self.dtype_name(name) != "F8_E4M3":
            return self.read(name, shape)
        weight = self.read(name, shape)
        scale_name = name.removesuffix("weight") + scheme.scale_suffix
        if scale_name not in self.files:
            raise WeightsError(f"{self.source}: FP8 weight {name} has no {scale_name}")
        scale = self._open(self.files[scale_name]).read(self._stored_name[scale_name])
        return scheme.values(weight, scale, name)

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as a numpy array, after checking that it has `shape`."""
        if name not in self.files:
            raise WeightsError(f"{self.source}: missing tensor {name} (expected shape {shape})")
        path, stored = self.files[name], self._stored_name[name]
        file = self._open(path)
        if stored not in file.entries:
            raise WeightsError(f"{path}: missing tensor {stored} (expected shape {shape}; "
                               f"{os.path.basename(self.source)} says it is here)")
        found = file.entries[stored][1]
        if found != shape:
            raise WeightsError(f"{path}: tensor {stored} has shape {found}, config.json implies {shape}")
        return file.read(stored)


def fill_params(directory: str, config: ModelConfig, layouts: Layouts, ignored: re.Pattern,
                strip: str = "", fp8: Fp8Scheme | None = None) -> Params:
    """Our params tree (numpy, config.dtype, layers stacked on a leading [L] axis) from the directory.

    Tensors matching `ignored` (buffers some checkpoints carry) are skipped; any other tensor the
    layouts do not name is an error, as is any they name that is missing. `fp8`: the checkpoint's FP8
    scheme; its e4m3 weights are read as their values (fp8_checkpoint.py).
    """
    dtype = np.dtype(jax.numpy.dtype(config.dtype))
    params = jax.tree_util.tree_map(lambda s: np.empty(s, dtype), expected_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    tensors = SafetensorsDirectory(directory, strip)
    wanted = {name.format(i=i) for name in layouts for i in range(config.num_layers)}
    unexpected = sorted(name for name in tensors.files if name not in wanted and not ignored.fullmatch(name))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise WeightsError(f"{tensors.files[unexpected[0]]}: unexpected tensor {unexpected[0]} for a "
                           f"{config.num_layers}-layer {'tied' if config.tie_embeddings else 'untied'} "
                           f"model{more}")
    for template, (shape, targets) in layouts.items():
        per_layer = "{i}" in template
        for i in range(config.num_layers if per_layer else 1):
            name = template.format(i=i)
            tensor = tensors.read(name, shape) if fp8 is None else tensors.read_fp8_values(name, shape, fp8)
            for where, convert in targets:
                holder = params
                for key in where[:-1]:
                    holder = holder[key]
                if per_layer:
                    holder[where[-1]][i] = convert(tensor)
                else:
                    holder[where[-1]][...] = convert(tensor)
    check_params(params, config, tensors.source)
    return params
