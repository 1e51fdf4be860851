"""The product: a trained detector as an MLflow model that `mlflow models serve` can serve, and
every way tracktron loads one back (checkpoint files, `runs:/`, `models:/name@alias`), none of
which unpickles code.

log_detector   a pyfunc model from code (detector_code.py) with the detector folder as its
               artifact, tracktron's package as its code, a signature and an input example
load_detector  a Detector from a checkpoint file, a model folder, a logged model or a registry URI
fetch_weights  TRAIN.WEIGHTS from MLflow, for a fine-tune, and the parent it names
"""
from __future__ import annotations

import errno
import shutil
import tempfile
from pathlib import Path

import yaml

from trainer.config import load_config
from trainer.errors import NoRoom, UserError, first_line, user_path
from trainer.inference import CONFIG, WEIGHTS, Detector
from trainer.tracking.model_uris import MLFLOW_URIS, download_uri, followed, parent_of, pinned
from trainer.tracking.runs import DETECTOR_TYPE

CODE = Path(__file__).with_name("detector_code.py")
PACKAGE = Path(__file__).resolve().parents[1]  # trainer/: the model carries the code that rebuilds it
ARTIFACT = "detector"


def signature(model_type: str):
    """What predict takes and returns (trainer.inference.detections_of): Mask R-CNN adds each
    detection's mask as a COCO RLE, Keypoint R-CNN its [x, y, visibility] keypoints."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, Object, Property, Schema

    inputs = Schema([ColSpec("binary", "image")])
    columns = [ColSpec(Array(Array("double")), "boxes"), ColSpec(Array("double"), "scores"),
               ColSpec(Array("long"), "category_ids"), ColSpec(Array("string"), "category_names")]
    family = model_type.split("_")[0]
    if family == "maskrcnn":
        rle = Object([Property("size", Array("long")), Property("counts", "string")])
        columns.append(ColSpec(Array(rle), "masks", required=False))
    if family == "keypointrcnn":
        columns.append(ColSpec(Array(Array(Array("double"))), "keypoints", required=False))
    return ModelSignature(inputs=inputs, outputs=Schema(columns))


def example_image() -> bytes:
    """A small PNG for the model's input example (what a request to the served model carries)."""
    import torch
    from torchvision.io import encode_png

    ramp = torch.linspace(0, 255, 64).to(torch.uint8)
    image = torch.stack([ramp.expand(48, 64), ramp.flip(0).expand(48, 64), torch.full((48, 64), 128, dtype=torch.uint8)])
    return bytes(encode_png(image).numpy())


def requirements() -> list[str]:
    from importlib.metadata import version

    pins = {"torch": "torch", "torchvision": "torchvision", "pycocotools": "pycocotools", "pyyaml": "PyYAML",
            "numpy": "numpy", "pillow": "pillow", "pandas": "pandas"}
    return [f"{name}=={version(dist).split('+')[0]}" for name, dist in pins.items()]


def log_detector(uri: str, run_id: str, folder: Path, name: str = "model", registered_model_name: str | None = None):
    """Log the detector folder as a servable pyfunc model of run `run_id`; returns MLflow's ModelInfo.

    The LoggedModel is made here, then linked to the run: logged within the run, MLflow would copy
    the run's step-0 metrics onto the model, reading the whole history of every metric for them."""
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModelOutput

    model_type = load_config(folder / CONFIG).MODEL.TYPE
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    model = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                       params=dict(run.data.params), model_type=DETECTOR_TYPE)
    try:
        info = mlflow.pyfunc.log_model(
            name=name, model_id=model.model_id, python_model=str(CODE), artifacts={ARTIFACT: str(folder)},
            code_paths=[str(PACKAGE)], signature=signature(model_type),
            input_example=pd.DataFrame({"image": [example_image()]}), pip_requirements=requirements(),
            registered_model_name=registered_model_name or None)
    except Exception as e:
        raise short_of_temp_space(e, folder) or e
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])  # the run's Logged models tab
    return info


