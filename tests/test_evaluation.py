"""trainer.evaluation: COCO results, metrics equal to pycocotools', tiny models, runs:/ weights, torchrun.

Also runnable as a script: `torchrun --nproc_per_node 2 tests/test_evaluation.py ...` is the worker
of the distributed test.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the torchrun worker runs this file as a script

from trainer import config  # noqa: E402
from trainer.data import CocoDetection, build_test_loader  # noqa: E402
from trainer.data.images import as_float  # noqa: E402
from trainer.distributed import Context  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.evaluation import (coco_evaluate, eval_command, eval_due, evaluate,  # noqa: E402
                                format_metrics, iou_types_for, per_category_rows, per_category_table, run_cocoeval,
                                run_inference)
from trainer.models import build_model  # noqa: E402
from trainer.data.synth import write_synthetic_dataset  # noqa: E402
from trainer.tracking import Tracker  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),  # pycocotools
              pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")]  # torchvision 0.29

TINY = {"BACKBONE": "mobilenet_v3_large", "BACKBONE_WIDTH": 0.5, "FPN_CHANNELS": 32, "ANCHOR_SIZES": [16, 32, 64],
        "REPRESENTATION_SIZE": 64, "RPN_PRE_NMS_TOP_N_TEST": 50, "RPN_POST_NMS_TOP_N_TEST": 20,
        "DETECTIONS_PER_IMAGE": 20}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on 2 shared cores: one intra-op thread is several times faster than two, which
    spin against the suite's other processes."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("eval") / "shapes", num_images=12, image_size=96, seed=3)


def make_cfg(dataset: Path, model_type="fasterrcnn_resnet50_fpn", **keys) -> config.Config:
    cfg = config.defaults()
    config.merge(cfg, {"MODEL": {"TYPE": model_type, **TINY}, "TRAIN": {"SCALES": [64], "MAX_SIZE": 96},
                       "TEST": {"DATASETS": [str(dataset)], "SCALE": 80, "MAX_SIZE": 120, "IMS_PER_BATCH": 4},
                       "DATA_LOADER": {"NUM_THREADS": 0}})
    config.merge(cfg, keys)
    return cfg


class Oracle(torch.nn.Module):
    """Answers each image with its ground truth, in torchvision's output format, in dataset order."""

    def __init__(self, dataset: CocoDetection):
        super().__init__()
        self.answers = []
        for i in range(len(dataset)):
            _, t = dataset[i]
            out = {"boxes": t["boxes"], "labels": t["labels"], "scores": torch.ones(len(t["labels"]))}
            if "masks" in t:
                out["masks"] = t["masks"][:, None].float()
            if "keypoints" in t:
                out["keypoints"] = t["keypoints"]
            self.answers.append(out)

    def forward(self, images):
        answers, self.answers = self.answers[:len(images)], self.answers[len(images):]
        return answers


class Recorder(Tracker):
    def __init__(self):
        self.metrics, self.artifacts = [], []

    def log_metrics(self, metrics, step):
        self.metrics.append((step, dict(metrics)))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((Path(path).name, artifact_path))


def test_iou_types():
    assert iou_types_for("fasterrcnn_resnet50_fpn") == ["bbox"]
    assert iou_types_for("maskrcnn_resnet50_fpn_v2") == ["bbox", "segm"]
    assert iou_types_for("keypointrcnn_resnet50_fpn") == ["bbox", "keypoints"]
    assert iou_types_for("retinanet_resnet50_fpn") == ["bbox"]


def test_ground_truth_as_detections_scores_one(shapes):
    gt = CocoDetection(shapes / "images", shapes / "annotations.json", train=False, masks=True, keypoints=True)
    loader, _ = build_test_loader(make_cfg(shapes), str(shapes))
    results = run_inference(Oracle(gt), loader, gt, torch.device("cpu"))
    assert len(results) == len(gt.coco.anns) and {r["score"] for r in results} == {1.0}
    json.dumps(results)  # RLE counts are str, everything serialises
    metrics = coco_evaluate(gt.coco, results, ["bbox", "segm", "keypoints"])
    for iou_type in ("bbox", "segm", "keypoints"):
        assert metrics[f"{iou_type}/AP"] == pytest.approx(1.0)
        assert metrics[f"{iou_type}/AP50"] == pytest.approx(1.0)
    assert all(v == pytest.approx(1.0) for v in metrics.values())
    assert "bbox/APl" not in metrics  # no large shape: undefined (-1) stats are dropped


