"""COCO evaluation: inference to COCO results json, pycocotools metrics, tracking, `tracktron eval`.

Metrics are COCOeval's stats (0..1): `bbox/AP`, `bbox/AP50`, ..., `segm/...`, `keypoints/...`; one
COCOeval leaves undefined (-1) is dropped, not logged as a score. With several TEST.DATASETS the
first keeps the plain names, the others are prefixed: `<dataset>/bbox/AP`.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import itertools
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from trainer import torch_load
from trainer.atomic_write import write_atomic
from trainer.checkpoint.state import capture_rng, restore_rng
from trainer.data import CocoDetection, build_test_loader, model_needs, resolve_dataset
from trainer.data.checks import category_difference, same_categories
from trainer.data.images import as_float
from trainer.data.workers import worker_error
from trainer.distributed import Context, all_gather_object, broadcast_object, check_same_job, gather_object
from trainer.config import flatten
from trainer.config_checks import dataset_dirname
from trainer.errors import SharedError, UserError, user_path
from trainer.job_identity import job_keys
from trainer.lineage import dataset_inputs
from trainer.logs import held_while_checking, write_or_drop
from trainer.output_dir import make_writable
from trainer.inference import categories_of, category_key_of, check_weights_given, checked_categories, detections_to_coco
from trainer.models import build_model, load_weights, set_test_size, unwrap
from trainer.tracking import Tracker, attach, record_evaluation  # record_evaluation: `mlflow run -e eval`'s own run
from trainer.tracking.logged_model import load_detector, load_local
from trainer.tracking.model_uris import MLFLOW_URIS, download_uri, followed
from trainer.tracking.runs import run_checkpoint
from trainer.visualize import drawings

log = logging.getLogger(__name__)

_BOX_STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl")  # COCOeval.stats[:6]; the rest are ARs
STAT_NAMES = {"bbox": _BOX_STATS, "segm": _BOX_STATS, "keypoints": ("AP", "AP50", "AP75", "APm", "APl")}
# Which field a result needs to count for an iou type.
_RESULT_FIELD = {"bbox": "bbox", "segm": "segmentation", "keypoints": "keypoints"}
# COCOeval's default sigmas are the 17 COCO person keypoints; other skeletons get their mean for
# every point (as hard to place as an average COCO keypoint).
_COCO_SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87,
                         .89, .89]) / 10.0


def iou_types_for(model_type: str) -> list[str]:
    family = model_type.split("_")[0]
    return ["bbox"] + (["segm"] if family == "maskrcnn" else []) + (["keypoints"] if family == "keypointrcnn" else [])


# ---------------------------------------------------------------------------------------- inference

@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """Eval mode for a while; train mode, input size and RNG states come back exactly as they were,
    so an evaluation in the middle of training changes nothing the training sees."""
    net = unwrap(model)
    transform = getattr(net, "transform", None)
    sizes = (transform.min_size, transform.max_size) if transform is not None else None
    was_training, rng = net.training, capture_rng()
    net.eval()
    try:
        yield net
    finally:
        net.train(was_training)
        if sizes is not None:
            transform.min_size, transform.max_size = sizes
        restore_rng(rng)


def run_inference(model, loader, dataset, device, ctx: Context | None = None) -> list[dict]:
    """COCO results of the loader's images (this rank's shard); all ranks' on rank 0, [] elsewhere."""
    results, error = [], None
    with _eval_mode(model) as net, torch.inference_mode():
        try:
            for images, targets in loader:
                outputs = _infer(net, images, device)
                ids = [t["image_id"] for t in targets]
                results.extend(detections_to_coco(outputs, ids, dataset.label_to_cat_id))
        except UserError as e:  # an image a loader worker could not read: its one line
            error = str(worker_error(e))
    if ctx is not None and ctx.distributed:  # every rank stops with that line, none waits for the one that did
        if error := next(filter(None, all_gather_object(ctx, error)), None):
            raise SharedError(error)
    if error:
        raise UserError(error)
    if ctx is None or not ctx.distributed:
        return results
    return [r for part in gather_object(ctx, results) for r in part]  # shards are disjoint


