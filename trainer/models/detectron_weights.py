"""Detectron's .pkl weights (Caffe2 blobs in a pickle) as a state dict of the model tracktron builds.

Both kinds of file: ImageNet backbones (a plain dict of blobs: `conv1_w`, `res_conv1_bn_s`,
`res2_0_branch2a_w`, ...) and the model zoo's end-to-end models (`{'blobs': {...}, 'cfg': ...}` with FPN,
RPN, box, mask and keypoint heads, or RetinaNet's). A pickle can run code when it is loaded, so these
are read by an unpickler that builds numpy arrays, dicts, lists, strings and numbers and nothing else.

Conversions (docs/DETECTRON.md): affine BatchNorm `_bn_s`/`_bn_b` become a FrozenBatchNorm2d with mean 0
and variance 1 - eps (exactly Detectron's scale and shift); conv1's input channels go from Detectron's
BGR to RGB (the config's PIXEL_MEAN is RGB too); RetinaNet's 80 sigmoid classes gain torchvision's unused
background class 0 and its 9 anchors per location are reordered from Detectron's octave-major to
torchvision's ratio-major order.
"""
from __future__ import annotations

import functools
import math
import pickle
import re
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trainer.errors import UserError

_EPS = 1e-5  # FrozenBatchNorm2d's: variance 1 - eps makes its scale exactly Detectron's
_NEVER = -20.0  # the bias of RetinaNet's background logit, which Detectron does not have


class _Parts:
    """What the unpickler builds for numpy's names: their arguments and state kept as plain data. numpy's own
    __setstate__ trusts what it is given (a malformed dtype state crashes the process), so it never sees the
    file: arrays are made afterwards by np.frombuffer, from bytes and a plain number type."""

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state):
        self.state = state


class _Array(_Parts):
    pass


class _DType(_Parts):
    pass


def _latin1(text, encoding="latin1"):  # protocol 2's way to pickle bytes: _codecs.encode(str, 'latin1')
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode to {encoding!r} is not a numpy array part")
    return text.encode("latin1")


def _frombuffer(buffer, dtype, shape, order):  # protocol 5's way to pickle a contiguous array
    if order not in ("C", "F") or not isinstance(buffer, (bytes, bytearray)):
        raise pickle.UnpicklingError("an array of protocol 5 without its bytes in the file")
    parts = _Array()
    parts.state = (1, shape, dtype, order == "F", bytes(buffer))
    return parts


_ALLOWED = {  # what a pickle of numpy arrays needs, under numpy 1 and 2 module names, protocols 2 to 5
    ("numpy.core.multiarray", "_reconstruct"): _Array, ("numpy._core.multiarray", "_reconstruct"): _Array,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer, ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): _Parts, ("numpy", "dtype"): _DType, ("_codecs", "encode"): _latin1,
    ("collections", "OrderedDict"): dict,
}
_NUMBER = re.compile(r"[fiub]\d{1,2}")  # float, int, uint, bool dtypes ('f4', 'i8', 'b1')


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a numpy array part")
        return _ALLOWED[module, name]


def _array(parts: _Array) -> np.ndarray:
    """ndarray.__reduce__'s state (version, shape, dtype, fortran order, raw bytes) as an array."""
    state = parts.state
    if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], _DType)):
        raise pickle.UnpicklingError("an array without a plain state")
    _, shape, dtype, fortran, data = state
    spec, order = dtype.args[0] if dtype.args else None, (dtype.state or (None, "|"))[1]
    if not (isinstance(spec, str) and _NUMBER.fullmatch(spec) and order in ("<", ">", "|", "=")):
        raise pickle.UnpicklingError(f"numpy dtype {spec!r} is not a plain number type")
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        raise pickle.UnpicklingError(f"an array shape {shape!r}")
    data = data.encode("latin1") if isinstance(data, str) else data  # Python 2's str
    dt = np.dtype(spec).newbyteorder(order if order in "<>" else "=")
    array = np.frombuffer(data, dt, count=math.prod(shape)) if isinstance(data, bytes) else None
    if array is None:
        raise pickle.UnpicklingError("array data that is not bytes")
    return array.reshape(shape, order="F" if fortran else "C").copy()