def _handmade(coco: COCO) -> list[dict]:
    """Shifted, rescored, relabelled and spurious boxes: every branch of the matching."""
    rng = np.random.default_rng(0)
    results = []
    for ann in coco.anns.values():
        x, y, w, h = ann["bbox"]
        shift = rng.uniform(-0.3, 0.3, 2) * (w, h)
        cat = ann["category_id"] if rng.random() > 0.2 else ann["category_id"] % 3 + 1
        results.append({"image_id": ann["image_id"], "category_id": cat, "score": float(rng.random()),
                        "bbox": [x + shift[0], y + shift[1], w, h]})
        results.append({"image_id": ann["image_id"], "category_id": 1, "score": float(rng.random()) / 2,
                        "bbox": [float(v) for v in rng.uniform(0, 60, 4)]})
    return results


def test_metrics_equal_pycocotools_own(shapes):
    coco = CocoDetection(shapes / "images", shapes / "annotations.json", train=False).coco
    results = _handmade(coco)
    ours = coco_evaluate(coco, results, ["bbox"])
    with contextlib.redirect_stdout(io.StringIO()):
        ev = COCOeval(coco, coco.loadRes(json.loads(json.dumps(results))), "bbox")
        ev.evaluate(), ev.accumulate(), ev.summarize()
    names = ("AP", "AP50", "AP75", "APs", "APm", "APl")
    expected = {f"bbox/{n}": float(v) for n, v in zip(names, ev.stats) if v >= 0}
    assert ours == pytest.approx(expected) and 0 < ours["bbox/AP"] < 1
    table = per_category_table(per_category_rows(run_cocoeval(coco, results, "bbox")))
    assert table.startswith("| category | AP | AP50 | instances |") and "| square |" in table


def test_empty_results_give_zeros(shapes):
    coco = CocoDetection(shapes / "images", shapes / "annotations.json", train=False).coco
    metrics = coco_evaluate(coco, [], ["bbox", "segm", "keypoints"])
    assert metrics["bbox/AP"] == metrics["segm/AP"] == metrics["keypoints/AP"] == 0.0
    assert set(v for v in metrics.values()) == {0.0}
    # Boxes only (a Faster R-CNN) evaluated for segm too: zeros, no crash.
    assert coco_evaluate(coco, _handmade(coco), ["segm"])["segm/AP"] == 0.0


@pytest.mark.parametrize("model_type, iou_type", [("maskrcnn_resnet50_fpn", "segm"),
                                                  ("keypointrcnn_resnet50_fpn", "keypoints")])
def test_tiny_models_evaluate_and_training_is_unchanged(shapes, tmp_path, model_type, iou_type):
    cfg = make_cfg(shapes, model_type)
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=4, num_keypoints=4).train()
    rng_before = torch.get_rng_state()
    tracker = Recorder()
    metrics = evaluate(cfg, model, Context(), tmp_path, tracker, step=7)
    assert {"bbox/AP", "bbox/AP50", f"{iou_type}/AP", f"{iou_type}/AP50"} <= set(metrics)
    assert tracker.metrics == [(7, metrics)]
    assert sorted(tracker.artifacts) == [("detections.json", "eval/shapes"), ("per_category_ap.md", "eval/shapes")]
    detections = json.loads((tmp_path / "eval" / "shapes" / "detections.json").read_text())
    if detections:
        assert ("segmentation" if iou_type == "segm" else "keypoints") in detections[0]
    # Training goes on as if nothing happened: mode, input size, RNG, autograd.
    assert model.training and model.transform.min_size == (64,) and model.transform.max_size == 96
    assert torch.equal(torch.get_rng_state(), rng_before)
    gt = CocoDetection(shapes / "images", shapes / "annotations.json", train=True, masks=True, keypoints=True)
    images, targets = zip(*(gt[i] for i in range(2)))
    losses = model([as_float(im) for im in images], list(targets))  # the prefetcher's floats
    sum(losses.values()).backward()


@pytest.mark.parametrize("model_type, scored, config_type", [
    ("maskrcnn_resnet50_fpn", "segm", "fasterrcnn_resnet50_fpn"),  # README's `eval --config configs/demo.yaml`
    ("keypointrcnn_resnet50_fpn", "keypoints", "maskrcnn_resnet50_fpn"),
])
def test_a_model_folder_is_scored_on_its_own_tasks_whatever_the_configs_type(shapes, tmp_path, model_type, scored,
                                                                              config_type):
    """helper-70: the network of a model folder (or `models:/`, `runs:/<id>/model`) is built from its
    own config, but what was scored came from --config's MODEL.TYPE: a Mask R-CNN got no segm row, a
    Keypoint R-CNN a made-up `segm 0.0000` and no keypoints row, exit 0."""
    from trainer.evaluation import eval_command
    from trainer.inference import save

    own = make_cfg(shapes, model_type)
    torch.manual_seed(0)
    dataset = CocoDetection(shapes / "images", shapes / "annotations.json", train=False, keypoints=True)
    model = build_model(own, num_classes=dataset.num_classes, num_keypoints=dataset.num_keypoints)
    folder = save(tmp_path / "detector", own, model.state_dict(), dataset.categories, dataset.keypoint_names)
    metrics = eval_command(make_cfg(shapes, config_type, OUTPUT_DIR=str(tmp_path / "out")), str(folder))
    assert {"bbox/AP", f"{scored}/AP"} <= set(metrics) and not set(metrics) - {
        k for k in metrics if k.split("/")[0] in ("bbox", scored)}, sorted(metrics)