def _infer(net, images: list, device) -> list[dict]:
    """The network's outputs, in order, for runs of images of one size: torchvision pads a batch to its
    largest image, which would change a smaller one's detections from what the served model finds."""
    outputs = []
    for _, run in itertools.groupby(images, key=lambda im: tuple(im.shape)):
        outputs += net([as_float(im.to(device, non_blocking=True)) for im in run])  # uint8 from the workers
    return outputs


# ------------------------------------------------------------------------------------------ metrics

def load_results(coco_gt: COCO, results: list[dict], iou_type: str) -> COCO:
    """The results as a COCO object; an empty one when there are none (COCO.loadRes rejects [])."""
    field = _RESULT_FIELD[iou_type]
    # Copies: loadRes writes area/id into the dicts. For segm drop the box, or loadRes would take
    # the box's area as the mask's and misfile it among small/medium/large (as detectron2 does).
    dets = [{k: v for k, v in r.items() if not (iou_type == "segm" and k == "bbox")}
            for r in results if field in r]
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        if dets:
            return coco_gt.loadRes(dets)
        empty = COCO()  # no detection: every defined stat is 0, the undefined ones stay undefined
        empty.dataset = {"images": coco_gt.dataset["images"], "annotations": [],
                         "categories": coco_gt.dataset["categories"]}
        empty.createIndex()
        return empty


def run_cocoeval(coco_gt: COCO, results: list[dict], iou_type: str, sigmas=None) -> COCOeval:
    """COCOeval evaluated, accumulated and summarised; its printed summary goes to the log."""
    coco_dt = load_results(coco_gt, results, iou_type)
    ev = COCOeval(coco_gt, coco_dt, iou_type)
    if iou_type == "keypoints":
        ev.params.kpt_oks_sigmas = sigmas if sigmas is not None else _oks_sigmas(coco_gt)
    with contextlib.redirect_stdout(text := io.StringIO()):
        ev.evaluate(), ev.accumulate(), ev.summarize()
    summary = [line for line in text.getvalue().splitlines() if line.lstrip().startswith("Average")]
    log.info("COCOeval %s:\n%s", iou_type, "\n".join(summary))
    return ev


def _oks_sigmas(coco_gt: COCO) -> np.ndarray:
    k = max((len(c.get("keypoints") or []) for c in coco_gt.dataset["categories"]), default=0)
    return _COCO_SIGMAS if k in (0, 17) else np.full(k, _COCO_SIGMAS.mean())


def metrics_of(ev: COCOeval, iou_type: str) -> dict[str, float]:
    return {f"{iou_type}/{name}": float(value) for name, value in zip(STAT_NAMES[iou_type], ev.stats)
            if value >= 0}  # -1 = undefined (no ground truth in that range): dropped


def coco_evaluate(coco_gt: COCO, results: list[dict], iou_types) -> dict[str, float]:
    metrics = {}
    for iou_type in iou_types:
        metrics |= metrics_of(run_cocoeval(coco_gt, results, iou_type), iou_type)
    return metrics


def per_category_table(rows: dict) -> str:
    """Markdown of per_category_rows: AP and AP50 per category, with its ground-truth count."""
    lines = ["| category | AP | AP50 | instances |", "|---|---:|---:|---:|"]
    for name, ap, ap50, count in zip(*rows.values()):
        lines.append(f"| {name} | {_number(ap)} | {_number(ap50)} | {count} |")
    return "\n".join(lines) + "\n"


def per_category_rows(ev: COCOeval) -> dict:
    """Columns for mlflow's log_table: category, AP, AP50 (area all, 100 detections), instances."""
    precision, gt = ev.eval["precision"], ev.cocoGt  # [iou thresholds, recall, category, area, max dets]
    table: dict = {"category": [], "AP": [], "AP50": [], "instances": []}
    for k, cat_id in enumerate(ev.params.catIds):
        p = precision[:, :, k, 0, -1]
        table["category"].append(gt.cats[cat_id].get("name", str(cat_id)))
        table["AP"].append(_mean_defined(p))
        table["AP50"].append(_mean_defined(p[0]))
        table["instances"].append(len(gt.getAnnIds(catIds=[cat_id], iscrowd=False)))
    return table


