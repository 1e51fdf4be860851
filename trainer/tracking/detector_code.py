"""The code MLflow runs to load a logged tracktron model ("models from code": nothing is unpickled).

`mlflow.pyfunc.load_model` and `mlflow models serve` execute this file; the weights come from the
model's `detector` artifact (weights.pt, a state dict read with weights_only=True, config.yaml,
categories.json), rebuilt with tracktron's own builder.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import time

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, REQUEST_LIMIT_EXCEEDED
import pandas as pd
import torch

from trainer.inference import Detector


_MAGIC = (b"\x89PNG", b"\xff\xd8", b"GIF8", b"RIFF")  # PNG, JPEG, GIF, WebP: GIF's header is ASCII
# `mlflow models serve` puts its request timeout (-t, default 60 s) in the server's environment. Past
# it the client has had its 504 while the request's thread would infer on: a request of thousands of
# images held the worker's CPU for minutes. Loaded in Python (pyfunc.load_model) there is no timeout.
_TIMEOUT = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"
log = logging.getLogger(__name__)


def image_bytes(image):
    """The encoded image a value holds. MLflow base64-decodes the binary column of dataframe_split
    and dataframe_records requests, but hands instances and inputs over as the base64 text itself
    (as str or bytes): ASCII that is no image's header is that text (strict base64, line breaks allowed)."""
    if isinstance(image, str):
        image = image.encode("ascii", errors="replace")
    if not isinstance(image, bytes) or image.startswith(_MAGIC) or not image.isascii():  # an array, an image
        return image
    try:
        return base64.b64decode(re.sub(rb"\s", b"", image), validate=True)
    except binascii.Error:
        raise ValueError(f"{len(image)} bytes of text that are not base64: an image must be its encoded bytes "
                         "(PNG, JPEG, ...), base64-encoded in a JSON request") from None


class DetectorModel(mlflow.pyfunc.PythonModel):
    """predict: a DataFrame whose `image` column holds encoded images (bytes, or their base64 text
    as served requests carry them) or HxWx3 uint8 arrays -> one dict of detections per image."""

    def load_context(self, context):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.detector = Detector.load(context.artifacts["detector"], device=device)

    # The DataFrame hint tells MLflow not to infer a schema from hints: the model's signature says it.
    def predict(self, context, model_input: pd.DataFrame, params=None):
        if isinstance(model_input, pd.DataFrame):
            if "image" not in model_input.columns:
                raise ValueError(f"expected a column 'image', got {list(model_input.columns)}")
            images = model_input["image"].tolist()
        else:
            images = list(model_input)
        results, deadline = [], _deadline()
        for i, image in enumerate(images):  # a bad image: a 400 that says which and why, no traceback
            if deadline and time.monotonic() > deadline:
                message = (f"stopped at image {i} of {len(images)}: past the server's request timeout "
                           f"({os.environ[_TIMEOUT]} s); send fewer images per request")
                log.warning(message)
                raise MlflowException(message, error_code=REQUEST_LIMIT_EXCEEDED)
            try:
                results.extend(self.detector.predict([image_bytes(image)]))
            except ValueError as e:
                raise MlflowException(f"image {i}: {e}", error_code=INVALID_PARAMETER_VALUE) from None
        return results


def _deadline() -> float | None:
    try:
        return time.monotonic() + float(os.environ[_TIMEOUT])
    except (KeyError, ValueError):
        return None


mlflow.models.set_model(DetectorModel())