def test_evaluations_fall_on_the_period_but_not_on_the_last_iteration(shapes):
    """The last iteration is model_final's, which the engine evaluates once after saving it."""
    cfg = make_cfg(shapes, SOLVER={"MAX_ITER": 10}, TEST={"EVAL_PERIOD": 4})
    assert [it for it in range(10) if eval_due(cfg, it)] == [3, 7]
    cfg.TEST["DATASETS"] = []
    assert not any(eval_due(cfg, it) for it in range(10))


def test_several_datasets_prefix_all_but_the_first(shapes, tmp_path):
    other = write_synthetic_dataset(tmp_path / "other", num_images=4, image_size=64, seed=5)
    cfg = make_cfg(shapes)
    cfg.TEST["DATASETS"] = [str(shapes), str(other)]
    torch.manual_seed(0)
    metrics = evaluate(cfg, build_model(cfg, 4), Context(), tmp_path)
    assert "bbox/AP" in metrics and "other/bbox/AP" in metrics and "shapes/bbox/AP" not in metrics
    assert (tmp_path / "eval" / "other" / "per_category_ap.md").is_file()
    assert "| other/bbox |" in format_metrics(metrics)


def test_a_test_image_unreadable_only_at_the_final_evaluation_keeps_model_final_and_a_rerun_evaluates_it(
        tmp_path, data_dir):
    """A test image whose header is sound but whose pixels are not passes the check at start and fails
    the final evaluation, read by a loader worker: one line (not the worker's traceback), saying that
    model_final is saved; once the image is fixed, the same command gives the run its scores."""
    import shutil

    from mlflow import MlflowClient

    from tests.conftest import demo_overrides, run_trainer
    from tests.faultkit import garble_image_data

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    image = sorted((data / "synth_shapes" / "val" / "images").iterdir())[0]
    good = garble_image_data(image)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = demo_overrides(tmp_path, data, **{"SOLVER.MAX_ITER": 4, "TRACKING.URI": uri, "DATA_LOADER.NUM_THREADS": 1})
    failed = run_trainer(args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    last = failed.stderr.strip().split("\n")[-1]
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert last.startswith(f"error: cannot decode image {image}: ") and "Traceback" not in failed.stderr, last
    assert last.endswith("(model_final.pth is saved; once the test set is fixed, the same command evaluates it "
                         "into the run)"), last
    assert (tmp_path / "output" / "model_final.pth").is_file()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and "bbox/AP" not in run.data.metrics

    image.write_bytes(good)
    again = run_trainer(args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "sent the run what it lacked: the evaluation of model_final.pth, the model" in again.stdout
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and 0.0 <= run.data.metrics["bbox/AP"] <= 1.0

    # Untracked, the line names the command that evaluates it.
    garble_image_data(image)
    untracked = run_trainer(args + ["TRACKING.ENABLED", "False", "OUTPUT_DIR", str(tmp_path / "untracked")],
                            cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert untracked.returncode == 2 and untracked.stderr.strip().split("\n")[-1].endswith(
        f"`tracktron eval` of the job's config with --weights {tmp_path / 'untracked' / 'model_final.pth'} evaluates it)")


def test_runs_uri_weights_are_evaluated_and_logged_into_their_run(tmp_path, data_dir, caplog):
    from mlflow import MlflowClient

    from tests.conftest import demo_overrides, run_trainer

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = demo_overrides(tmp_path, data_dir, **{"SOLVER.MAX_ITER": 20, "TRAIN.SNAPSHOT_ITERS": 100,
                                                 "TRACKING.URI": uri, "TRACKING.REGISTERED_MODEL": "demo_eval",
                                                 "TEST.DATASETS": "()"})  # no evaluation while training
    done = run_trainer(args, cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    run_id = run.info.run_id

    cfg = config.load_config(ROOT / "configs" / "demo.yaml",
                             ["DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "eval_out"), "TRACKING.URI", uri])
    with caplog.at_level(logging.INFO, logger="trainer.evaluation"):
        metrics = eval_command(cfg, f"runs:/{run_id}/checkpoints/model_final.pth")
    assert 0.0 <= metrics["bbox/AP"] <= 1.0
    assert f"the scores are logged into run {run_id} at step 19" in caplog.text  # said, not done unseen
    (logged,) = client.get_metric_history(run_id, "bbox/AP")
    assert logged.step == 19 and logged.value == pytest.approx(metrics["bbox/AP"])
    assert {f.path for f in client.list_artifacts(run_id, "eval/synth_shapes_val")} == {
        "eval/synth_shapes_val/detections.json", "eval/synth_shapes_val/per_category_ap.md",
        "eval/synth_shapes_val/per_category_ap_iter19.json"}

    # The run, trained without test sets, now holds scores of synth_shapes_val: scores of another set
    # are printed, not logged under the same names as its own.
    other = write_synthetic_dataset(tmp_path / "other", num_images=4, image_size=64, seed=5)
    elsewhere = config.load_config(ROOT / "configs" / "demo.yaml", [
        "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "other_out"), "TRACKING.URI", uri,
        "TEST.DATASETS", f"('{other}',)"])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.evaluation"):
        assert 0.0 <= eval_command(elsewhere, f"runs:/{run_id}/checkpoints/model_final.pth")["bbox/AP"] <= 1.0
    assert "the scores are logged into run" not in caplog.text and "evaluation" in caplog.text.lower()
    assert len(client.get_metric_history(run_id, "bbox/AP")) == 1
    assert not client.list_artifacts(run_id, "eval/other")

    # The registered model and the local checkpoint give the same numbers.
    assert eval_command(cfg, "models:/demo_eval/1") == pytest.approx(metrics)
    assert eval_command(cfg, str(tmp_path / "output" / "model_final.pth")) == pytest.approx(metrics)

    with pytest.raises(UserError, match="cannot fetch runs:/0123456789abcdef") as e:
        eval_command(cfg, "runs:/0123456789abcdef/checkpoints/model_final.pth")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="cannot fetch"):
        eval_command(cfg, f"runs:/{run_id}/checkpoints/model_iter999.pth")

    # A deleted run takes no write: that was said after the whole evaluation (helper-46's red team).
    client.delete_run(run_id)
    late = config.load_config(ROOT / "configs" / "demo.yaml",
                              ["DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "late"), "TRACKING.URI", uri])
    with pytest.raises(UserError, match=f"run {run_id} is deleted, so its evaluation cannot be logged into it: "
                                        f"restore it \\(`mlflow runs restore --run-id {run_id}`\\)"):
        eval_command(late, f"runs:/{run_id}/checkpoints/model_final.pth")
    assert not (tmp_path / "late").exists()  # not even made empty, before the refusal (helper-104)
    # Its experiment deleted: restoring the run alone left it hidden in a deleted experiment (helper-56)
    client.restore_run(run_id)
    experiment_id = client.get_run(run_id).info.experiment_id
    client.delete_experiment(experiment_id)
    with pytest.raises(UserError, match=f"restore it \\(`mlflow experiments restore --experiment-id {experiment_id}` "
                                        "\\(its experiment is deleted\\)\\)"):
        eval_command(late, f"runs:/{run_id}/checkpoints/model_final.pth")


def test_weights_of_another_model_are_refused(shapes, tmp_path):
    cfg = make_cfg(shapes)
    path = tmp_path / "other.pth"
    torch.save({"model": build_model(cfg, num_classes=7).state_dict(), "iteration": 3}, path)
    with pytest.raises(UserError, match="do not fit"):
        eval_command(cfg, str(path))


def test_weights_that_are_a_device_or_a_pipe_are_refused_before_they_are_read(shapes, tmp_path):
    """`eval --weights /dev/zero` grew to the OOM killer (18 GB) and a FIFO hung forever: the file
    was read whole before the "is it a file" check (train and predict refuse both). Found by the
    red team of 2026-12-03 (third)."""
    cfg = make_cfg(shapes)
    fifo = tmp_path / "weights.pth"
    os.mkfifo(fifo)
    for weights in ("/dev/zero", str(fifo)):
        with pytest.raises(UserError, match=f"--weights {weights}: not a weights file"):
            eval_command(cfg, weights)


def _with_categories(shapes: Path, tmp_path: Path, change) -> Path:
    """A copy of the shapes set whose annotation file `change` edited (its images linked)."""
    import shutil

    copy = tmp_path / f"changed-{change.__name__}"
    if copy.exists():  # made by an earlier call with the same change
        return copy
    shutil.copytree(shapes, copy, symlinks=True)
    ann = next(copy.glob("*.json"))
    data = json.loads(ann.read_text())
    change(data)
    ann.write_text(json.dumps(data))
    return copy


def test_eval_refuses_test_sets_whose_categories_are_not_the_models(shapes, tmp_path, capsys):
    """The red team's: a test set with one category fewer crashed with a KeyError after the whole
    inference; one with two names swapped was scored, silently, under the wrong names."""
    from trainer.inference import categories_of, save

    def swap(data):
        data["categories"][0]["name"], data["categories"][1]["name"] = (data["categories"][1]["name"],
                                                                        data["categories"][0]["name"])

    def fewer(data):
        gone = data["categories"].pop()["id"]
        data["annotations"] = [a for a in data["annotations"] if a["category_id"] != gone]

    cfg = make_cfg(shapes)
    trained_on = categories_of(CocoDetection(shapes / "images", next(shapes.glob("*.json")), train=False))
    model = build_model(cfg, num_classes=4)
    checkpoint = tmp_path / "model_final.pth"
    torch.save({"model": model.state_dict(), "iteration": 3, "categories": trained_on}, checkpoint)
    folder = save(tmp_path / "detector", cfg, model.state_dict(), trained_on["categories"], [])
    for change in (swap, fewer):
        other = _with_categories(shapes, tmp_path, change)
        for weights in (checkpoint, folder):
            with pytest.raises(UserError, match="has other categories than") as e:
                eval_command(make_cfg(other, OUTPUT_DIR=str(tmp_path / "out")), str(weights))
            assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    # Weights that do not name their categories: every test set must have the first one's.
    plain = tmp_path / "plain.pth"
    torch.save(model.state_dict(), plain)
    cfg = make_cfg(shapes, OUTPUT_DIR=str(tmp_path / "out"))
    cfg.TEST.DATASETS = [str(shapes), str(_with_categories(shapes, tmp_path, swap))]
    with pytest.raises(UserError, match="has other categories than"):
        eval_command(cfg, str(plain))
    assert "loaded" not in capsys.readouterr().err  # the weights' news held back: the error line is the last


def test_detections_of_labels_past_the_datasets_categories_are_dropped():
    """MODEL.NUM_CLASSES above the dataset's count: the extra labels are no category COCOeval
    scores (a KeyError after the whole training, found by the red team)."""
    out = {"boxes": torch.tensor([[0.0, 0, 4, 4], [1, 1, 5, 5]]), "labels": torch.tensor([2, 7]),
           "scores": torch.tensor([0.9, 0.8])}
    from trainer.inference import detections_to_coco

    (only,) = detections_to_coco([out], [11], {1: 5, 2: 6, 3: 9})
    assert (only["image_id"], only["category_id"], only["bbox"]) == (11, 6, [0.0, 0.0, 4.0, 4.0])


def test_eval_of_test_sets_without_annotations_says_there_is_nothing_to_score(shapes, tmp_path, capsys):
    def unannotated(data):
        data["annotations"] = []

    cfg = make_cfg(_with_categories(shapes, tmp_path, unannotated), OUTPUT_DIR=str(tmp_path / "out"))
    weights = tmp_path / "w.pth"
    torch.save(build_model(cfg, num_classes=4).state_dict(), weights)
    assert eval_command(cfg, str(weights)) == {}
    assert "no metric (the test sets have no annotations to score against)" in capsys.readouterr().out


def test_scores_do_not_depend_on_how_many_test_images_a_batch_holds(tmp_path):
    """helper-80: torchvision pads a batch to its largest image, so with TEST.IMS_PER_BATCH 2 (the
    default) an image batched with a larger one got other detections than the served model and
    `predict` give it alone: bbox/AP 0.0097 against their 0.0076, and another score per world size."""
    data = write_synthetic_dataset(tmp_path / "mixed", num_images=8, image_size=96, seed=3)
    sizes = {(im["width"], im["height"]) for im in json.loads((data / "annotations.json").read_text())["images"]}
    assert len(sizes) > 1  # neighbours of other sizes
    torch.manual_seed(0)
    model = build_model(make_cfg(data), num_classes=4)
    found = {}
    for batch in (1, 4):
        out = tmp_path / f"batch{batch}"
        metrics = evaluate(make_cfg(data, TEST={"IMS_PER_BATCH": batch}), model, Context(), out)
        found[batch] = metrics, json.loads((out / "eval" / "mixed" / "detections.json").read_text())
    def per_image(dets):  # an untrained model's tied scores may come in either order: compare sorted
        by_image = {}
        for d in dets:
            found = (d["category_id"], round(d["score"], 3), *(round(x, 1) for x in d["bbox"]))
            by_image.setdefault(d["image_id"], []).append(found)
        return {image: sorted(found) for image, found in by_image.items()}

    one, four = per_image(found[1][1]), per_image(found[4][1])
    assert one and four.keys() == one.keys()
    for image in one:
        assert len(four[image]) == len(one[image]) and np.allclose(four[image], one[image], atol=0.2), image
    assert found[4][0] == pytest.approx(found[1][0])


# ---- torchrun: every rank infers its shard, rank 0 gets them all ----

def test_distributed_evaluation_equals_single_process(shapes, tmp_path):
    from tests.conftest import run_tree  # not at the top: torchrun's workers run this file as a script

    cfg = make_cfg(shapes, TEST={"IMS_PER_BATCH": 1})  # batch of one: padding cannot differ between runs
    torch.manual_seed(0)
    model = build_model(cfg, num_classes=4)
    torch.save(model.state_dict(), tmp_path / "w.pth")
    single = evaluate(cfg, model, Context(), tmp_path / "single")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(shapes), str(tmp_path / "w.pth"), str(tmp_path / "dist")]
    done = run_tree(cmd, timeout=180, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    per_rank = [json.loads((tmp_path / "dist" / f"metrics{r}.json").read_text()) for r in range(2)]
    assert per_rank[0] == per_rank[1] == pytest.approx(single)
    key = lambda d: (d["image_id"], -d["score"])  # noqa: E731
    ours = sorted(json.loads((tmp_path / "dist" / "eval" / "shapes" / "detections.json").read_text()), key=key)
    theirs = sorted(json.loads((tmp_path / "single" / "eval" / "shapes" / "detections.json").read_text()), key=key)
    assert [d["image_id"] for d in ours] == [d["image_id"] for d in theirs]
    assert len({d["image_id"] for d in ours}) > 6  # both shards are there


def _distributed_main(dataset: str, weights: str, out: str) -> None:
    from trainer import distributed

    ctx = distributed.setup()
    cfg = make_cfg(Path(dataset), TEST={"IMS_PER_BATCH": 1})
    model = build_model(cfg, num_classes=4)
    model.load_state_dict(torch.load(weights, weights_only=True))
    metrics = evaluate(cfg, model, ctx, out)
    Path(out, f"metrics{ctx.rank}.json").write_text(json.dumps(metrics))
    distributed.teardown(ctx)


if __name__ == "__main__":
    _distributed_main(*sys.argv[1:4])


def test_eval_names_its_own_options_and_checks_its_output_dir(tmp_path, data_dir):
    """`tracktron eval` says --weights (not TRAIN.WEIGHTS), and refuses an OUTPUT_DIR it cannot
    write before it evaluates anything."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "trainer", "eval", "--config", str(ROOT / "configs" / "demo.yaml")]
    opts = ["DATA_DIR", str(data_dir), "TRACKING.ENABLED", "false", "DATA_LOADER.NUM_THREADS", "0"]
    missing = subprocess.run(base + ["--weights", str(tmp_path / "nope.pth"), *opts, "OUTPUT_DIR", str(tmp_path / "o")],
                             capture_output=True, text=True, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1].startswith(f"error: --weights {tmp_path / 'nope.pth'}: no such file")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    blocked = subprocess.run(base + ["--weights", str(tmp_path / "nope.pth"), *opts, "OUTPUT_DIR", str(blocker / "out")],
                             capture_output=True, text=True, cwd=tmp_path)
    assert blocked.returncode == 2
    assert blocked.stderr.strip().splitlines()[-1] == f"error: cannot write to OUTPUT_DIR {blocker / 'out'}: {blocker} is a file"


def test_eval_into_an_output_dir_where_nothing_can_be_written_stops_before_inference(tmp_path, data_dir):
    """Root's os.access says yes under /proc, where no file can be made: the evaluation ran in full,
    then the detections could not be written (the red team's traceback)."""
    import subprocess
    import sys

    cfg = config.load_config(ROOT / "configs" / "demo.yaml", ["DATA_DIR", str(data_dir)])
    torch.save(build_model(cfg, 4).state_dict(), tmp_path / "weights.pth")
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "eval", "--config", str(ROOT / "configs" / "demo.yaml"), "--weights",
         str(tmp_path / "weights.pth"), "DATA_DIR", str(data_dir), "TRACKING.ENABLED", "false",
         "OUTPUT_DIR", "/proc/tracktron-eval"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: OUTPUT_DIR /proc/tracktron-eval: cannot write there")
    assert "Traceback" not in result.stderr and "images inferred" not in result.stderr


def test_a_runs_test_sets_edited_by_hand_match_no_evaluation():
    """runs.evaluation_sets of a run whose tag or param was edited into something else (not JSON,
    not a list of names): what no evaluation matches, never an exception from the parse."""
    from types import SimpleNamespace

    from trainer.tracking.runs import EVAL_SETS_TAG, evaluation_sets

    def run(tags=None, params=None, inputs=()):
        return SimpleNamespace(data=SimpleNamespace(tags=tags or {}, params=params or {}),
                               inputs=SimpleNamespace(dataset_inputs=list(inputs)))

    ds = SimpleNamespace(dataset=SimpleNamespace(name="val", digest="abc"))
    assert evaluation_sets(run(params={"TEST.DATASETS": "['val']"}, inputs=[ds])) == [["val", "abc"]]
    assert evaluation_sets(run(tags={EVAL_SETS_TAG: '[["val", "abc"]]'})) == [["val", "abc"]]
    assert evaluation_sets(run()) == []
    for odd in (run(tags={EVAL_SETS_TAG: "{not json"}), run(tags={EVAL_SETS_TAG: '[["a", "b", "c"]]'}),
                run(tags={EVAL_SETS_TAG: '{"a": 1}'}), run(params={"TEST.DATASETS": "5"}, inputs=[ds]),
                run(params={"TEST.DATASETS": "[1, 2]"}, inputs=[ds]),
                run(params={"TEST.DATASETS": "['val', ..."}, inputs=[ds]),
                run(tags={EVAL_SETS_TAG: "[" * 3000 + "]" * 3000})):  # helper-56: "tracking server …: maximum recursion"
        assert evaluation_sets(odd) == [["?", "?"]]


def test_a_run_never_trained_tracked_takes_its_first_evaluations_sets_as_its_own(tmp_path, caplog):
    """A run made by the tracked rerun of a job trained untracked has TEST.DATASETS as a param but
    no dataset inputs and no sets tag: it was scored on nothing. `tracktron eval` and the rerun's
    final evaluation (both through runs.takes_scores) log into it and name the sets its own; scores
    on other sets after that are refused. Before, `tracktron eval` refused it: its param's sets had
    no digest to match."""
    from mlflow import MlflowClient

    from trainer.tracking.runs import EVAL_SETS_TAG, takes_scores

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("demo")).info.run_id
    client.log_param(run_id, "TEST.DATASETS", "['synth_shapes_val']")
    val = [{"name": "synth_shapes_val", "digest": "d1", "context": "evaluation"},
           {"name": "synth_shapes_train", "digest": "d0", "context": "training"}]
    assert takes_scores(client, client.get_run(run_id), val)
    assert json.loads(client.get_run(run_id).data.tags[EVAL_SETS_TAG]) == [["synth_shapes_val", "d1"]]
    assert takes_scores(client, client.get_run(run_id), val)  # its own now
    other = [{"name": "synth_shapes_val", "digest": "d2", "context": "evaluation"}]  # another annotation file
    assert not takes_scores(client, client.get_run(run_id), other)
    assert f"these scores are not logged into run {run_id}: its scores are of synth_shapes_val" in caplog.text
    assert json.loads(client.get_run(run_id).data.tags[EVAL_SETS_TAG]) == [["synth_shapes_val", "d1"]]


def test_an_evaluation_on_some_of_a_runs_sets_scores_what_the_run_names():
    """The first set gives the plain names (bbox/AP), the others their prefixed ones: an evaluation
    on the first set alone, or on it and some of the others, logs what the run's names mean."""
    from trainer.tracking.runs import same_scores

    a, b, c = ["a", "1"], ["b", "2"], ["c", "3"]
    assert same_scores([a, b, c], [a]) and same_scores([a, b, c], [a, c]) and same_scores([a], [a])
    assert not same_scores([a, b], [b]) and not same_scores([a, b], [b, a]) and not same_scores([a], [a, b])
    assert not same_scores([a], [["a", "9"]]) and not same_scores([a], [])


def test_another_tools_checkpoint_with_its_own_categories_key_is_evaluated(shapes, tmp_path):
    """{"model": state_dict, "categories": ["circle", ...]} (another tool's way to name them) is not a
    tracktron checkpoint: its categories are not held to tracktron's shape, its weights are used."""
    cfg = make_cfg(shapes, OUTPUT_DIR=str(tmp_path / "out"))
    torch.manual_seed(0)
    path = tmp_path / "other_tool.pth"
    torch.save({"model": build_model(cfg, 4).state_dict(), "categories": ["circle", "square", "triangle"]}, path)
    metrics = eval_command(cfg, str(path))
    assert 0.0 <= metrics["bbox/AP"] <= 1.0


def test_eval_of_weights_on_a_server_that_answers_a_byte_at_a_time_gives_up(tmp_path, data_dir):
    """helper-56's red team: each byte restarts a read's timeout, so `tracktron eval --weights
    models:/...` against a dripping server said nothing for as long as it dripped (killed after 6
    minutes). A fetch that makes no progress for four request timeouts is given up on, in one line."""
    import subprocess
    import time

    from tests.servers import drip_server

    with drip_server() as url:
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "trainer", "eval", "--config", str(ROOT / "configs" / "demo.yaml"),
                              "--weights", "models:/tracktron-demo@best", "TRACKING.URI", url, "DATA_DIR",
                              str(data_dir), "OUTPUT_DIR", str(tmp_path / "out")], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300, env={**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "2"})
        took = time.monotonic() - start
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"error: cannot fetch models:/tracktron-demo@best from {url}: no progress for 8 s (a server that hangs, or "
        "answers a byte at a time)"], out.stderr[-2000:]
    assert took < 60, f"{took:.0f}s"


def test_the_run_mlflow_run_makes_for_an_evaluation_gets_its_scores(shapes, tmp_path, monkeypatch):
    """helper-54's red team: `mlflow run . -e eval` made a run (MLFLOW_RUN_ID) that stayed empty: the
    scores went to the weights' run, or nowhere. That run gets them, with the weights' name; a run
    that MLflow Projects did not make for the eval entry point (a training run's id left in a shell)
    is never written to."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    cfg = make_cfg(shapes, OUTPUT_DIR=str(tmp_path / "out"), TRACKING={"URI": uri})
    path = tmp_path / "weights.pth"
    torch.manual_seed(0)
    torch.save({"model": build_model(cfg, num_classes=CocoDetection(shapes / "images", shapes / "annotations.json").num_classes)
                .state_dict(), "iteration": 3}, path)
    client = MlflowClient(uri)
    exp = client.create_experiment("evals")
    launcher = client.create_run(exp, tags={"mlflow.project.entryPoint": "eval"}).info.run_id
    stray = client.create_run(exp, tags={"tracktron.job": "j"}).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", launcher)
    metrics = eval_command(cfg, str(path))
    got = client.get_run(launcher).data
    assert metrics and got.metrics == pytest.approx(metrics)
    assert got.tags["tracktron.weights"] == str(path) and "tracktron.scores_run_id" not in got.tags
    monkeypatch.setenv("MLFLOW_RUN_ID", stray)
    eval_command(cfg, str(path))
    assert not client.get_run(stray).data.metrics


def test_a_download_that_writes_in_place_is_progress(tmp_path, monkeypatch):
    """helper-57: MLflow's multipart download sets the file's size first, then writes its chunks in
    place: the size never changes, and the stall guard gave up on a download that was going well."""
    import time

    from trainer.tracking.model_uris import _while_progressing

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # given up on after 4 s without a change

    def multipart():
        target = tmp_path / "model_final.pth"
        with open(target, "wb") as f:
            f.truncate(16 << 20)
        for i in range(16):  # 8 s in all, a chunk every half second
            time.sleep(0.5)
            with open(target, "r+b") as f:
                f.seek(i << 20)
                f.write(b"x" * (1 << 20))
        return target

    assert _while_progressing(multipart, tmp_path).stat().st_size == 16 << 20
    with pytest.raises(TimeoutError, match="no progress for 4 s"):
        _while_progressing(lambda: time.sleep(30), tmp_path)


@pytest.mark.parametrize("first_id", [0, "a0"], ids=["from-0", "strings"])
def test_annotation_ids_as_annotation_tools_number_them_score_ground_truth_one(shapes, tmp_path, first_id):
    """Roboflow, Label Studio and labelme2coco number annotations from 0 (COCO's own from 1), which
    pycocotools' matching reads as no match: the ground truth as detections scored AP 0.81, not 1."""
    data = json.loads((shapes / "annotations.json").read_text())
    for n, ann in enumerate(data["annotations"]):
        ann["id"] = n if first_id == 0 else f"a{n}"
    (tmp_path / "images").symlink_to(shapes / "images")
    (tmp_path / "annotations.json").write_text(json.dumps(data))
    gt = CocoDetection(tmp_path / "images", tmp_path / "annotations.json", train=False, masks=True)
    loader, _ = build_test_loader(make_cfg(tmp_path, "maskrcnn_resnet50_fpn"), str(tmp_path))
    metrics = coco_evaluate(gt.coco, run_inference(Oracle(gt), loader, gt, torch.device("cpu")), ["bbox", "segm"])
    assert metrics["bbox/AP"] == pytest.approx(1.0) and metrics["segm/AP"] == pytest.approx(1.0)
