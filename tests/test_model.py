"""The model is the product: checkpoints ranked by their AP in MLflow, the best and the final model
registered, served over HTTP by `mlflow models serve`, and loaded back without unpickling code.

One short job against a real `mlflow server` with moto's S3 (module fixture), then what a user
does with what it left.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from PIL import Image

from tests.conftest import demo_overrides, run_trainer, trainer_cmd
from tests.servers import BIN, free_port, wait_http
from trainer.checkpoint.state import load as load_checkpoint

MAX_ITER, EVAL_PERIOD = 6, 2  # evaluations of model_iter1, model_iter3 and model_final


@pytest.fixture(scope="module")
def job(tmp_path_factory, data_dir, mlflow_server, s3_server):
    """A finished job whose checkpoints were evaluated every EVAL_PERIOD iterations."""
    tmp = tmp_path_factory.mktemp("job")
    name = f"det-{uuid.uuid4().hex[:6]}"
    args = demo_overrides(tmp, data_dir, **{
        "TRACKING.URI": mlflow_server.url, "TRACKING.EXPERIMENT": name, "TRACKING.REGISTERED_MODEL": name,
        "TRACKING.FLUSH_TIMEOUT_S": 120, "SOLVER.MAX_ITER": MAX_ITER, "TEST.EVAL_PERIOD": EVAL_PERIOD,
        "TRAIN.SNAPSHOT_ITERS": 100, "TRAIN.CHECKPOINTS_KEEP": 1})
    result = run_trainer(args, cwd=tmp, env=s3_server.env)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name(name)
    (run,) = client.search_runs([exp.experiment_id])
    env = {**os.environ, **s3_server.env, "MLFLOW_TRACKING_URI": mlflow_server.url,
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}  # as in an activated venv: serve runs uvicorn
    return {"name": name, "client": client, "run": run, "experiment_id": exp.experiment_id, "tmp": tmp,
            "args": args, "env": env, "server": mlflow_server}


def checkpoint_models(job, order_by=None):
    order = [{"field_name": f"metrics.{order_by}", "ascending": False}] if order_by else None
    return job["client"].search_logged_models(
        [job["experiment_id"]], filter_string=f"source_run_id = '{job['run'].info.run_id}' AND "
                                              "model_type = 'tracktron-checkpoint'", order_by=order)


def test_each_evaluated_checkpoint_is_a_logged_model_with_its_metrics(job):
    client, run_id = job["client"], job["run"].info.run_id
    models = {m.name: m for m in checkpoint_models(job)}
    assert set(models) == {"model_iter1", "model_iter3", "model_final"}
    on_server = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    for name, step in (("model_iter1", 1), ("model_iter3", 3), ("model_final", MAX_ITER - 1)):
        m = models[name]
        ap = [x for x in m.metrics if x.key == "bbox/AP"]
        assert len(ap) == 1 and ap[0].step == step and 0.0 <= ap[0].value <= 1.0
        assert {x.key for x in m.metrics} >= {"bbox/AP", "bbox/AP50", "bbox/AP75"}
        # Linked to the checkpoint already uploaded (the model holds no second copy of the weights)...
        assert m.tags["tracktron.checkpoint"] == f"runs:/{run_id}/checkpoints/{name}.pth"
        assert f"checkpoints/{name}.pth" in on_server
        assert client.list_logged_model_artifacts(m.model_id) == []
    # ... and the run's own bbox/AP curve has one point per evaluation.
    assert sorted(p.step for p in client.get_metric_history(run_id, "bbox/AP")) == [1, 3, MAX_ITER - 1]


def test_each_evaluation_logs_what_the_detector_sees_and_its_per_category_table(job, tmp_path):
    """TEST.VIS_IMAGES (4) drawings per evaluation, the same images at every step, with the ground
    truth in green; and the per-category AP as an MLflow table."""
    from trainer.visualize import GROUND_TRUTH

    client, run_id = job["client"], job["run"].info.run_id
    names = [a.path.split("/")[-1] for a in client.list_artifacts(run_id, "images")]
    pngs = [n for n in names if n.endswith(".png")]
    keyed = {}  # (key, step) from MLflow's time-stepped names: <key>+step+<step>+timestamp+...
    for n in pngs:
        key, _, step, *_ = n.split("+")
        keyed.setdefault(key, set()).add(int(step))
    assert len(keyed) == 4 and all(steps == {1, 3, MAX_ITER - 1} for steps in keyed.values()), keyed
    picture = np.asarray(Image.open(client.download_artifacts(run_id, f"images/{pngs[0]}", str(tmp_path))))
    assert (picture[..., :3] == GROUND_TRUTH).all(-1).sum() > 20  # boxes drawn in the ground truth's colour
    for step in (1, 3, MAX_ITER - 1):
        table = json.loads(Path(client.download_artifacts(
            run_id, f"eval/synth_shapes_val/per_category_ap_iter{step}.json", str(tmp_path))).read_text())
        assert table["columns"] == ["category", "AP", "AP50", "instances"] and len(table["data"]) == 3


def test_the_best_checkpoint_is_found_through_mlflow_and_registered_as_best(job):
    from trainer.config import load_config
    from trainer.tracking.logged_model import load_detector

    client, run = job["client"], job["run"]
    ranked = checkpoint_models(job, order_by="bbox/AP")
    aps = [next(x.value for x in m.metrics if x.key == "bbox/AP") for m in ranked]
    assert aps == sorted(aps, reverse=True)
    best = ranked[0]
    assert run.data.tags["tracktron.best_model_id"] == best.model_id
    assert run.data.tags["tracktron.best_checkpoint"] == f"{best.name}.pth"
    assert run.data.tags["tracktron.best_metric"] == f"bbox/AP={aps[0]:.6g}"

    name = job["name"]
    final, best_version = (client.get_model_version_by_alias(name, a) for a in ("final", "best"))
    assert final.run_id == run.info.run_id == best_version.run_id
    # helper-71: logged within the run, MLflow copied the run's step-0 metrics (the warm-up's loss and
    # lr) onto each servable model, reading every metric's whole history for them (minutes at 90k)
    for version in (final, best_version):
        servable = client.get_logged_model(version.source.removeprefix("models:/"))
        assert servable.source_run_id == run.info.run_id and str(servable.status) == "READY"
        assert not servable.metrics, [m.key for m in servable.metrics]
    assert {o.model_id for o in client.get_run(run.info.run_id).outputs.model_outputs} >= {
        final.source.removeprefix("models:/"), best_version.source.removeprefix("models:/")}  # the run's models
    # The version called best holds exactly the weights of the best checkpoint.
    os.environ.update(job["env"])
    cfg = load_config(None, ["TRACKING.URI", job["server"].url])
    served = load_detector(cfg, f"models:/{name}@best").model.state_dict()
    checkpoint = client.download_artifacts(run.info.run_id, f"checkpoints/{best.name}.pth", str(job["tmp"]))
    expected = load_checkpoint(Path(checkpoint))["model"]
    assert served.keys() == expected.keys()
    assert all(torch.equal(served[k], expected[k]) for k in expected)
    if best.name == "model_final":
        assert best_version.version == final.version


def test_a_best_checkpoint_gone_from_the_disk_is_made_servable_from_the_runs_copy(job, tmp_path):
    """The best checkpoint of a job resumed elsewhere, or pruned by TRAIN.CHECKPOINTS_KEEP, is only in
    the run: its servable copy is made from the run's file, downloaded as a resume's checkpoint is (a
    timeout by its size, not MLflow's flat one), and holds exactly its weights."""
    from trainer.config import load_config
    from trainer.tracking.final_model import _log_servable_copy
    from trainer.tracking.logged_model import load_detector

    client, url = job["client"], job["server"].url
    final = job["tmp"] / "output" / "model_final.pth"
    run_id = client.create_run(client.create_experiment(f"copy-{uuid.uuid4().hex[:6]}")).info.run_id
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "model_iter1.pth").write_bytes(final.read_bytes())
    client.log_artifact(run_id, str(tmp_path / "up" / "model_iter1.pth"), "checkpoints")
    name = f"copy-{uuid.uuid4().hex[:6]}"
    version = _log_servable_copy(client, url, run_id, tmp_path / "gone" / "model_iter1.pth", name)
    served = load_detector(load_config(None, ["TRACKING.URI", url]), f"models:/{name}/{version}").model.state_dict()
    expected = load_checkpoint(final)["model"]
    assert served.keys() == expected.keys() and all(torch.equal(served[k], expected[k]) for k in expected)
    assert client.get_model_version(name, version).run_id == run_id