def _mean_defined(p: np.ndarray) -> float | None:
    return float(p[p > -1].mean()) if (p > -1).any() else None  # -1: no such ground truth


def _number(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


# --------------------------------------------------------------------------------------- evaluate

def evaluate(cfg, model, ctx: Context | None = None, output_dir=None, tracker: Tracker | None = None,
             step: int | None = None, checkpoint: str | None = None) -> dict[str, float]:
    """Evaluate on every TEST.DATASETS entry; every rank must call it. Same metrics on all ranks.
    With `checkpoint` (a file of the run), the metrics are linked to it as a model in MLflow."""
    ctx, tracker, output_dir, metrics = ctx or Context(), tracker or Tracker(), Path(output_dir or cfg.OUTPUT_DIR), {}
    for i, name in enumerate(cfg.TEST.DATASETS):
        prefix = "" if i == 0 else f"{dataset_dirname(name)}/"
        found = evaluate_dataset(cfg, model, ctx, name, output_dir, tracker, step)
        metrics |= {prefix + k: v for k, v in found.items()}
    if ctx.is_main and metrics:
        if checkpoint:
            tracker.log_evaluation(metrics, 0 if step is None else step, checkpoint)
        else:
            tracker.log_metrics(metrics, 0 if step is None else step)
    return broadcast_object(ctx, metrics)


def evaluate_dataset(cfg, model, ctx: Context, name: str, output_dir: Path, tracker: Tracker,
                     step: int | None = None) -> dict:
    loader, dataset = build_test_loader(cfg, name, ctx.rank, ctx.world_size)
    start = time.perf_counter()
    with _eval_mode(model):
        set_test_size(model, cfg)
        results = run_inference(model, loader, dataset, ctx.device, ctx)
    seconds = time.perf_counter() - start
    if not ctx.is_main:
        return {}
    log.info("%s: %d images inferred in %.1fs, %d detections", name, len(dataset), seconds, len(results))
    tag = dataset_dirname(name)
    out = output_dir / "eval" / tag
    metrics, box_ev = {}, None
    for iou_type in iou_types_for(cfg.MODEL.TYPE):
        ev = run_cocoeval(dataset.coco, results, iou_type)
        metrics |= metrics_of(ev, iou_type)
        box_ev = box_ev or ev  # bbox comes first
    rows = per_category_rows(box_ev)
    files = [write_atomic(out / "detections.json", json.dumps(results)),
             write_atomic(out / "per_category_ap.md", f"# {name}: bbox AP per category\n\n{per_category_table(rows)}")]
    for path in files:
        tracker.log_artifact(path, f"eval/{tag}")
    step = 0 if step is None else step
    tracker.log_table(rows, f"eval/{tag}/per_category_ap_iter{step}.json")
    for key, picture in drawings(dataset, results, cfg.TEST.VIS_IMAGES):
        tracker.log_image(picture, f"{tag}/{key}", step)
    return metrics


def eval_due(cfg, cur_iter: int) -> bool:
    """Every TEST.EVAL_PERIOD iterations during training (the last one: model_final is evaluated)."""
    period = cfg.TEST.EVAL_PERIOD
    last = cur_iter + 1 >= cfg.SOLVER.MAX_ITER
    return bool(cfg.TEST.DATASETS) and period > 0 and (cur_iter + 1) % period == 0 and not last


# ------------------------------------------------------------------------------ weights and the CLI

def load_model_for_eval(cfg, weights: str, num_classes: int, num_keypoints: int = 0):
    """A model from a checkpoint path, a model folder, a `runs:/<id>/...` artifact or `models:/...`."""
    return _load_for_eval(cfg, weights, num_classes, num_keypoints)[0]


def _load_for_eval(cfg, weights: str, num_classes: int, num_keypoints: int, tests: list = ()):
    """(model, iteration, its categories or None, the MODEL.TYPE of a model that carries its own config
    or None); a checkpoint file's categories are checked against the test sets before the model is built."""
    if user_path(weights, "--weights").is_dir():  # a model folder tracktron wrote (output/model/detector)
        return _of_detector(load_detector(cfg, weights))
    if not weights.startswith(MLFLOW_URIS):
        return _load_file(cfg, weights, num_classes, num_keypoints, tests)
    with tempfile.TemporaryDirectory(prefix="tracktron-eval-") as tmp:
        path = download_uri(cfg, followed(cfg, weights), tmp, shown=weights)
        if path.is_dir():  # a logged model (models:/name@alias, runs:/<id>/model): weights, never a pickle
            return _of_detector(load_local(path, weights))
        return _load_file(cfg, str(path), num_classes, num_keypoints, tests, shown=weights)


def _of_detector(detector):
    return (detector.model, None, {"categories": detector.categories, "keypoint_names": detector.keypoint_names},
            detector.cfg.MODEL.TYPE)


def _load_file(cfg, path: str, num_classes: int, num_keypoints: int, tests: list = (), shown: str | None = None):
    if (file := user_path(path, "--weights")).exists() and not file.is_file():  # read whole, /dev/zero never ends
        raise UserError(f"--weights {shown or path}: not a weights file (a pipe or a device)")
    iteration, categories = _stored(path, shown or path)
    check_categories(shown or path, categories, tests)
    model = build_model(cfg, num_classes, num_keypoints)
    report = load_weights(model, path, option="--weights", shown=shown)  # path is no "": checked first
    if report.skipped or report.missing:  # an evaluation of random heads would be meaningless
        bad = (report.skipped + report.missing)[:3]
        raise UserError(f"weights {shown or path} do not fit {cfg.MODEL.TYPE} with {num_classes} classes: "
                        f"{len(report.skipped)} tensors differ in shape, {len(report.missing)} missing "
                        f"(e.g. {', '.join(bad)})")
    return model, iteration, categories, None


def _stored(path: str, shown: str) -> tuple[int | None, dict | None]:
    """A tracktron checkpoint's iteration and categories; (None, None) for other weights."""
    try:  # mmap: reads these small entries, not the tensors again
        state = torch_load.load(path, mmap=True)
    except Exception:  # a raw state_dict, or an old (non-zip) file mmap cannot map: load_weights says more
        return None, None
    if not isinstance(state, dict):
        return None, None
    iteration = state["iteration"] if isinstance(state.get("iteration"), int) else None
    ours = isinstance(state.get("categories"), dict) or (isinstance(state.get("model"), dict) and "config" in state)
    if "categories" not in state or not ours:
        return iteration, None  # another tool's file (its "categories" a list of names): not held to tracktron's
    categories, keypoint_names = checked_categories(state["categories"], shown)
    return iteration, {"categories": categories, "keypoint_names": keypoint_names}


def check_categories(weights: str, theirs: dict | None, tests: list) -> None:
    """Every test set has the categories the model was trained on, or its detections would count under
    other names. Weights that do not say (a torchvision or Detectron file) are held to the first test set."""
    if not tests:
        return
    stored = theirs if theirs and theirs.get("categories") else categories_of(tests[0])
    expected = category_key_of(stored, tests[0].keypoints)
    for dataset in tests:
        ours = category_key_of(categories_of(dataset), dataset.keypoints)
        if ours != expected:
            what = "keypoints" if same_categories(ours, expected) else "categories"
            raise UserError(f"{dataset.ann_file} has other {what} than {weights} was trained on "
                            f"({category_difference(ours, expected)}): evaluate it on test sets with the model's "
                            "categories")


def eval_command(cfg, weights: str, ctx: Context | None = None) -> dict[str, float]:
    """`tracktron eval --config FILE --weights PATH_OR_URI`: evaluate, print, log into the run."""
    check_weights_given(weights)  # before a test set is read (or the synthetic one made)
    if not cfg.TEST.DATASETS:
        raise UserError("TEST.DATASETS is empty: name at least one dataset (e.g. synth_shapes_val)")
    ctx = ctx or Context(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    with held_while_checking():  # a refused job ends in its error line, not after the weights' news
        # Classes from the test sets: the training sets need not exist on an evaluation machine.
        tests = _test_sets(cfg)
        model, iteration, categories, own_type = _load_for_eval(cfg, weights, tests[0].num_classes,
                                                                tests[0].num_keypoints, tests)
        if own_type and own_type != cfg.MODEL.TYPE:  # its network is its own config's: so are its tasks
            log.info("%s is a %s model (--config says %s): scored as one", weights, own_type, cfg.MODEL.TYPE)
            cfg = copy.deepcopy(cfg)
            cfg.MODEL.TYPE = own_type
            tests = _test_sets(cfg)  # with the masks or keypoints its tasks score
        check_categories(weights, categories, tests)
        _check_ranks_agree(ctx, cfg, model)
    model.to(ctx.device)
    # A checkpoint of a run (its iteration known) is evaluated into that run, linked to its model;
    # a logged model names no iteration: its metrics are printed, not logged at a made-up step.
    run_id = weights[len("runs:/"):].split("/")[0] if weights.startswith("runs:/") and iteration is not None else None
    checkpoint = found[1] if run_id and (found := run_checkpoint(weights)) else None  # the file its sha256 tag vouched for
    tracker = attach(cfg, run_id, dataset_inputs(cfg, training=False)) if run_id and ctx.is_main else Tracker()
    try:
        if ctx.is_main:  # after attach's check of the run (a deleted one is refused): nothing made before
            make_writable(Path(cfg.OUTPUT_DIR), f"OUTPUT_DIR {cfg.OUTPUT_DIR}")
        metrics = evaluate(cfg, model, ctx, cfg.OUTPUT_DIR, tracker, step=iteration or 0, checkpoint=checkpoint)
    finally:
        failed = tracker.finish(None)
    if ctx.is_main:
        said = format_metrics(metrics, weights) if metrics else \
            f"evaluation of {weights}: no metric (the test sets have no annotations to score against)"
        write_or_drop(sys.stdout, said + "\n")  # a view, as in training: a reader gone (`| head`) fails nothing
        record_evaluation(cfg, weights, metrics, iteration or 0, None if failed else tracker.run.run_id)
        if metrics and not failed and tracker.run.run_id:  # not said, the run's curves change unseen
            log.info("the scores are logged into run %s at step %d", tracker.run.run_id, iteration or 0)
    if failed:
        raise UserError(f"cannot log the evaluation to run {run_id}: {', '.join(failed)} failed (see the log)")
    return metrics


def _test_sets(cfg) -> list:
    """TEST.DATASETS with what the model's tasks score (the training sets need not exist here)."""
    return [CocoDetection(*resolve_dataset(cfg, name), train=False, **model_needs(cfg)) for name in cfg.TEST.DATASETS]


def _check_ranks_agree(ctx: Context, cfg, model) -> None:
    """Under torchrun every rank holds the same weights (their digest: paths may differ by node) and config."""
    if not ctx.distributed:
        return
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    keys = job_keys(cfg) | {k: v for k, v in flatten(cfg).items() if k.startswith("TEST.")}
    check_same_job(ctx, keys | {"--weights": digest.hexdigest()})


def format_metrics(metrics: dict[str, float], title: str = "") -> str:
    """A short markdown table: one row per iou type (and dataset), one column per stat."""
    rows: dict[str, dict] = {}
    for key, value in metrics.items():
        group, stat = key.rsplit("/", 1)
        rows.setdefault(group, {})[stat] = value
    stats = list(dict.fromkeys(s for r in rows.values() for s in r))
    lines = [f"evaluation of {title}"] if title else []
    lines += ["| | " + " | ".join(stats) + " |", "|---|" + "---:|" * len(stats)]
    lines += [f"| {group} | " + " | ".join(f"{r[s]:.4f}" if s in r else "" for s in stats) + " |"
              for group, r in rows.items()]
    return "\n".join(lines)