def read_blobs(path: Path, shown: str, option: str) -> dict[str, np.ndarray]:
    """The float blobs of a Detectron .pkl (Python 2 pickles: latin-1 strings)."""
    try:
        with open(path, "rb") as f:
            obj = _ArraysOnly(f, encoding="latin1").load()
        blobs = obj.get("blobs", obj) if isinstance(obj, dict) else None
        if not isinstance(blobs, dict):
            raise UserError(f"{option} {shown} holds no Detectron blobs (a dict of arrays, or {{'blobs': ...}})")
        array = functools.cache(_array)  # the pickle's memo can name one array under many keys: copy it once
        arrays = {k: array(v) for k, v in blobs.items() if isinstance(k, str) and isinstance(v, _Array)
                  and not k.endswith("_momentum")}
    except UserError:
        raise
    except Exception as e:  # malformed bytes fail in many ways; none of them runs code here
        why = " ".join(str(e).split())  # pickle's own message for a persistent id runs over two lines
        raise UserError(f"{option} {shown} is not a Detectron weights file tracktron loads ({why}); only numpy "
                        "arrays in dicts are read, so a pickle that holds anything else is refused") from None
    arrays = {k: v for k, v in arrays.items() if v.dtype.kind == "f"}
    if not arrays:
        raise UserError(f"{option} {shown} holds no float arrays")
    distinct = {id(v): k for k, v in arrays.items()}.values()  # each array once, however many keys name it
    broken = next((k for k in distinct if not np.isfinite(arrays[k]).all()), None)
    if broken is not None:  # training would stop at its first loss, after its run was made
        raise UserError(f"{option} {shown}: blob {broken} holds NaN or infinite values")
    return arrays