def test_the_logged_model_holds_weights_not_pickles(job, tmp_path):
    import mlflow

    os.environ.update(job["env"])
    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{job['name']}@final", dst_path=str(tmp_path)))
    files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    assert "artifacts/detector/weights.pt" in files and "artifacts/detector/categories.json" in files
    assert not [f for f in files if f.endswith((".pkl", ".pickle"))], files
    mlmodel = (folder / "MLmodel").read_text()
    assert "python_function" in mlmodel and "model_code_path" in mlmodel  # a model from code
    assert "signature" in mlmodel and (folder / "serving_input_example.json").is_file()
    # The weights file is a state dict: it loads with weights_only (no code runs).
    state = torch.load(folder / "artifacts/detector/weights.pt", weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())


def _image_ids(data_dir: Path) -> dict:
    ann = json.loads((data_dir / "synth_shapes" / "val" / "annotations.json").read_text())
    return {im["file_name"]: im["id"] for im in ann["images"]}


def _b64(image: Path) -> str:
    return base64.b64encode(image.read_bytes()).decode("ascii")


@contextlib.contextmanager
def serving(job, tmp_path, *options):
    """`mlflow models serve -m models:/<name>@final` on 127.0.0.1 (its log in tmp_path/serve.log);
    yields post(body) -> the json answer (urllib's HTTPError for a 4xx)."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{job['name']}@final",
                               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1", *options],
                              stdout=log, stderr=subprocess.STDOUT, env=job["env"])

    def post(body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    try:
        wait_http(f"http://127.0.0.1:{port}/ping", timeout=240, proc=server)
        yield post
    finally:
        server.terminate()
        server.wait(30)


def test_a_request_past_the_servers_timeout_stops_inferring(job, data_dir, tmp_path):
    """A request of 2,000 images to a server with a 3 s request timeout: the client gets MLflow's
    504 at 3 s, and the model stops there too (it inferred on for minutes, holding the CPU), so the
    next request is answered at once."""
    import time

    image = _b64(sorted((data_dir / "synth_shapes" / "val" / "images").glob("*.png"))[0])
    with serving(job, tmp_path, "-t", "3") as post:
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as answered:
            post({"dataframe_split": {"columns": ["image"], "data": [[image]] * 2000}})
        assert answered.value.code == 504
        log = tmp_path / "serve.log"
        while "past the server's request timeout" not in log.read_text() and time.monotonic() - start < 60:
            time.sleep(0.2)
        assert "of 2000: past the server's request timeout (3 s)" in log.read_text()
        (one,) = post({"dataframe_split": {"columns": ["image"], "data": [[image]]}})["predictions"]
        assert set(one) >= {"boxes", "scores"}


def test_mlflow_models_serve_answers_with_the_boxes_tracktron_eval_finds(job, data_dir, tmp_path):
    """`mlflow models serve -m models:/<name>@final` on 127.0.0.1, a PNG of the synthetic set POSTed
    as a base64 image column, against `tracktron eval` of the same model (one image per batch, as
    served, so that no batch padding differs)."""
    name, env = job["name"], job["env"]
    image = sorted((data_dir / "synth_shapes" / "val" / "images").glob("*.png"))[3]
    out = tmp_path / "eval"
    evaluated = subprocess.run(
        [sys.executable, "-m", "trainer", "eval", "--config", str(Path(__file__).parents[1] / "configs/demo.yaml"),
         "--weights", f"models:/{name}@final", "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(out),
         "TRACKING.URI", job["server"].url, "TEST.IMS_PER_BATCH", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr
    image_id = _image_ids(data_dir)[image.name]
    expected = [d for d in json.loads((out / "eval/synth_shapes_val/detections.json").read_text())
                if d["image_id"] == image_id]

    with serving(job, tmp_path) as post:
        (served,) = post({"dataframe_split": {"columns": ["image"], "data": [[_b64(image)]]}})["predictions"]
    assert len(served["boxes"]) == len(expected) > 0
    categories = json.loads((data_dir / "synth_shapes" / "val" / "annotations.json").read_text())["categories"]
    names = {c["id"]: c["name"] for c in categories}
    assert [names[c] for c in served["category_ids"]] == served["category_names"]
    got = np.array([[*b[:2], b[2] - b[0], b[3] - b[1], s, c]  # as COCO results: x, y, w, h, score, category
                    for b, s, c in zip(served["boxes"], served["scores"], served["category_ids"])])
    want = np.array([[*d["bbox"], d["score"], d["category_id"]] for d in expected])
    order = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    np.testing.assert_allclose(order(got), order(want), atol=1e-3)


def test_every_request_format_of_mlflow_serving_reads_the_image(job, data_dir, tmp_path):
    """MLflow base64-decodes a binary column only for dataframe_split / dataframe_records: the
    instances and inputs formats reached the decoder as base64 text (400 'no image format')."""
    image = sorted((data_dir / "synth_shapes" / "val" / "images").glob("*.png"))[3]
    text = _b64(image)
    bodies = [{"dataframe_records": [{"image": text}]}, {"instances": [{"image": text}]}, {"instances": [text]},
              {"inputs": [text]}, {"inputs": {"image": [text]}}]
    with serving(job, tmp_path) as post:
        expected = post({"dataframe_split": {"columns": ["image"], "data": [[text]]}})["predictions"]
        answers = {json.dumps(body)[:40]: post(body)["predictions"] for body in bodies}
        with pytest.raises(urllib.error.HTTPError) as refused:
            post({"inputs": ["not an image, nor base64!"]})
    assert answers == dict.fromkeys(answers, expected)
    assert refused.value.code == 400
    message = json.loads(refused.value.read())["message"]  # MLflow puts "Failed to predict data ..." before it
    assert message.splitlines()[-1].startswith("Error: image 0: 25 bytes of text that are not base64"), message


def test_a_pickled_model_is_refused_not_unpickled(tmp_path, data_dir, monkeypatch):
    """An MLflow pytorch model logged as a pickle (as tracktron once did): loading it would run code."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    monkeypatch.chdir(tmp_path)  # the run's local artifacts land here; the next test starts where it was
    with mlflow.start_run():
        mlflow.pytorch.log_model(torch.nn.Linear(2, 1), name="model", serialization_format="pickle",
                                 pip_requirements=["torch"], registered_model_name="pickled")
    result = subprocess.run([sys.executable, "-m", "trainer", "eval", "--config",
                             str(Path(__file__).parents[1] / "configs/demo.yaml"), "--weights", "models:/pickled/1",
                             "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(tmp_path / "out"), "TRACKING.URI", uri],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --weights models:/pickled/1: a pickled PyTorch model")
    assert "Traceback" not in result.stderr


def test_a_fine_tune_starts_from_models_best_with_fewer_classes_and_records_its_parent(job, data_dir, tmp_path):
    """TRAIN.WEIGHTS models:/<name>@best on a dataset with one category less: the class head is
    new, everything else starts as the parent's; the new run names its parent and its datasets."""
    from trainer.hashing import sha256_of

    val = data_dir / "synth_shapes" / "val"
    ann = json.loads((val / "annotations.json").read_text())
    dropped = ann["categories"][-1]["id"]
    ann["categories"] = ann["categories"][:-1]
    ann["annotations"] = [a for a in ann["annotations"] if a["category_id"] != dropped]
    subset = tmp_path / "two_shapes"
    subset.mkdir()
    (subset / "images").symlink_to(val / "images")
    (subset / "annotations.json").write_text(json.dumps(ann))

    name, client = job["name"], job["client"]
    child = f"{name}-ft"
    args = demo_overrides(tmp_path, data_dir, **{
        "TRACKING.URI": job["server"].url, "TRACKING.EXPERIMENT": child, "TRAIN.DATASETS": f"('{subset}',)",
        "TEST.DATASETS": "()", "TRAIN.WEIGHTS": f"models:/{name}@best", "SOLVER.MAX_ITER": 1,
        "SOLVER.BASE_LR": 1e-9, "TRACKING.FLUSH_TIMEOUT_S": 60})
    result = run_trainer(args, cwd=tmp_path, env=job["env"])
    assert result.returncode == 0, result.stderr
    assert "skipped" in result.stderr and "cls_score" in result.stderr  # the log says which tensors are new

    (found,) = client.search_runs([client.get_experiment_by_name(child).experiment_id])
    run = client.get_run(found.info.run_id)
    best = client.get_model_version_by_alias(name, "best")
    tags = run.data.tags
    assert tags["tracktron.parent.weights"] == f"models:/{name}@best"
    assert tags["tracktron.parent.run_id"] == job["run"].info.run_id
    assert tags["tracktron.parent.model_id"] == best.source.removeprefix("models:/")
    assert [m.model_id for m in run.inputs.model_inputs] == [tags["tracktron.parent.model_id"]]
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.digest == sha256_of(subset / "annotations.json")[:36]
    assert json.loads(dataset.dataset.profile)["sha256"] == sha256_of(subset / "annotations.json")
    assert {(t.key, t.value) for t in dataset.tags} >= {("mlflow.data.context", "training")}

    import mlflow

    os.environ.update(job["env"])
    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@best", dst_path=str(tmp_path / "parent")))
    parent = torch.load(folder / "artifacts" / "detector" / "weights.pt", weights_only=True)
    trained = load_checkpoint(tmp_path / "output" / "model_final.pth")["model"]
    head = "roi_heads.box_predictor.cls_score.weight"
    assert trained[head].shape[0] == parent[head].shape[0] - 1  # background + one class less
    same = [k for k in parent if k in trained and parent[k].shape == trained[k].shape and parent[k].is_floating_point()]
    assert len(same) > 100
    for k in same:  # a step of 1e-9 from the parent's weights
        torch.testing.assert_close(trained[k], parent[k], atol=1e-5, rtol=0)


def test_eval_of_a_runs_checkpoint_on_other_test_sets_leaves_its_scores_and_best_alone(job, data_dir, tmp_path):
    """The job's run is scored on synth_shapes_val. `tracktron eval` of its checkpoint on a set of
    the same name whose annotation file differs (DATASET_CATALOG points elsewhere) prints its
    scores; the run's bbox/AP curve and its best checkpoint stay as training left them."""
    from trainer.data.synth import write_synthetic_dataset
    from trainer.hashing import sha256_of

    client, run_id = job["client"], job["run"].info.run_id
    before = client.get_run(run_id).data.tags
    curve = [(p.step, p.value) for p in client.get_metric_history(run_id, "bbox/AP")]
    other = write_synthetic_dataset(tmp_path / "easy", num_images=3, image_size=64, seed=11)
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "eval", "--config", str(Path(__file__).parents[1] / "configs/demo.yaml"),
         "--weights", f"runs:/{run_id}/checkpoints/model_iter1.pth", "OUTPUT_DIR", str(tmp_path / "out"),
         "TRACKING.URI", job["server"].url, "DATASET_CATALOG.synth_shapes_val.IM_DIR", str(other / "images"),
         "DATASET_CATALOG.synth_shapes_val.ANN_FN", str(other / "annotations.json")],
        capture_output=True, text=True, env=job["env"], timeout=300)
    assert result.returncode == 0, result.stderr
    assert "| bbox |" in result.stdout and f"not logged into run {run_id}" in result.stderr
    assert [(p.step, p.value) for p in client.get_metric_history(run_id, "bbox/AP")] == curve
    after = client.get_run(run_id).data.tags
    assert {k: after.get(k) for k in before if k.startswith("tracktron.best")} == \
        {k: v for k, v in before.items() if k.startswith("tracktron.best")}
    assert after["tracktron.eval.datasets"] == before["tracktron.eval.datasets"]  # set by training: its own sets
    ((name, digest),) = json.loads(before["tracktron.eval.datasets"])
    assert name == "synth_shapes_val" and digest == sha256_of(data_dir / "synth_shapes/val/annotations.json")[:36]


