"""The code MLflow runs to load a logged tracktron model ("models from code": nothing is unpickled).

`mlflow.pyfunc.load_model` and `mlflow models serve` execute this file; the weights come from the
model's `detector` artifact (weights.pt, a state dict read with weights_only=True, config.yaml,
categories.json), rebuilt with tracktron's own builder.
"""
from __future__ import annotations

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
import pandas as pd
import torch

from trainer.inference import Detector


class DetectorModel(mlflow.pyfunc.PythonModel):
    """predict: a DataFrame whose `image` column holds encoded images (bytes; base64 in a served
    request) or HxWx3 uint8 arrays -> one dict of detections per image."""

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
        results = []
        for i, image in enumerate(images):  # a bad image: a 400 that says which and why, no traceback
            try:
                results.extend(self.detector.predict([image]))
            except ValueError as e:
                raise MlflowException(f"image {i}: {e}", error_code=INVALID_PARAMETER_VALUE) from None
        return results


mlflow.models.set_model(DetectorModel())