def convert(blobs: dict[str, np.ndarray], model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors that have a blob, under the model's names (shapes are checked by the caller)."""
    values = {key: _value(key, like, blobs, model) for key, like in model.state_dict().items()}
    return {key: value for key, value in values.items() if value is not None}


def _value(key: str, like: torch.Tensor, blobs: dict, model: nn.Module):
    name, field = detectron_name(key, model)
    if name is None or field not in ("weight", "bias", "running_mean", "running_var"):
        return None
    if field in ("running_mean", "running_var"):  # affine channels have no statistics: scale and shift only
        if f"{name}_s" not in blobs:
            return None
        return torch.zeros_like(like) if field == "running_mean" else torch.full_like(like, 1 - _EPS)
    suffix = {"weight": "_w", "bias": "_b"}[field]
    if name.endswith(("_bn", "_gn")):  # an affine channel or a GroupNorm: scale and bias
        suffix = {"weight": "_s", "bias": "_b"}[field]
    blob = blobs.get(name + suffix)
    if blob is None:
        return None
    value = torch.from_numpy(np.ascontiguousarray(blob, dtype=np.float32))
    if key.endswith("body.conv1.weight") and value.ndim == 4 and value.shape[1] == 3:
        value = value.flip(1)  # Detectron's input is BGR, ours RGB
    if key.startswith("head.") and key.rsplit(".", 2)[-2] in ("cls_logits", "bbox_reg"):
        value = _retinanet_output(value, key, model)
    return value


def _retinanet_output(value: torch.Tensor, key: str, model: nn.Module) -> torch.Tensor:
    """Detectron: channel (anchor, class) with anchors octave-major and 80 classes; torchvision: anchors
    ratio-major and 81 classes, class 0 never predicted."""
    ratios = len(model.anchor_generator.aspect_ratios[0])
    octaves = len(model.anchor_generator.sizes[0])
    anchors = ratios * octaves
    if value.ndim not in (1, 4) or value.shape[0] % anchors:
        return value  # not Detectron's layout for this model: the shape check skips it
    per_anchor = value.shape[0] // anchors
    grouped = value.reshape(anchors, per_anchor, *value.shape[1:])
    order = [octave * ratios + ratio for ratio in range(ratios) for octave in range(octaves)]
    grouped = grouped[order]
    if "cls_logits" in key:
        background = torch.full_like(grouped[:, :1], _NEVER if value.ndim == 1 else 0.0)
        grouped = torch.cat([background, grouped], dim=1)
    return grouped.reshape(-1, *value.shape[1:])


# ------------------------------------------------------------------------------------- names

_BRANCH = {1: "2a", 2: "2b", 3: "2c"}


def detectron_name(key: str, model: nn.Module) -> tuple[str | None, str]:
    """(Detectron's blob name without its _w/_b/_s suffix, the tensor's field) for one of our keys."""
    path, field = key.rsplit(".", 1)
    for rule in (_body, _fpn, _rpn, _box, _mask, _keypoint, _retinanet):
        name = rule(path, model)
        if name is not None:
            return name, field
    return None, field


def _stage(rest: str, stage: int) -> str | None:
    """A block of res{stage}, named from within its stage: `{block}.conv{n}` / `.bn{n}` / `0.downsample.{0,1}`."""
    found = re.fullmatch(r"(\d+)\.(conv|bn)(\d)", rest)
    if found:
        block, kind, n = found.groups()
        base = f"res{stage}_{block}_branch{_BRANCH[int(n)]}"
        return base if kind == "conv" else base + "_bn"
    found = re.fullmatch(r"0\.downsample\.([01])", rest)
    return f"res{stage}_0_branch1" + ("" if found.group(1) == "0" else "_bn") if found else None


def _body(path: str, model: nn.Module) -> str | None:
    if path in ("backbone.body.conv1", "backbone.body.bn1"):
        name = "conv1" if path.endswith("conv1") else "res_conv1_bn"
    else:
        found = re.fullmatch(r"backbone\.body\.layer(\d)\.(.+)", path)
        name = _stage(found.group(2), int(found.group(1)) + 1) if found else None
    if name is not None and isinstance(model.get_submodule(path), nn.GroupNorm):
        name = "conv1_gn" if name == "res_conv1_bn" else name.replace("_bn", "_gn")
    return name


def _fpn(path: str, model: nn.Module) -> str | None:
    found = re.fullmatch(r"backbone\.fpn\.(inner_blocks|layer_blocks)\.(\d)\.([01])", path)
    if found:
        kind, index, part = found.group(1), int(found.group(2)), found.group(3)
        layers = list(model.backbone.body.return_layers)  # layer1..layer4, or layer2..layer4
        layer = layers[index]
        if not layer.startswith("layer"):  # a MobileNet's blocks ('13', '16'): Detectron's FPNs are on ResNets
            return None
        stage = int(layer[-1]) + 1
        last = len(getattr(model.backbone.body, layer)) - 1
        base = f"fpn_inner_res{stage}_{last}_sum" if kind == "inner_blocks" else f"fpn_res{stage}_{last}_sum"
        if kind == "inner_blocks" and index < len(layers) - 1:
            base += "_lateral"  # every lateral but the coarsest (C5)
        return base if part == "0" else base + "_gn"
    found = re.fullmatch(r"backbone\.fpn\.extra_blocks\.p([67])", path)
    return f"fpn_{found.group(1)}" if found else None


def _rpn(path: str, model: nn.Module) -> str | None:
    level = "_fpn2" if hasattr(model.backbone, "fpn") else ""  # FPN: one head shared by the levels, named at P2
    names = {"rpn.head.conv.0.0": "conv_rpn", "rpn.head.cls_logits": "rpn_cls_logits",
             "rpn.head.bbox_pred": "rpn_bbox_pred"}
    return names[path] + level if path in names else None


def _box(path: str, model: nn.Module) -> str | None:
    names = {"roi_heads.box_head.fc6": "fc6", "roi_heads.box_head.fc7": "fc7",
             "roi_heads.box_predictor.cls_score": "cls_score", "roi_heads.box_predictor.bbox_pred": "bbox_pred"}
    if path in names:
        return names[path]
    if path.startswith("roi_heads.box_head.res5."):  # C4: res5 is the box head
        return _res5(path, "roi_heads.box_head.res5.")
    found = re.fullmatch(r"roi_heads\.box_head\.(\d)(?:\.([01]))?", path)  # 4conv1fc: 4 conv(+GN) blocks, flatten, fc
    if found:
        index, part = int(found.group(1)), found.group(2)
        if part is None:
            return "fc6"
        return f"head_conv{index + 1}" + ("_gn" if part == "1" else "")
    return None


def _res5(path: str, prefix: str) -> str | None:
    return _stage(path[len(prefix):], 5) if path.startswith(prefix) else None


def _mask(path: str, model: nn.Module) -> str | None:
    if not path.startswith("roi_heads.mask_"):
        return None
    if re.fullmatch(r"roi_heads\.mask_head\.\d\.(conv|bn)\d|roi_heads\.mask_head\.0\.downsample\.[01]", path):
        return _res5(path, "roi_heads.mask_head.")  # C4: the box head's res5, shared
    found = re.fullmatch(r"roi_heads\.mask_head\.(\d)\.([01])", path)
    if found:
        index, part = int(found.group(1)) + 1, found.group(2)
        if any(isinstance(m, nn.GroupNorm) for m in model.roi_heads.mask_head[index - 1]):
            return f"_mask_fcn{index}" + ("_gn" if part == "1" else "")
        return f"_[mask]_fcn{index}"
    found = re.fullmatch(r"roi_heads\.mask_predictor\.(?:predictor\.)?(conv5_mask|mask_fcn_logits)", path)
    return found.group(1) if found else None


def _keypoint(path: str, model: nn.Module) -> str | None:
    found = re.fullmatch(r"roi_heads\.keypoint_head\.(\d+)", path)
    if found:
        return f"conv_fcn{int(found.group(1)) // 2 + 1}"  # conv, relu, conv, relu...
    return "kps_score_lowres" if path == "roi_heads.keypoint_predictor.kps_score_lowres" else None


def _retinanet(path: str, model: nn.Module) -> str | None:
    found = re.fullmatch(r"head\.(classification|regression)_head\.(conv\.(\d)\.0|cls_logits|bbox_reg)", path)
    if not found:
        return None
    tower = "cls" if found.group(1) == "classification" else "bbox"
    if found.group(3) is not None:
        return f"retnet_{tower}_conv_n{found.group(3)}_fpn3"
    return f"retnet_{tower}_pred_fpn3"