def test_a_run_checkpoint_is_used_only_when_its_sha256_tag_says_complete(job, data_dir, tmp_path):
    """runs:/<run>/checkpoints/<file> as TRAIN.WEIGHTS, `eval --weights` and `predict --weights`: an
    upload without its tag (unfinished) or with bytes that do not match it is refused in one line;
    with the right tag each of them goes ahead."""
    from trainer.hashing import sha256_of

    client = job["client"]
    holder = client.create_run(client.create_experiment(f"{job['name']}-holder")).info.run_id
    final = job["tmp"] / "output" / "model_final.pth"
    client.log_artifact(holder, str(final), "checkpoints")
    weights = f"runs:/{holder}/checkpoints/model_final.pth"
    image = sorted((data_dir / "synth_shapes" / "val" / "images").glob("*.png"))[0]
    demo = str(Path(__file__).parents[1] / "configs/demo.yaml")
    where = ["DATA_DIR", str(data_dir), "TRACKING.URI", job["server"].url]
    commands = {
        "train": trainer_cmd("--dry-run", *demo_overrides(tmp_path, data_dir, **{
            "TRACKING.URI": job["server"].url, "TRACKING.EXPERIMENT": "holder-ft", "TRAIN.WEIGHTS": weights})),
        "eval": [sys.executable, "-m", "trainer", "eval", "--config", demo, "--weights", weights, *where,
                 "OUTPUT_DIR", str(tmp_path / "eval")],
        "predict": [sys.executable, "-m", "trainer", "predict", "--weights", weights, "--out", str(tmp_path / "p"),
                    str(image), "--config", demo, *where]}

    def run(cmd):
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=job["env"], timeout=300)

    for tag, message in ((None, "not a complete checkpoint of that run"),
                         ("0" * 64, "do not match the run's sha256 tag")):
        if tag:
            client.set_tag(holder, "tracktron.ckpt.model_final.pth.sha256", tag)
        for what, cmd in commands.items():
            result = run(cmd)
            assert result.returncode == 2, (what, result.stderr)
            assert message in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr, what
    assert not (tmp_path / "p").exists() and not (tmp_path / "eval").exists()
    client.set_tag(holder, "tracktron.ckpt.model_final.pth.sha256", sha256_of(final))
    results = {what: run(cmd) for what, cmd in commands.items()}
    assert all(r.returncode == 0 for r in results.values()), {w: r.stderr[-2000:] for w, r in results.items()}
    assert f"from {weights}" in results["train"].stdout
    assert "| bbox |" in results["eval"].stdout and (tmp_path / "p" / f"{image.stem}.json").is_file()