def short_of_temp_space(e: BaseException, folder: Path) -> NoRoom | None:
    """MLflow copies a model twice through the folder for temporary files (its save, then the copy it
    uploads): a TMPDIR too small for that (a container's --tmpfs /tmp) is said as such, a NoRoom that
    is not retried, rather than MLflow's error, whose cause is on a line not shown."""
    if not _no_space(e):  # a server's error while TMPDIR happens to be small is retried as ever
        return None
    tmp = tempfile.gettempdir()
    try:
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        free = shutil.disk_usage(tmp).free
    except OSError:
        return None
    if free >= 2 * size:  # room here: the full disk is another's (a local artifact store's)
        return None
    return NoRoom(f"cannot log the model: MLflow copies it ({size / 2**20:.1f} MiB) twice through the folder for "
                  f"temporary files {tmp}, which has {free / 2**20:.1f} MiB free; set TMPDIR to a folder with room "
                  "(in a container, a larger --tmpfs /tmp or emptyDir), then run the same command again")


def _no_space(e: BaseException | None) -> bool:
    """Whether ENOSPC is anywhere in the error or its causes (MLflow words it into its own text)."""
    seen = 0
    while e is not None and seen < 10:
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def load_detector(cfg, spec: str, option: str = "--weights", device: str = "cpu") -> Detector:
    """A checkpoint file, a model folder (logged or downloaded), `runs:/<id>/...` or `models:/...`."""
    if spec.startswith(MLFLOW_URIS):
        with tempfile.TemporaryDirectory(prefix="tracktron-model-") as tmp:
            return load_local(download_uri(cfg, followed(cfg, spec, option), tmp, option, shown=spec), spec, option, device)
    path = user_path(spec, option)
    if not path.exists():
        raise UserError(f"{option} {spec}: no such file or folder (nor a runs:/ or models:/ URI)")
    return load_local(path, spec, option, device)


def load_local(path: Path, spec: str, option: str = "--weights", device: str = "cpu") -> Detector:
    """A Detector from a local file or folder; messages name `spec`, what the user gave."""
    shown = spec if spec.startswith(MLFLOW_URIS) else None  # not the temporary folder it was downloaded to
    if path.is_file():
        return Detector.from_checkpoint(path, device, shown)
    if (path / "MLmodel").is_file():
        return Detector.load(_detector_folder(path, spec, option), device, shown)
    if (path / WEIGHTS).is_file() and (path / CONFIG).is_file():
        return Detector.load(path, device, shown)
    raise UserError(f"{option} {spec}: neither a checkpoint nor a tracktron model")


def _detector_folder(model_dir: Path, spec: str, option: str) -> Path:
    try:
        flavors = yaml.safe_load((model_dir / "MLmodel").read_text()).get("flavors", {})
    except (OSError, yaml.YAMLError, AttributeError) as e:
        raise UserError(f"{option} {spec}: unreadable MLmodel ({first_line(e)})") from None
    folder = model_dir / "artifacts" / ARTIFACT
    if not (folder / WEIGHTS).is_file():
        if folder.is_dir():  # tracktron's folder, its weights gone
            raise UserError(f"{option} {spec}: a tracktron model without its {WEIGHTS} (deleted from its artifact store?)")
        kind = "a pickled PyTorch model" if "pytorch" in flavors else "not a tracktron model"
        raise UserError(f"{option} {spec}: {kind}; tracktron loads only models it logged as weights "
                        "(unpickling would run code from the file)")
    return folder


def fetch_weights(cfg, spec: str, dest: Path) -> tuple[Path, dict]:
    """TRAIN.WEIGHTS from MLflow (`runs:/<id>/checkpoints/<file>`, `runs:/<id>/model`, `models:/...`):
    the weights file, downloaded into `dest`, and what the new run records of its parent."""
    source = pinned(cfg, spec)  # the version an alias names now: the one downloaded and recorded
    path = download_uri(cfg, source, str(dest), "TRAIN.WEIGHTS", shown=spec)
    if path.is_dir():
        folder = _detector_folder(path, spec, "TRAIN.WEIGHTS") if (path / "MLmodel").is_file() else path
        path = folder / WEIGHTS
        if not path.is_file():
            raise UserError(f"TRAIN.WEIGHTS {spec}: neither a checkpoint nor a tracktron model")
    return path, parent_of(cfg, source) | {"weights": spec}
