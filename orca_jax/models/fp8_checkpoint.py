"""FP8 checkpoints in Hugging Face directories: which schemes we read, and their weights' values.

Two published formats (config.json's "quantization_config"):
- compressed-tensors "float-quantized" (llm-compressor's FP8 and FP8-dynamic): e4m3 `*.weight` with
  `*.weight_scale` per tensor ([1] or []) or per output channel ([out, 1]); static activation scales
  (`*.input_scale`) or dynamic ones. weight = stored * scale.
- Hugging Face's "fp8" (`quant_method: "fp8"`, as DeepSeek and Qwen publish): e4m3 `*.weight` with
  `*.weight_scale_inv` per block of `weight_block_size` (128 x 128): weight = stored * scale_inv of its
  block.
We read each projection's values (stored times its scale, in f32), and the runner stores them again as
e4m3 with one scale per output channel (models/fp8.py): a per-channel checkpoint comes back to the
same e4m3 values and scales, a per-tensor or block-wise one to per-channel scales of the same values
(rounded once more, on a grid at least as fine for per-tensor ones). Activations are always quantized
per row at run time, so static activation scales, like KV scales, are read past. Anything else (int8,
int4, e5m2, asymmetric or grouped schemes) is refused with the field that says so.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from orca_jax.models.weights import WeightsError

# Tensors a supported FP8 checkpoint carries beside the weights, read past (or consumed with them).
SCALE_TENSORS = r".*\.(weight_scale|weight_scale_inv|input_scale|output_scale|k_scale|v_scale|kv_scale)"


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How one checkpoint stores its FP8 weights."""

    scale_suffix: str  # "weight_scale" or "weight_scale_inv"
    block: tuple[int, int] | None  # (out, in) block of one scale; None: per tensor or per channel

    def values(self, weight: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
        """f32 [out, in]: `weight` (e4m3 [out, in]) times its scales."""
        w = weight.astype(np.float32)
        s = np.asarray(scale, np.float32)
        out, inp = w.shape
        if self.block is None:
            if s.size == 1:
                return w * s.reshape(())
            if s.size == out:
                return w * s.reshape(out, 1)
            raise WeightsError(f"{name}: {self.scale_suffix} of shape {s.shape} fits neither a per-tensor nor a "
                               f"per-channel scale of a [{out}, {inp}] weight")
        bo, bi = self.block
        want = (-(-out // bo), -(-inp // bi))
        if s.shape != want:
            raise WeightsError(f"{name}: {self.scale_suffix} has shape {s.shape}; blocks of {bo}x{bi} over a "
                               f"[{out}, {inp}] weight need {want}")
        full = np.repeat(np.repeat(s, bo, axis=0), bi, axis=1)[:out, :inp]
        return w * full


def scheme_from_config(hf: dict, path: str) -> Fp8Scheme | None:
    """The FP8 scheme config.json declares, None for an unquantized checkpoint; WeightsError for a
    quantization we do not read."""
    quant = hf.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise WeightsError(f"{path}: quantization_config must be an object")
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise WeightsError(f"{path}: quantization_config.fmt {quant['fmt']!r} is not supported (e4m3 only)")
        block = quant.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2
                                  or not all(isinstance(b, int) and b > 0 for b in block)):
            raise WeightsError(f"{path}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
        return Fp8Scheme("weight_scale_inv", None if block is None else (block[0], block[1]))
    if method == "compressed-tensors":
        return _compressed_tensors(quant, path)
    raise WeightsError(f"{path}: quantization_config.quant_method {method!r} is not supported "
                       "(FP8 checkpoints: 'fp8', 'compressed-tensors' float-quantized)")


def _compressed_tensors(quant: dict, path: str) -> Fp8Scheme:
    if quant.get("format") not in ("float-quantized", "naive-quantized"):
        raise WeightsError(f"{path}: compressed-tensors format {quant.get('format')!r} is not supported "
                           "(FP8 'float-quantized' only)")
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise WeightsError(f"{path}: compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        where = f"{path}: quantization_config.config_groups.{name}.weights"
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise WeightsError(f"{where}: {weights.get('num_bits')}-bit {weights.get('type')!r} weights are not "
                               "supported (8-bit float only)")
        if weights.get("strategy") not in ("tensor", "channel"):
            raise WeightsError(f"{where}.strategy {weights.get('strategy')!r} is not supported (tensor or channel)")
        if weights.get("symmetric") is False:
            raise WeightsError(f"{where}: asymmetric weights are not supported")
        activations = (group or {}).get("input_activations")
        if activations and (activations.get("type") != "float" or activations.get("num_bits") != 8):
            raise WeightsError(f"{path}: quantization_config.config_groups.{name}.input_activations must be "
                               "8-bit float (or absent)")
    return Fp8Scheme("weight_scale", None)


def ignored_in_fp8(ignored: re.Pattern) -> re.Pattern:
    """The loader's ignored-tensor pattern, widened by the scale tensors an FP8 checkpoint carries."""
    return re.compile(f"{ignored.pattern}|{SCALE_TENSORS}")
