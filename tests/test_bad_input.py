"""Bad input ends in one clear line on stderr and exit status 2, never a traceback.

The table these cases come from is docs/FAULTS.md ("Bad input"). The CLI runs in this process
(`trainer.cli.main`, catching SystemExit): bad input is found before any training, so this is the
same code path as `tracktron train` at a fraction of the cost of a subprocess. One case runs as a
real process to pin the exit status the shell sees.

Already covered elsewhere, not repeated: a misspelt key with a suggestion, an unknown dataset,
an unknown MODEL.TYPE (tests/test_train.py::test_bad_input_is_one_line_and_exit_2), a missing
config file (test_train.py::test_missing_config_file_is_exit_2), an unreachable tracking server
(test_tracking.py::test_unreachable_tracking_server_is_one_line_exit_2) and an unknown --resume
run id on sqlite (test_tracking.py::test_unknown_resume_run_id_is_exit_2).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import DEMO, tmpfs_mount, trainer_cmd
from trainer import cli, launch
from trainer.config import _ALL_KEYS, load_config
from trainer.errors import UserError
from trainer.data.synth import write_synthetic_dataset

pytestmark = [pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")]


@dataclass
class Outcome:
    code: int | None
    stderr: str
    stdout: str

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().split("\n")  # not splitlines(): it also splits at \x1c-\x1e, \x85...
        return lines[-1] if lines else ""


def run_cli(argv: list[str]) -> Outcome:
    """`tracktron <argv>` in this process: exit code (None = returned), stderr, stdout.

    Anything but SystemExit escaping main() is a traceback the user would see: it fails the test.
    The root logger's handlers, the environment (the tracker sets MLFLOW_HTTP_* defaults) and the
    working directory are restored afterwards.
    """
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    environ = dict(os.environ)
    err, out = io.StringIO(), io.StringIO()
    code = None
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                cli.main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
    return Outcome(code, err.getvalue(), out.getvalue())


@pytest.fixture
def train(tmp_path, monkeypatch, data_dir):
    """Train the demo config with overrides, tracking off, in a fresh OUTPUT_DIR."""
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)

    def run(*opts: str, config: Path = DEMO, tracking: bool = False) -> Outcome:
        base = ["OUTPUT_DIR", str(tmp_path / "output"), "DATA_DIR", str(data_dir), "SOLVER.MAX_ITER", "1",
                "DATA_LOADER.NUM_THREADS", "0", "TRAIN.IMS_PER_BATCH", "2"]
        if not tracking:
            base += ["TRACKING.ENABLED", "false"]
        return run_cli(["train", "--config", str(config), *base, *opts])

    return run


def assert_exit_2(result: Outcome, message: str) -> None:
    assert result.code == 2, f"exit {result.code}, stderr:\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr
    assert result.last_line.startswith("error: "), result.last_line
    assert message in result.last_line, result.last_line


def _ids(cases) -> list[str]:
    return [getattr(c, "values", c)[0] for c in cases]


# ---- configuration: overrides and files -----------------------------------------------------------

# Pending fixes in files this work may not edit; the diffs are in its hand-back (D1-D4), see docs/FAULTS.md.

CONFIG_CASES = [
    # (id, overrides, the one line; marks)
    ("unknown-key", ["NOT_A_KEY", "1"], "error: unknown config key NOT_A_KEY"),
    ("misspelt-leaf", ["TRAIN.IMS_PER_BACTH", "4"], "did you mean TRAIN.IMS_PER_BATCH?"),
    ("misspelt-section", ["SOLVR.MAX_ITER", "4"], "did you mean SOLVER.MAX_ITER?"),
    ("section-as-key", ["TRACKING", "1"], "error: unknown config key TRACKING"),
    ("wrong-type-int", ["SOLVER.MAX_ITER", "ten"], "error: SOLVER.MAX_ITER must be int, got 'ten'"),
    ("wrong-type-int-fraction", ["TRAIN.SNAPSHOT_ITERS", "2.5"], "TRAIN.SNAPSHOT_ITERS must be int"),
    ("wrong-type-float", ["SOLVER.BASE_LR", "fast"], "SOLVER.BASE_LR must be float"),
    ("wrong-type-bool", ["DETERMINISTIC", "maybe"], "DETERMINISTIC must be bool"),
    ("wrong-type-list-item", ["TRAIN.SCALES", "(big,)"], "TRAIN.SCALES[0] must be int"),
    ("wrong-type-mapping", ["DATASET_CATALOG", "x"], "DATASET_CATALOG must be a mapping"),
    ("wrong-type-str", ["NAME", "[1]"], "NAME must be str"),
    ("negative-lr", ["SOLVER.BASE_LR", "-0.1"], "SOLVER.BASE_LR must be > 0"),
    ("zero-lr", ["SOLVER.BASE_LR", "0"], "SOLVER.BASE_LR must be > 0"),
    ("steps-not-increasing", ["SOLVER.STEPS", "[0, 500, 300]"], "SOLVER.STEPS must be increasing"),
    ("steps-negative", ["SOLVER.LR_POLICY", "step", "SOLVER.STEPS", "[-5, 10]"], "SOLVER.STEPS must be >= 0"),
    ("snapshot-iters-0", ["TRAIN.SNAPSHOT_ITERS", "0"], "TRAIN.SNAPSHOT_ITERS must be > 0"),
    ("max-iter-negative", ["SOLVER.MAX_ITER", "-3"], "SOLVER.MAX_ITER must be 1 to 1,000,000,000"),
    ("ims-per-batch-0", ["TRAIN.IMS_PER_BATCH", "0"], "TRAIN.IMS_PER_BATCH must be > 0"),
    ("test-ims-per-batch-0", ["TEST.IMS_PER_BATCH", "0"], "TEST.IMS_PER_BATCH must be > 0"),
    ("backbone-width-0", ["MODEL.BACKBONE_WIDTH", "0"], "MODEL.BACKBONE_WIDTH must be > 0"),
    ("backbone-width-huge", ["MODEL.BACKBONE_WIDTH", "1e6"], "MODEL.BACKBONE_WIDTH must be at most 8, got 1,000,000.0"),
    ("box-head-huge", ["MODEL.FPN_CHANNELS", "4096", "MODEL.REPRESENTATION_SIZE", "16384", "MODEL.BOX_POOL_SIZE", "64"],
     "MODEL.FPN_CHANNELS x BOX_POOL_SIZE² x REPRESENTATION_SIZE (the box head's first layer) must be at most "
     "1,000,000,000 weights, got 274,877,906,944"),
    # the box head's keys (helper-94's red team: each behaved)
    ("representation-size-0", ["MODEL.REPRESENTATION_SIZE", "0"], "error: MODEL.REPRESENTATION_SIZE must be > 0, got 0"),
    ("representation-size-negative", ["MODEL.REPRESENTATION_SIZE", "-4"], "MODEL.REPRESENTATION_SIZE must be > 0, got -4"),
    ("representation-size-huge", ["MODEL.REPRESENTATION_SIZE", "100000"],
     "MODEL.REPRESENTATION_SIZE must be at most 16,384, got 100,000"),
    ("representation-size-fraction", ["MODEL.REPRESENTATION_SIZE", "64.5"], "MODEL.REPRESENTATION_SIZE must be int, got 64.5"),
    ("representation-size-boolean", ["MODEL.REPRESENTATION_SIZE", "true"],
     "MODEL.REPRESENTATION_SIZE must be int, got 'true'"),
    ("box-pool-size-0", ["MODEL.BOX_POOL_SIZE", "0"], "MODEL.BOX_POOL_SIZE must be > 0, got 0"),
    ("box-pool-size-on-torchvisions-build", ["MODEL.BACKBONE", "''", "MODEL.BACKBONE_WIDTH", "1.0", "MODEL.FPN_CHANNELS",
                                             "256", "MODEL.ANCHOR_SIZES", "[]", "MODEL.BOX_POOL_SIZE", "5"],
     "error: MODEL.BOX_POOL_SIZE needs MODEL.BACKBONE set (torchvision's own builders fix it)"),
    ("fpn-channels-on-torchvisions-build", ["MODEL.BACKBONE", "''", "MODEL.BACKBONE_WIDTH", "1.0"],
     "error: MODEL.FPN_CHANNELS 32 needs MODEL.BACKBONE set (torchvision's own builders use 256)"),
    # trained into ./s3:/bkt/out, then failed to log the model at every rerun; the password printed (helper-47)
    # `OUTPUT_DIR '~'` (quoted, so the shell leaves it): YAML's null; the line said only "an empty value" (helper-52)
    ("output-dir-tilde", ["OUTPUT_DIR", "~"], "OUTPUT_DIR must name a folder, got an empty value (YAML reads a bare `~`"),
    # generated the demo's data into the working folder (helper-55)
    ("data-dir-empty", ["DATA_DIR", ""], "DATA_DIR must name a folder, got an empty value"),
    ("output-dir-url", ["OUTPUT_DIR", "s3://bkt/out"], "OUTPUT_DIR must be a folder on this machine, not a URL (s3://...)"),
    ("output-dir-url-password", ["OUTPUT_DIR", "https://bob:S3CRETPW@host/out"], "not a URL (https://...)"),
    ("detections-0", ["MODEL.DETECTIONS_PER_IMAGE", "0"], "MODEL.DETECTIONS_PER_IMAGE must be > 0"),
    ("rpn-negative", ["MODEL.RPN_POST_NMS_TOP_N_TRAIN", "-5"], "MODEL.RPN_POST_NMS_TOP_N_TRAIN must be > 0"),
    ("num-classes-1", ["MODEL.NUM_CLASSES", "1"], "MODEL.NUM_CLASSES must be -1 (from the dataset) or >= 2"),
    ("trainable-layers-9", ["MODEL.TRAINABLE_BACKBONE_LAYERS", "9"], "MODEL.TRAINABLE_BACKBONE_LAYERS must be"),
    ("anchor-negative", ["MODEL.ANCHOR_SIZES", "[16, -32]"], "MODEL.ANCHOR_SIZES must be positive"),
    ("scale-huge", ["TRAIN.SCALES", "(100000,)"], "TRAIN.SCALES must be at most 10000 pixels"),
    ("flush-timeout-huge", ["TRACKING.FLUSH_TIMEOUT_S", "1e300"], "TRACKING.FLUSH_TIMEOUT_S must be 0 to 86400 seconds"),
    ("grace-huge", ["TRAIN.PREEMPT_GRACE_S", "1e300"], "TRAIN.PREEMPT_GRACE_S must be > 0 and <= 86400"),
    ("registered-model-slash", ["TRACKING.REGISTERED_MODEL", "team/detector"], "cannot name a registered model"),
    ("registered-model-colon", ["TRACKING.REGISTERED_MODEL", "det:v1"], "cannot name a registered model"),
    ("registered-model-blank", ["TRACKING.REGISTERED_MODEL", "'   '"], "cannot name a registered model"),
    ("test-scale-0", ["TEST.SCALE", "0"], "TEST.SCALE and TEST.MAX_SIZE must be > 0"),
    ("negative-lr-in-schedule", ["SOLVER.LR_POLICY", "steps_with_lrs", "SOLVER.STEPS", "[0, 10]",
                                 "SOLVER.LRS", "[0.1, -0.01]"], "SOLVER.LRS must all be > 0"),
    ("negative-warm-up-factor", ["SOLVER.WARM_UP_FACTOR", "-0.5"], "SOLVER.WARM_UP_FACTOR must be >= 0"),
    ("loader-threads-negative", ["DATA_LOADER.NUM_THREADS", "-1"], "DATA_LOADER.NUM_THREADS must be >= 0"),
    ("preempt-grace-0", ["TRAIN.PREEMPT_GRACE_S", "0"], "TRAIN.PREEMPT_GRACE_S must be > 0 and <= 86400"),
    ("unknown-lr-policy", ["SOLVER.LR_POLICY", "step_with_decay"], "SOLVER.LR_POLICY must be one of"),
    ("lrs-per-step", ["SOLVER.LR_POLICY", "steps_with_lrs", "SOLVER.STEPS", "[0, 10]", "SOLVER.LRS", "[0.1]"],
     "one rate per step"),
    ("override-without-value", ["SOLVER.MAX_ITER"], "has no value"),
    ("catalog-entry-incomplete", ["DATASET_CATALOG.mine.IM_DIR", "x", "TRAIN.DATASETS", "('mine',)"],
     "DATASET_CATALOG.mine needs IM_DIR and ANN_FN"),
    ("empty-datasets", ["TRAIN.DATASETS", "()"], "TRAIN.DATASETS is empty"),
    ("weights-missing-file", ["TRAIN.WEIGHTS", "/nonexistent/w.pth"], "TRAIN.WEIGHTS /nonexistent/w.pth: no such file"),
    ("non-finite-lr", ["SOLVER.BASE_LR", ".inf"], "SOLVER.BASE_LR must be a finite number"),
    ("non-finite-gamma", ["SOLVER.GAMMA", ".inf"], "SOLVER.GAMMA must be a finite number"),
    ("nan-lr", ["SOLVER.BASE_LR", ".nan"], "SOLVER.BASE_LR must be a finite number"),
    ("rng-seed-too-large", ["RNG_SEED", str(2**32)], "RNG_SEED must be in [0, 2**32)"),
    ("rng-seed-negative", ["RNG_SEED", "-1"], "RNG_SEED must be in [0, 2**32)"),
    ("newline-in-key", ["A\nB", "1"], "unknown config key 'A\\nB'"),
    ("unhashable-literal", ["TRAIN.SCALES", "{[1]: 2}"], "TRAIN.SCALES[0] must be int"),
    ("catalog-path-through-value", ["DATASET_CATALOG.a", "1", "DATASET_CATALOG.a.b", "2"],
     "DATASET_CATALOG.a is 1, not a mapping"),
    # entries this job does not use are checked too: the job that names one later would fail there
    ("catalog-entry-misspelt-key", ["DATASET_CATALOG.unused.IM_DIR", "x", "DATASET_CATALOG.unused.ANN_FILE", "y.json"],
     "DATASET_CATALOG.unused needs IM_DIR and ANN_FN (an image folder and a COCO json, each a path relative to "
     "DATA_DIR or absolute) and no other key but credentials: ANN_FN missing or not a path"),
    ("catalog-entry-extra-key", ["DATASET_CATALOG.mine", "{IM_DIR: x, ANN_FN: y.json, IM_PREFIX: z}"],
     "DATASET_CATALOG.mine needs IM_DIR and ANN_FN (an image folder and a COCO json, each a path relative to "
     "DATA_DIR or absolute) and no other key but credentials: unknown key IM_PREFIX"),
    ("catalog-entry-number", ["DATASET_CATALOG.mine", "{IM_DIR: 5, ANN_FN: y.json}"], ": IM_DIR missing or not a path"),
    ("catalog-entry-blank", ["DATASET_CATALOG.mine", "{IM_DIR: ' ', ANN_FN: y.json}"], ": IM_DIR missing or not a path"),
    # an OSError traceback (file name too long), in eval and --dry-run: the red team of 2026-12-03
    ("test-set-name-too-long", ["TEST.DATASETS", f"('{'v' * 300}',)"], "200 at most"),
    ("catalog-entry-not-a-mapping", ["DATASET_CATALOG.mine", "[x, y.json]"],
     "DATASET_CATALOG.mine must be a mapping with IM_DIR and ANN_FN, got list"),
]


@pytest.mark.parametrize("case, opts, message", CONFIG_CASES, ids=_ids(CONFIG_CASES))
def test_bad_config_override(train, case, opts, message):
    result = train(*opts)
    assert_exit_2(result, message)
    assert "S3CRETPW" not in result.stdout + result.stderr
    assert not Path("output").exists() or not list(Path("output").glob("*.pth"))


FILE_CASES = [
    ("malformed-yaml", "SOLVER:\n  BASE_LR: [0.1\n", "malformed YAML in {path} line"),
    ("yaml-not-a-mapping", "- a\n- b\n", "{path} must hold a mapping of config keys, got list"),
    ("misspelt-key-in-file", "SOLVER:\n  BASE_LRR: 0.1\n", "unknown config key SOLVER.BASE_LRR (did you mean SOLVER.BASE_LR?)"),
    ("misspelt-section-in-file", "SOLVR:\n  BASE_LR: 0.1\n", "unknown config key SOLVR"),
    ("wrong-type-in-file", "TRAIN:\n  IMS_PER_BATCH: two\n", "TRAIN.IMS_PER_BATCH must be int, got 'two'"),
    ("out-of-range-in-file", "SOLVER:\n  STEPS: [0, 30, 20]\n", "SOLVER.STEPS must be increasing"),
    ("binary-file", b"\x89PNG\r\n\x1a\n\x00\x00\xff", "cannot read config file {path}"),
    # a minute and 860 MB of YAML parsing for 50 MB (red team of 2026-12-03, second)
    ("huge-comment", "# " + "x" * (2 << 20) + "\n", "config file {path} is 2.0 MiB: a config is a few kB (at most 1 MiB)"),
]


@pytest.mark.parametrize("case, text, message", FILE_CASES, ids=_ids(FILE_CASES))
def test_bad_config_file(train, tmp_path, case, text, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_exit_2(train(config=path), message.format(path=path))


def test_bad_input_exit_status_seen_by_the_shell(tmp_path):
    """One real process: the status and the single line that a shell or a pipeline sees."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("SOLVER:\n  BASE_LR: -1\n")
    result = subprocess.run(trainer_cmd("TRACKING.ENABLED", "false", config=bad), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: SOLVER.BASE_LR must be > 0, got -1.0" or \
        result.stderr.strip().startswith("error: SOLVER.BASE_LR must be > 0")
    assert len(result.stderr.strip().splitlines()) == 1
    with open("/dev/full", "w") as full:  # a stderr that cannot take the line: still 2 (it was 1)
        no_room = subprocess.run(trainer_cmd("TRACKING.ENABLED", "false", config=bad), cwd=tmp_path,
                                 stdout=subprocess.DEVNULL, stderr=full, timeout=120)
    assert no_room.returncode == 2


def test_a_path_the_locale_cannot_decode_is_one_line_that_says_what_to_change(tmp_path):
    """`LC_ALL=C PYTHONUTF8=0` and a UTF-8 folder name: Python keeps its bytes as lone surrogates,
    and the line said `OUTPUT_DIR must be printable (no newline or control character)`."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    done = subprocess.run(trainer_cmd("--dry-run", "OUTPUT_DIR", str(tmp_path / "d\u00e9mo")), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: '{tmp_path}/d\\udcc3\\udca9mo' is not text in this locale's encoding (ascii): "
        "use a UTF-8 locale (LC_ALL=C.UTF-8) or PYTHONUTF8=1"]
    assert os.listdir(tmp_path) == []
    # The same in MLflow's variables: blamed on the tracking server, a store made (helper-61); the value is
    # not shown, as it may be a password.
    env["MLFLOW_EXPERIMENT_NAME"] = "d\u00e9mo"
    done = subprocess.run(trainer_cmd("--dry-run", "TRACKING.URI", f"sqlite:///{tmp_path / 'm.db'}"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: the value of MLFLOW_EXPERIMENT_NAME is not text in this locale's encoding (ascii): use a UTF-8 locale "
        "(LC_ALL=C.UTF-8) or PYTHONUTF8=1"], done.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_a_name_that_is_not_utf8_under_a_utf8_locale_is_said_to_be_the_names(tmp_path):
    """A Latin-1 file name (from an old archive) under LC_ALL=C.UTF-8: the line said to use a UTF-8
    locale, which this already was, so no setting could help. It now says the name is not valid
    UTF-8. Found by the red team of 2026-12-03 (second)."""
    env = {**os.environ, "LC_ALL": "C.UTF-8", "PYTHONUTF8": "1"}
    image = os.path.join(os.fsencode(tmp_path), b"caf\xe9.png")
    done = subprocess.run([sys.executable, "-m", "trainer", "predict", "--weights", "w", "--out", "o", image],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: '{tmp_path}/caf\\udce9.png' is not valid UTF-8, which tracktron needs of every name it is given: "
        "rename the file or folder (convmv -f latin1 -t utf8 does it)"]
    assert os.listdir(tmp_path) == []


def test_warnings_made_errors_are_named_and_the_folders_the_job_made_go(tmp_path, data_dir):
    """PYTHONWARNINGS=error turns a deprecation warning inside MLflow's client into an exception: it
    was reported as the tracking server's error. A job that stops before it wrote anything leaves no
    OUTPUT_DIR, nor the parents it made for it (`out/` of `out/demo` stayed)."""
    from tests.conftest import demo_overrides

    args = demo_overrides(tmp_path, data_dir, OUTPUT_DIR=tmp_path / "out" / "demo")
    done = subprocess.run(trainer_cmd(*args), cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "error"})
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: tracking store sqlite:///mlflow.db: a warning raised as an error (PYTHONWARNINGS")
    assert "Warning: " in last
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_output_dir_that_is_a_file(train, tmp_path, below):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("mine")
    out = blocker / below if below else blocker
    result = train("OUTPUT_DIR", str(out))
    assert_exit_2(result, f"cannot write to OUTPUT_DIR {out}: {blocker} is a file")
    assert blocker.read_text() == "mine"


# ---- datasets --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("good") / "shapes", num_images=4, image_size=64, seed=0)


def make_dataset(root: Path, good: Path, mutate) -> Path:
    shutil.copytree(good, root)
    ann = root / "annotations.json"
    data = json.loads(ann.read_text())
    if mutate(data, root) is not False:
        ann.write_text(json.dumps(data))
    return root


def _set(where: str, key: str, value, index: int = 0):
    def mutate(data, root):
        data[where][index][key] = value
    return mutate


def _each_ann(key: str, value):
    def mutate(data, root):
        for a in data["annotations"]:
            a[key] = value
    return mutate


def _write(text: str | bytes, name: str = "annotations.json"):
    def mutate(data, root):
        (root / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return False
    return mutate


def _unlink_first_image(data, root):
    (root / "images" / data["images"][0]["file_name"]).unlink()


def _garbage_images(data, root):
    for im in data["images"]:
        (root / "images" / im["file_name"]).write_bytes(b"this is not an image")


def _wrong_size(data, root):
    data["images"][0]["width"] += 1


DATASET_CASES = [
    ("json-truncated", lambda d, r: _write(json.dumps(d)[:-10])(d, r), "malformed annotation file {ann}: Expecting"),
    ("json-not-coco", _write("[1, 2, 3]"), "malformed annotation file {ann}: needs 'images' and 'categories' lists"),
    ("json-null", _write("null"), "malformed annotation file {ann}"),
    ("json-nested-too-deep", _write("[" * 100_000), "malformed annotation file {ann}: nested too deeply"),
    ("json-not-utf8", _write(b"\xff\xfe{\x00}\x00"), "cannot read annotation file {ann}"),
    ("annotation-file-missing", lambda d, r: (r / "annotations.json").unlink() or False,
     "annotation file not found"),
    ("image-folder-missing", lambda d, r: shutil.rmtree(r / "images"), "image folder not found"),
    ("image-missing", _unlink_first_image, "1 of 4 images listed in {ann} are missing from {root}/images, e.g. 000000.png"),
    ("images-unreadable", _garbage_images, "cannot decode image {root}/images/"),
    ("image-size-differs", _wrong_size, "but {ann} says 65x64"),
    ("image-entry-incomplete", lambda d, r: d["images"][0].pop("width"), "needs id, file_name, width and height"),
    ("image-height-zero", _set("images", "height", 0), "image 1 has width 64 and height 0; both must be positive integers"),
    ("image-width-string", _set("images", "width", "64"), "width '64'"),
    ("image-file-name-number", _set("images", "file_name", 5), "image 1 has file_name 5, not a file name"),
    ("image-id-list", _set("images", "id", [1]), "image id [1] is not a number or a string"),
    ("image-id-twice", lambda d, r: d["images"].append(dict(d["images"][0])), "image id 1 appears twice"),
    ("category-without-id", lambda d, r: d["categories"][0].pop("id"), "every category needs an id"),
    ("category-id-twice", lambda d, r: d["categories"].append(dict(d["categories"][0], name="again")),
     "{ann}: a category id appears twice"),
    ("annotations-not-a-list", lambda d, r: d.update(annotations={"1": d["annotations"][0]}),
     "malformed annotation file {ann}: 'annotations' must be a list (COCO format)"),
    ("no-images", lambda d, r: d.update(images=[], annotations=[]), "{ann} lists no images"),
    ("unknown-category-id", _set("annotations", "category_id", 99),
     "annotation 1 has category_id 99, not among the categories [1, 2, 3]"),
    ("unknown-image-id", _set("annotations", "image_id", 99), "annotation 1 refers to unknown image_id 99"),
    ("annotation-not-an-object", lambda d, r: d["annotations"].append(5), "annotation entry 5 is not an object"),
    ("bbox-missing", lambda d, r: d["annotations"][0].pop("bbox"), "annotation 1 has no [x, y, w, h] bbox"),
    ("bbox-three-numbers", _set("annotations", "bbox", [1, 2, 3]), "annotation 1 has no [x, y, w, h] bbox"),
    ("bbox-not-numbers", _set("annotations", "bbox", ["a", 1, 2, 3]), "x, y, w, h must be finite numbers"),
    ("bbox-null", _set("annotations", "bbox", [None, 1, 2, 3]), "x, y, w, h must be finite numbers"),
    ("bbox-nan", _set("annotations", "bbox", [float("nan"), 1, 2, 3]), "x, y, w, h must be finite numbers"),
    ("area-not-a-number", _set("annotations", "area", "big"), "annotation 1 has area 'big', not a number"),
    ("iscrowd-not-0-or-1", _set("annotations", "iscrowd", "yes"), "iscrowd 'yes'; it must be 0 or 1"),
    ("no-annotations", lambda d, r: d.update(annotations=[]), "{ann} has no usable annotation"),
    ("every-box-zero-size", _each_ann("bbox", [3, 3, 0, 0]), "{ann} has no usable annotation"),
    ("every-box-negative-size", _each_ann("bbox", [30, 30, -5, -5]), "{ann} has no usable annotation"),
    ("every-box-outside-its-image", _each_ann("bbox", [500, 500, 5, 5]), "{ann} has no usable annotation"),
    ("every-annotation-crowd", _each_ann("iscrowd", 1), "{ann} has no usable annotation"),
]


@pytest.mark.parametrize("case, mutate, message", DATASET_CASES, ids=_ids(DATASET_CASES))
def test_bad_dataset(train, tmp_path, good_dataset, case, mutate, message):
    root = make_dataset(tmp_path / "data", good_dataset, mutate)
    result = train("TRAIN.DATASETS", f"('{root}',)")
    assert_exit_2(result, message.format(ann=root / "annotations.json", root=root))
    assert not list((tmp_path / "output").glob("*.pth"))


def test_a_set_with_no_usable_box_says_how_many_are_crowd_and_how_many_empty(train, tmp_path, good_dataset):
    """CVAT exports brush masks as crowd: the line counts each kind, and says crowd is never trained."""
    def mutate(data, root):
        for i, a in enumerate(data["annotations"]):
            a.update(iscrowd=1) if i % 2 else a.update(bbox=[3, 3, 0, 0])

    root = make_dataset(tmp_path / "data", good_dataset, mutate)
    n = len(json.loads((root / "annotations.json").read_text())["annotations"])
    result = train("TRAIN.DATASETS", f"('{root}',)")
    assert_exit_2(result, f"{root / 'annotations.json'} has no usable annotation: of its {n} boxes, {n // 2} are crowd "
                          f"(iscrowd 1, never trained: set 0 for single objects) and {n - n // 2} empty or outside their image")


def test_unreadable_image_found_in_a_loader_worker_is_one_line(train, tmp_path, good_dataset):
    root = make_dataset(tmp_path / "data", good_dataset, _garbage_images)
    result = train("TRAIN.DATASETS", f"('{root}',)", "DATA_LOADER.NUM_THREADS", "1")
    assert_exit_2(result, f"cannot decode image {root}/images/")


def test_degenerate_and_out_of_image_boxes_are_dropped_or_clipped_and_training_goes_on(train, tmp_path,
                                                                                        good_dataset, caplog):
    """Not errors: empty boxes are dropped, boxes reaching outside are clipped, with a logged count."""
    def mutate(data, root):
        extra = [[5, 5, 0, 10], [5, 5, 10, 0], [20, 20, -4, 6],  # zero and negative size: dropped
                 [500, 500, 8, 8],  # wholly outside its 64x64 image: dropped
                 # no width in float32 (62 + 1e-6 is 62): torchvision's assertion at iteration 0 (helper-47)
                 [62, 32, 1e-6, 38], [0, 0, 1e-30, 1e-30],
                 [-10, -10, 30, 30], [50, 50, 40, 40]]  # partly outside: clipped, kept
        next_id = max(a["id"] for a in data["annotations"]) + 1
        for i, bbox in enumerate(extra):
            data["annotations"].append({"id": next_id + i, "image_id": data["images"][0]["id"], "category_id": 1,
                                        "bbox": bbox, "area": 1.0, "iscrowd": 0})

    root = make_dataset(tmp_path / "data", good_dataset, mutate)
    result = train("TRAIN.DATASETS", f"('{root}',)")
    assert result.code is None, result.stderr[-2000:]
    assert "dropped 0 crowd and 6 empty boxes; 0 of 4 images have no usable box" in result.stderr
    assert (tmp_path / "output" / "model_final.pth").is_file()

    from trainer.data import CocoDetection

    ds = CocoDetection(root / "images", root / "annotations.json")
    boxes = ds[0][1]["boxes"].tolist()
    assert [0.0, 0.0, 20.0, 20.0] in boxes and [50.0, 50.0, 64.0, 64.0] in boxes  # clipped to the image


# ---- keypoints and RLE masks: checked when the model uses them --------------------------------------
# helper-94's red team; the synthetic set's annotations have 4 keypoints (all visible) and polygons, on 64x64 images.

def _visibility(value):
    def mutate(data, root):
        data["annotations"][0]["keypoints"][2] = value
    return mutate


KEYPOINT_CASES = [
    ("not-a-multiple-of-3", _set("annotations", "keypoints", [1, 2, 2, 3, 4]),
     "annotation 1 has keypoints [1, 2, 2, 3, 4]: a flat list of x, y, visibility numbers"),
    ("fewer-than-the-categories-name", _set("annotations", "keypoints", [1, 2, 2, 3, 4, 2]),
     "annotation 1 has 2 keypoints; its categories name 4"),
    ("strings", _set("annotations", "keypoints", ["1", 2, 2] * 4), "a flat list of x, y, visibility numbers"),
    ("points-as-lists", _set("annotations", "keypoints", [[1, 2, 2]] * 4), "a flat list of x, y, visibility numbers"),
    ("an-object", _set("annotations", "keypoints", {"top": [1, 2, 2]}), "a flat list of x, y, visibility numbers"),
    # each was trained and scored as labelled (v > 0) or not without a word
    ("visibility-5", _visibility(5),
     "annotation 1 has keypoint visibility 5; COCO's are 0 (not labelled), 1 (labelled, hidden) or 2 (visible)"),
    ("visibility-minus-1", _visibility(-1), "annotation 1 has keypoint visibility -1; COCO's are 0"),
    ("visibility-a-score", _visibility(0.5), "annotation 1 has keypoint visibility 0.5; COCO's are 0"),
]


@pytest.mark.parametrize("case, mutate, message", KEYPOINT_CASES, ids=_ids(KEYPOINT_CASES))
def test_bad_keypoints_for_a_keypoint_model(train, tmp_path, good_dataset, case, mutate, message):
    root = make_dataset(tmp_path / "data", good_dataset, mutate)
    result = train("TRAIN.DATASETS", f"('{root}',)", "MODEL.TYPE", "keypointrcnn_resnet50_fpn")
    assert_exit_2(result, message)
    assert result.last_line.startswith(f"error: {root / 'annotations.json'}: annotation 1 has "), result.last_line
    assert not list((tmp_path / "output").glob("*.pth"))


def test_a_num_keypoints_that_disagrees_with_the_points_is_counted_again(train, tmp_path, good_dataset):
    """COCO's num_keypoints is derived data (COCOeval ignores an object whose count is 0): a wrong or
    missing one is counted again from the visibilities, a string too; visibilities 2.0 are 2."""
    def mutate(data, root):
        data["annotations"][0].update(num_keypoints="four")
        data["annotations"][1].update(num_keypoints=0)
        data["annotations"][2].pop("num_keypoints")

    root = make_dataset(tmp_path / "data", good_dataset, mutate)
    result = train("TRAIN.DATASETS", f"('{root}',)", "MODEL.TYPE", "keypointrcnn_resnet50_fpn")
    assert result.code is None, result.stderr[-2000:]
    from trainer.data import CocoDetection

    ds = CocoDetection(root / "images", root / "annotations.json", train=False, keypoints=True)
    assert [ds.coco.anns[i]["num_keypoints"] for i in (1, 2, 3)] == [4, 4, 4]


FULL_32 = "0PP1"  # pycocotools' compressed counts of a full 32x32 mask (runs 0 and 1024)
RLE_CASES = [
    ("size-not-its-images", {"size": [32, 64], "counts": [2048]},
     "annotation 1 has an RLE mask of size [32, 64] on an image of 64x64 (height x width)"),
    ("size-of-three", {"size": [64, 64, 3], "counts": [4096]}, "has an RLE mask of size [64, 64, 3] on an image of 64x64"),
    ("size-strings", {"size": ["64", "64"], "counts": [4096]}, "has an RLE mask of size ['64', '64'] on an image of 64x64"),
    ("no-size", {"counts": [4096]}, "polygons (lists of numbers) or RLE ({'counts', 'size'}) expected"),
    ("counts-short-of-the-image", {"size": [64, 64], "counts": [100, 20]},
     "annotation 1 has an RLE mask whose counts cover 120 pixels, not the 64x64 of its image"),
    ("counts-past-the-image", {"size": [64, 64], "counts": [4000, 200]}, "whose counts cover 4200 pixels, not the 64x64"),
    ("compressed-counts-of-another-size", {"size": [64, 64], "counts": FULL_32},
     "whose counts cover 1024 pixels, not the 64x64 of its image"),
    ("compressed-counts-empty", {"size": [64, 64], "counts": ""}, "whose counts cover 0 pixels"),
    ("counts-not-integers", {"size": [64, 64], "counts": [4000.0, 96.0]}, "polygons (lists of numbers) or RLE"),
    ("counts-negative", {"size": [64, 64], "counts": [5000, -904]}, "polygons (lists of numbers) or RLE"),
    ("counts-a-list-of-strings", {"size": [64, 64], "counts": [FULL_32]}, "polygons (lists of numbers) or RLE"),
]


@pytest.mark.parametrize("case, segmentation, message", RLE_CASES, ids=_ids(RLE_CASES))
def test_bad_rle_masks_for_a_mask_model(train, tmp_path, good_dataset, case, segmentation, message):
    root = make_dataset(tmp_path / "data", good_dataset, _set("annotations", "segmentation", segmentation))
    result = train("TRAIN.DATASETS", f"('{root}',)", "MODEL.TYPE", "maskrcnn_resnet50_fpn")
    assert_exit_2(result, message)
    assert result.last_line.startswith(f"error: {root / 'annotations.json'}: annotation 1 has "), result.last_line
    assert not list((tmp_path / "output").glob("*.pth"))


# ---- tracking -------------------------------------------------------------------------------------

def test_run_id_that_does_not_exist_on_a_tracking_server(train, mlflow_server):
    result = train("TRACKING.URI", mlflow_server.url, "--resume", "0" * 32, tracking=True)
    assert_exit_2(result, f"error: run {'0' * 32} does not exist on {mlflow_server.url}")


def test_malformed_run_id_is_one_line(train, mlflow_server):
    result = train("TRACKING.URI", mlflow_server.url, "--resume", "not a run id", tracking=True)
    assert_exit_2(result, "not a run id")


@pytest.mark.parametrize("uri", ["ftp://example.org/mlflow", "file:///tmp/mlruns-not-supported"])
def test_unsupported_tracking_uri_is_one_line(train, uri):
    result = train("TRACKING.URI", uri, tracking=True)
    assert_exit_2(result, uri)


NO_DATABASE = "is not an MLflow tracking store (file is not a database)"
STORE_FILES = [  # (id, how the file is made, the words of the one line)
    ("random-bytes", lambda p: p.write_bytes(bytes(range(256)) * 20), NO_DATABASE),
    ("a-text-file", lambda p: p.write_text("experiments, runs\n" * 100), NO_DATABASE),
    ("an-sqlite-header-then-garbage", lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\xff" * 2000), NO_DATABASE),
    ("an-empty-file", lambda p: p.touch(), "is not an MLflow tracking store (it has no MLflow tables)"),
    ("a-folder", lambda p: p.mkdir(), "is a folder or a device, not a database file"),
    ("unreadable", lambda p: (p.write_bytes(b"x" * 100), p.chmod(0)), "cannot read the tracking store"),
    # status said "(... does not exist)" and the job "unable to open database file" after its lock was made (helper-94)
    ("a-link-to-itself", lambda p: p.symlink_to(p.name), "is a link to mlflow.db, which leads back to itself"),
]


@pytest.mark.parametrize("case, make, message", STORE_FILES, ids=_ids(STORE_FILES))
def test_a_store_file_that_is_no_database_is_one_line_and_left_as_it_was(train, tmp_path, case, make, message):
    """helper-94's red team: TRACKING.URI (and status --uri) naming a file that is there but no database.
    MLflow would create its tables in it, or retry opening it for minutes; the job, its plan and status
    say so in one line, and nothing is written beside it."""
    if case == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    folder = tmp_path / "stores"
    folder.mkdir()
    store = folder / "mlflow.db"
    make(store)
    before = store.read_bytes() if store.is_file() and case != "unreadable" else None
    uri = f"sqlite:///{store}"
    for result in (train("TRACKING.URI", uri, tracking=True), train("--dry-run", "TRACKING.URI", uri, tracking=True),
                   run_cli(["status", "--uri", uri])):
        assert_exit_2(result, message)
        assert str(store) in result.last_line
    assert before is None or store.read_bytes() == before
    assert [p.name for p in folder.iterdir()] == ["mlflow.db"]  # no lock beside it
    assert not (tmp_path / "output").exists() and not (tmp_path / "mlruns").exists()


# ---- property: random overrides never give a traceback --------------------------------------------

_SECTIONS = sorted({k.split(".")[0] for k in _ALL_KEYS})
_TRICKY = ["", " ", "[", "]", "(", "()", "{}", "{[1]: 2}", "[[1]]", "(1,", "1e400", "-1e400", ".nan", ".inf",
           "~", "null", "yes", "no", "0x10", "0o7", "1_000", "2024-01-01", "!!python/object:os.system", "&a", "*a",
           "'", '"', "\\", "\x00", "%", "{a: [1, {b: 2}]}", "[" * 50, "(" * 30 + ")" * 30, "1" * 400, "-0", "+1",
           "True", "False", "None", "[1, 'a']", "('a', 'b')", "{1, 2}", "b'x'", "1j", "lambda: 0", "--help"]
_keys = st.one_of(st.sampled_from(_ALL_KEYS), st.sampled_from(_SECTIONS),
                  st.sampled_from(["DATASET_CATALOG.x", "DATASET_CATALOG.x.IM_DIR", "DATASET_CATALOG.x.y.z"]),
                  st.text(max_size=20))
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)
_values = st.one_of(st.sampled_from(_TRICKY), st.text(max_size=30), st.integers().map(str),
                    st.floats().map(repr), _json.map(json.dumps), _json.map(repr))
_overrides = st.lists(st.tuples(_keys, _values), max_size=4).map(lambda kv: [x for pair in kv for x in pair])


def _no_training(*args, **kwargs):
    return None


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 300)), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(opts=_overrides, drop_last=st.booleans())
@example(opts=["TRAIN.SCALES", "{[1]: 2}"], drop_last=False)
@example(opts=["DATASET_CATALOG.a", "1", "DATASET_CATALOG.a.b", "2"], drop_last=False)
def test_random_overrides_never_give_a_traceback(opts, drop_last, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a random OUTPUT_DIR is made here, not in the checkout
    opts = opts[:-1] if drop_last and opts else opts
    # The config layer: a Config or a one-line UserError, nothing else.
    try:
        load_config(DEMO, opts)
    except UserError as e:
        assert "\n" not in str(e) and str(e)
    # The CLI: exit 2 with an `error:` line, or on to training (stubbed out), never a traceback.
    with mock.patch.object(launch, "_train", _no_training), \
            mock.patch("trainer.tracking.create_tracker", lambda *a, **k: mock.MagicMock()), \
            mock.patch("trainer.tracking.system_metrics.start_monitor", lambda *a, **k: None):
        result = run_cli(["train", "--config", str(DEMO), *opts])
    assert result.code in (None, 0, 2), result.stderr[-1000:]
    if result.code == 2:
        assert "Traceback" not in result.stderr
        assert result.last_line.startswith(("error: ", "Error: ")), result.last_line
        assert result.last_line.isprintable(), result.last_line


# ---- property: a damaged annotation file is a UserError or a usable dataset -----------------------

_FIELDS = {"images": ["id", "file_name", "width", "height"],
           "annotations": ["id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation", "keypoints"],
           "categories": ["id", "name", "keypoints"]}
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=6))
_any_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
    st.sampled_from(["counts", "size", "x"]), inner, max_size=2), max_leaves=10)
_edit = st.tuples(st.sampled_from(sorted(_FIELDS)), st.integers(0, 20), st.data())


@pytest.fixture(scope="module")
def tiny_coco(tmp_path_factory) -> tuple[Path, dict]:
    root = write_synthetic_dataset(tmp_path_factory.mktemp("fuzz") / "shapes", num_images=3, image_size=32, seed=2)
    return root, json.loads((root / "annotations.json").read_text())


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 200)), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_edit, min_size=1, max_size=3), drop=st.booleans())
def test_damaged_annotations_are_a_user_error_or_a_usable_dataset(tiny_coco, tmp_path_factory, edits, drop):
    from trainer.data import CocoDetection

    root, original = tiny_coco
    data = json.loads(json.dumps(original))
    for section, index, draw in edits:
        entries = data[section]
        if not entries:
            continue
        entry = entries[index % len(entries)]
        field = draw.draw(st.sampled_from(_FIELDS[section]))
        if drop:
            entry.pop(field, None)
        else:
            entry[field] = draw.draw(_any_value)
    folder = tmp_path_factory.mktemp("case")
    ann = folder / "annotations.json"
    ann.write_text(json.dumps(data))
    try:
        ds = CocoDetection(root / "images", ann, train=True, masks=True, keypoints=True)
        for i in range(len(ds)):
            ds[(i, i % 2 == 1)]
    except UserError as e:
        assert "\n" not in str(e)


# ---- found by an adversarial pass (this wave): each was a traceback ---------------------------------------

def _dangling(tmp_path):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere" / "at-all")
    return str(link)


def _loop(tmp_path):
    (tmp_path / "l1").symlink_to(tmp_path / "l2")
    (tmp_path / "l2").symlink_to(tmp_path / "l1")
    return str(tmp_path / "l1")


@pytest.mark.parametrize("case, opts, env, message", [
    ("output-dir-dangling-symlink", lambda t: ["OUTPUT_DIR", _dangling(t)], {}, "cannot make OUTPUT_DIR"),
    ("output-dir-dangling-symlink-dry-run", lambda t: ["--dry-run", "OUTPUT_DIR", _dangling(t)], {},
     "which does not exist"),  # --dry-run said all was well
    ("output-dir-symlink-loop", lambda t: ["OUTPUT_DIR", _loop(t)], {},
     "is a link to {t}/l2, links that lead back to themselves"),  # said l2 "does not exist"
    ("output-dir-in-proc", lambda t: ["OUTPUT_DIR", "/proc/tracktron-out"], {}, "OUTPUT_DIR /proc/tracktron-out"),
    ("tracking-uri-broken-ipv6", lambda t: ["TRACKING.URI", "http://[::1"], {}, "is not a URL"),
    ("torchrun-superscript-digit", lambda t: [], {"RANK": "1\u00b2"}, "torchrun environment: RANK="),
])
def test_inputs_from_the_adversarial_pass_are_one_line(tmp_path, monkeypatch, case, opts, env, message):
    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    result = run_cli(["train", "--config", str(DEMO), "DATA_DIR", str(tmp_path / "data"), *opts(tmp_path)])
    assert_exit_2(result, message.format(t=tmp_path))


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_lock_file_that_is_not_ours_is_refused_and_nothing_is_written_through_it(tmp_path, monkeypatch, kind):
    """OUTPUT_DIR/.lock a link to another file: the lock was truncated and written through the link
    (the file's content replaced by `host ..., pid ...`), even by a job then refused for a bad dataset.
    Found by the red team of 2026-12-02."""
    monkeypatch.chdir(tmp_path)
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    {"link": lambda p: p.symlink_to(victim), "fifo": os.mkfifo, "folder": Path.mkdir}[kind](out / ".lock")
    for extra in (["--dry-run"], []):
        result = run_cli(["train", *extra, "--config", str(DEMO), "DATA_DIR", str(tmp_path / "data"),
                          "OUTPUT_DIR", str(out), "TRACKING.ENABLED", "false", "TRAIN.DATASETS", "('nope',)"])
        assert_exit_2(result, f"{out / '.lock'} is not the lock file tracktron keeps in OUTPUT_DIR")
    assert victim.read_text() == "precious\n" and sorted(p.name for p in out.iterdir()) == [".lock"]


def test_synth_into_an_unwritable_place_or_with_a_negative_seed_is_one_line(tmp_path):
    result = run_cli(["data", "synth", "--out", "/proc/tracktron-synth"])
    assert_exit_2(result, "cannot write the synthetic dataset to /proc/tracktron-synth")
    result = run_cli(["data", "synth", "--out", str(tmp_path / "s"), "--seed", "-1"])
    assert result.code == 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("case, opts, message", [
    ("in-memory-store", ["TRACKING.URI", "sqlite://"], "names no database file (sqlite:// alone, or :memory:, is in memory"),
    # passed, then every call failed (no such table): exit 1 after FLUSH_TIMEOUT_S, ./:memory:.lock left (helper-47)
    ("in-memory-store-named", ["TRACKING.URI", "sqlite:///:memory:"], "names no database file"),
    ("store-folder-missing", ["TRACKING.URI", "sqlite:////nonexistent-tracktron/dir/x.db"],
     "the folder /nonexistent-tracktron/dir does not exist"),
])
def test_tracking_stores_that_cannot_hold_the_job_are_one_line(tmp_path, monkeypatch, case, opts, message):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["train", "--config", str(DEMO), "DATA_DIR", str(tmp_path / "data"), *opts])
    assert_exit_2(result, message)
    assert not Path("/nonexistent-tracktron").exists()  # no folder made for it
    assert [p.name for p in tmp_path.iterdir() if p.name != "data"] == []  # no lock beside a store, no OUTPUT_DIR


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_a_store_that_is_a_link_into_a_folder_not_there_is_one_line(tmp_path, monkeypatch, data_dir, dry_run):
    """mlflow.db a link to a shared volume that is not mounted: --dry-run planned `a new store`, and the job
    said `tracking server sqlite:///...: (sqlite3.OperationalError) unable to open database file` and left
    mlflow.db.lock beside the link. Found by helper-94's red team."""
    monkeypatch.chdir(tmp_path)
    link = tmp_path / "mlflow.db"
    link.symlink_to("/nonexistent-tracktron/shared/mlflow.db")
    result = run_cli(["train", *(["--dry-run"] if dry_run else []), "--config", str(DEMO), "DATA_DIR", str(data_dir),
                      "TRACKING.URI", f"sqlite:///{link}"])
    assert_exit_2(result, f"error: tracking URI sqlite:///{link}: the folder /nonexistent-tracktron/shared does not exist "
                          f"({link} is a link into it)")
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]  # no lock beside it, no OUTPUT_DIR
    assert not Path("/nonexistent-tracktron").exists()


@pytest.fixture
def read_only_folder(tmp_path):
    yield from tmpfs_mount(tmp_path / "ro")


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_a_new_store_in_a_read_only_folder_is_one_line_in_the_plan_too(tmp_path, monkeypatch, read_only_folder,
                                                                        dry_run):
    """--dry-run said `a new store, experiment demo, a new run` where the job exits 2."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(["train", *(["--dry-run"] if dry_run else []), "--config", str(DEMO), "DATA_DIR",
                      str(tmp_path / "data"), "TRACKING.URI", f"sqlite:///{read_only_folder}/m.db"])
    assert_exit_2(result, f"the store cannot be made in {read_only_folder} (a read-only file system")
    assert not (tmp_path / "output").exists()


def test_clicks_own_usage_errors_are_one_line_too(tmp_path):
    result = run_cli(["train", "--config", str(tmp_path)])  # a folder
    assert_exit_2(result, "Invalid value for '--config'")
    assert result.stderr.strip().count("\n") == 0, result.stderr
    result = run_cli(["data", "synth", "--out", str(tmp_path / "s"), "--num-images", "0"])
    assert_exit_2(result, "Invalid value for '--num-images'")


def test_synth_over_an_existing_dataset_says_nothing_was_written(tmp_path):
    assert run_cli(["data", "synth", "--out", str(tmp_path / "s"), "--num-images", "2", "--size", "32"]).code is None
    before = sorted(p.name for p in (tmp_path / "s" / "images").iterdir())
    again = run_cli(["data", "synth", "--out", str(tmp_path / "s"), "--num-images", "5", "--size", "32"])
    assert again.code is None and "already holds a dataset (annotations.json): nothing written" in again.stdout
    assert sorted(p.name for p in (tmp_path / "s" / "images").iterdir()) == before


def test_a_password_in_a_dataset_path_is_not_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["train", "--config", str(DEMO), "TRAIN.DATASETS", "('https://trainer:Hunter2Secret@data.example/ds',)",
                      "TRACKING.ENABLED", "false"])
    assert result.code == 2 and "Hunter2Secret" not in result.stderr + result.stdout, result.stderr


def test_an_eoferror_is_a_fault_not_a_ctrl_c(monkeypatch):
    """click turns an EOFError (a loader worker's queue cut short, a short read) into Abort, which
    the CLI reported as Ctrl-C: exit 130 and an empty last line, the error itself never shown."""
    import trainer.status

    def cut_short(*args, **kwargs):
        raise EOFError("Ran out of input")

    monkeypatch.setattr(trainer.status, "job_rows", cut_short)
    with pytest.raises(EOFError, match="Ran out of input"):
        cli.main(["status"])


BIG_NUMBERS = [
    # (id, overrides, the same in a file, the one line)
    ("float-key-too-large", ["SOLVER.BASE_LR", "1" * 400], "SOLVER:\n  BASE_LR: " + "1" * 400,
     "error: SOLVER.BASE_LR is out of range: larger than a float holds (1.8e+308)"),  # was OverflowError
    ("list-item-too-large", ["SOLVER.LRS", f"[{'1' * 400}]"], f"SOLVER:\n  LRS: [{'1' * 400}]",
     "error: SOLVER.LRS[0] is out of range: larger than a float holds (1.8e+308)"),
    ("past-4300-digits", ["SOLVER.MAX_ITER", "1" * 5000], "SOLVER:\n  MAX_ITER: " + "1" * 5000,
     "a 5,000-digit number is out of range for any config key"),  # was ValueError: Exceeds the limit (4300 digits)
]


@pytest.mark.parametrize("case, opts, text, message", BIG_NUMBERS, ids=_ids(BIG_NUMBERS))
def test_numbers_too_large_for_python_are_one_line(train, tmp_path, case, opts, text, message):
    assert_exit_2(train(*opts), message)
    path = tmp_path / "big.yaml"
    path.write_text(text + "\n")
    assert_exit_2(train(config=path), message.removeprefix("error: "))
    assert not (tmp_path / "output").exists()


@pytest.mark.parametrize("opts, message", [
    (["SOLVER.LR_POLICY", "step", "SOLVER.GAMMA", "1e300", "SOLVER.STEP_SIZE", "1", "SOLVER.MAX_ITER", "10"],
     "error: SOLVER.GAMMA 1e+300 makes the learning rate overflow at iteration 1 (step)"),  # was OverflowError
    (["SOLVER.BASE_LR", "1e39", "SOLVER.WARM_UP_ITERS", "0"],  # was exit 0, training at inf
     "error: SOLVER.BASE_LR 1e+39 makes the learning rate overflow at iteration 0 (steps_with_decay)"),
], ids=["gamma-1e300", "base-lr-1e39"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_learning_rate_that_overflows_is_one_line_before_any_run(train, tmp_path, opts, message, dry_run):
    """A traceback in --dry-run; without it, a traceback and a FAILED run in the tracking store."""
    assert_exit_2(train(*opts, *(["--dry-run"] if dry_run else []), tracking=True), message)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "output").exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_an_experiment_name_mlflow_refuses_is_one_line_and_no_store(train, tmp_path, dry_run):
    """10,000 characters: --dry-run said all was well; the job failed after making a new mlflow.db."""
    (tmp_path / "n2").mkdir()
    result = train("TRACKING.EXPERIMENT", "e" * 10000, "TRACKING.URI", f"sqlite:///{tmp_path / 'n2' / 'mlflow.db'}",
                   *(["--dry-run"] if dry_run else []), tracking=True)
    assert_exit_2(result, "error: TRACKING.EXPERIMENT is 10,000 characters; MLflow takes an experiment name of at most 500")
    assert list((tmp_path / "n2").iterdir()) == []


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("location", ["mlflow-artifacts:/1", "MLflow-Artifacts:/1"])  # MLflow reads either (helper-74)
def test_a_job_on_a_servers_store_whose_experiment_keeps_its_artifacts_on_the_server_is_refused(train, tmp_path, dry_run,
                                                                                                location):
    """helper-72's red team: `mlflow server` on sqlite:///mlflow.db made the experiment (artifacts at
    `mlflow-artifacts:/1`), and a job used the file itself, as README's default URI does: it trained
    to the end with every upload failing, waited out FLUSH_TIMEOUT_S and exited 1, as did every rerun."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    client.create_experiment("served", artifact_location=location)
    result = train("TRACKING.URI", uri, "TRACKING.EXPERIMENT", "served", *(["--dry-run"] if dry_run else []),
                   tracking=True)
    assert_exit_2(result, f"error: experiment served keeps its artifacts on an mlflow server ({location}), "
                          "which this job reaches only through that server: set TRACKING.URI to its http:// address, "
                          "not to its store")
    assert client.search_runs([client.get_experiment_by_name("served").experiment_id]) == []
    assert not (tmp_path / "output").exists()


def test_synth_refuses_more_images_than_a_disk_holds(tmp_path, monkeypatch):
    """--num-images 99999999999999999999999 started writing, without end."""
    def write(*args, **kwargs):
        raise AssertionError("started writing")

    monkeypatch.setattr("trainer.data.synth.write_synthetic_dataset", write)
    result = run_cli(["data", "synth", "--out", str(tmp_path / "s"), "--num-images", "99999999999999999999999"])
    assert_exit_2(result, "Invalid value for '--num-images': 99999999999999999999999 is not in the range 1<=x<=1000000")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("target", ["dangling", "device"])
def test_synth_into_no_folder_is_refused_before_any_image(tmp_path, monkeypatch, target):
    """`--out` a link to nothing or /dev/null: every image was drawn (11 s for 300), then the rename
    failed with a NotADirectoryError traceback; /dev/null's were drawn into /dev. Found by the red
    team of 2026-12-03 (second)."""
    def draw(*args, **kwargs):
        raise AssertionError("started drawing")

    monkeypatch.setattr("trainer.data.synth._write", draw)
    out = {"dangling": tmp_path / "dangling", "device": Path("/dev/null")}[target]
    if target == "dangling":
        out.symlink_to(tmp_path / "nowhere")
    result = run_cli(["data", "synth", "--out", str(out), "--num-images", "300"])
    assert_exit_2(result, f"cannot write the synthetic dataset to {out}: it is no folder")
    assert not (tmp_path / "nowhere").exists() and not list(Path("/dev").glob(".null.tmp-*"))


def test_synth_and_predict_out_are_named_alike_printable_with_the_home_expanded(tmp_path, monkeypatch):
    """`data synth --out` made a folder with a newline in its name (OUTPUT_DIR refuses one), a literal
    `./~` folder for `~/x` (predict expands it), and said `. exists but holds no annotations.json`
    for ''. Found by the red team of 2026-12-03 (second)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for command in (["data", "synth"], ["predict", "--weights", "w", "IMAGE"]):
        result = run_cli([*command, "--out", "nl\nname"])
        assert_exit_2(result, "--out must be printable (no newline or control character), got 'nl\\nname'")
        assert_exit_2(run_cli([*command, "--out", ""]), "--out must name a folder, got an empty value")
    made = run_cli(["data", "synth", "--out", "~/shapes", "--num-images", "2", "--size", "32"])
    assert made.code is None, made.stderr
    assert (tmp_path / "home" / "shapes" / "annotations.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]


def test_synth_that_cannot_fit_on_the_disk_is_refused_and_a_full_disk_is_one_line(tmp_path):
    """A million 4096 px images (37 TB) started writing; a full disk ended in a PIL traceback. Now the
    count and size are held against the free space first, and a write that fails is one line (here
    a 1 MiB file size limit: EFBIG, as a full disk's ENOSPC). Found by the red team of 2026-12-03 (second)."""
    huge = run_cli(["data", "synth", "--out", str(tmp_path / "huge"), "--num-images", "1000000", "--size", "4096"])
    assert_exit_2(huge, "the synthetic dataset of 1,000,000 images of 4096 px needs at least 23437.5 GiB; ")
    assert not (tmp_path / "huge").exists()
    limited = subprocess.run(
        ["bash", "-c", f'ulimit -f 1024; exec "$0" -m trainer data synth --out {tmp_path / "big"} --num-images 3 '
                       "--size 1024", sys.executable], capture_output=True, text=True, timeout=300)
    assert limited.returncode == 2 and "Traceback" not in limited.stderr, limited.stderr[-2000:]
    assert limited.stderr.strip().splitlines()[-1].startswith(
        f"error: cannot write the synthetic dataset to {tmp_path / 'big'}: File too large ("), limited.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, shown", [
    (["train", "--config", str(DEMO), "DATA_DIR", "~nobody-here-x9/data"], "DATA_DIR ~nobody-here-x9/data"),
    (["train", "--config", str(DEMO), "TRAIN.DATASETS", "('~nobody-here-x9/set',)"], "dataset ~nobody-here-x9/set"),
    (["eval", "--config", str(DEMO), "--weights", "~nobody-here-x9/m.pth"], "--weights ~nobody-here-x9/m.pth"),
    (["predict", "--weights", "~nobody-here-x9/m.pth", "--out", "o", "IMAGE"], "--weights ~nobody-here-x9/m.pth"),
    (["predict", "--weights", "w", "--out", "~nobody-here-x9/o", "IMAGE"], "--out ~nobody-here-x9/o"),
])
def test_a_tilde_of_a_user_that_does_not_exist_is_one_line(tmp_path, monkeypatch, data_dir, argv, shown):
    """pathlib cannot expand the home of a user the system does not know: a RuntimeError traceback."""
    monkeypatch.chdir(tmp_path)
    image = next((data_dir / "synth_shapes" / "val").rglob("*.png"))
    argv = [str(image) if a == "IMAGE" else a for a in argv]
    if argv[0] != "predict" and "DATA_DIR" not in argv:
        argv += ["DATA_DIR", str(data_dir)]
    result = run_cli(argv + (["TRACKING.ENABLED", "false"] if argv[0] == "train" else []))
    assert result.code == 2, result.stderr[-2000:]
    assert result.last_line == f"error: {shown}: no home folder is known for ~nobody-here-x9", result.stderr[-2000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [
    ["eval", "--config", str(DEMO), "--weights", "", "DATA_DIR", "data"],
    ["eval", "--config", str(DEMO), "--weights", "  ", "DATA_DIR", "data"],
    ["predict", "--weights", "", "--out", "o", "IMAGE"],
], ids=["eval", "eval-blank", "predict"])
def test_an_empty_weights_is_one_line_that_says_so_before_anything_is_made(tmp_path, monkeypatch, data_dir, argv):
    """--weights "$WEIGHTS" with the variable unset. `predict` read "" as the working folder and said it was
    "neither a checkpoint nor a tracktron model"; `eval` generated the synthetic test set first (helper-91's
    coverage run)."""
    monkeypatch.chdir(tmp_path)
    image = next((data_dir / "synth_shapes" / "val").rglob("*.png"))
    result = run_cli([str(image) if a == "IMAGE" else a for a in argv])
    assert_exit_2(result, "error: --weights is empty: give a checkpoint path, a model folder, ")
    assert not list(tmp_path.iterdir())  # no OUT, no DATA_DIR with a test set made in it


def test_a_config_that_is_the_output_dirs_own_config_yaml_is_refused_and_kept(train, tmp_path):
    """--config OUTPUT_DIR/config.yaml (a job rerun from its output's config): the job wrote its
    resolved config over the file, its comments gone and the password in its URI as ***. Found by
    the red team of 2026-12-03."""
    mine = tmp_path / "output" / "config.yaml"
    mine.parent.mkdir()
    mine.write_text(DEMO.read_text() + "\n# my notes\n")
    before = mine.read_bytes()
    assert_exit_2(train(config=mine), f"--config {mine} is the file this job writes its resolved config to "
                                      "(OUTPUT_DIR/config.yaml): copy it elsewhere and give that copy")
    assert mine.read_bytes() == before and sorted(p.name for p in mine.parent.iterdir()) == ["config.yaml"]


def test_opts_given_twice_add_up_in_order_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """A second --opts silently replaced the first (click keeps the last value of an option): a
    launcher that appends its own --opts dropped the user's. Found by the red team of 2026-12-03."""
    import yaml

    monkeypatch.chdir(tmp_path)
    shown = run_cli(["config", "--config", str(DEMO), "--opts", "SOLVER.MAX_ITER 7 SOLVER.BASE_LR 0.1",
                     "--opts", "SOLVER.BASE_LR 0.5"])
    assert shown.code is None, shown.stderr
    cfg = yaml.safe_load(shown.stdout.split("## resolved config\n")[1].split("\n## ")[0])
    assert (cfg["SOLVER"]["MAX_ITER"], cfg["SOLVER"]["BASE_LR"]) == (7, 0.5)
    assert_exit_2(run_cli(["config", "--config", str(DEMO), "--opts", "SOLVER.MAX_ITER 7", "--opts", "NAME 'x"]),
                  "--opts: No closing quotation in \"NAME 'x\"")


def test_no_writable_folder_for_temporary_files_is_one_line_before_anything_is_made(tmp_path, monkeypatch):
    """A read-only root file system without a /tmp volume: torch's import ended in a traceback
    (`No usable temporary directory found`), after the tracking store had been made (helper-61).
    Python's own search is played with folders that do not exist: root may write anywhere."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # not yet found in this process
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(tmp_path / "no-tmp"), str(tmp_path / "none")])
    monkeypatch.chdir(tmp_path)
    result = run_cli(["train", "--config", str(DEMO), "TRACKING.URI", f"sqlite:///{tmp_path / 'm.db'}",
                      "OUTPUT_DIR", str(tmp_path / "out")])
    assert_exit_2(result, "no folder for temporary files: TMPDIR, /tmp, /var/tmp and the working folder are not writable")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_image_names_a_c_locale_cannot_spell_say_so(tmp_path):
    """`LC_ALL=C PYTHONUTF8=0` (a bare container, a cron job): images named `café_….png` were "missing",
    though on disk; the locale is the cause (helper-61)."""
    root = write_synthetic_dataset(tmp_path / "shapes", num_images=4, image_size=64, seed=1)
    data = json.loads((root / "annotations.json").read_text())
    first = data["images"][0]
    (root / "images" / first["file_name"]).rename(root / "images" / f"café_{first['file_name']}")
    first["file_name"] = f"café_{first['file_name']}"
    (root / "annotations.json").write_text(json.dumps(data))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"}
    done = subprocess.run(trainer_cmd("--dry-run", "TRAIN.DATASETS", f"('{root}',)", "TEST.DATASETS", "()",
                                      "TRACKING.ENABLED", "false", "OUTPUT_DIR", str(tmp_path / "out")),
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**env, "LC_ALL": "C", "PYTHONUTF8": "0"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].endswith(
        "names that are not ASCII cannot be found in this locale (file names as ascii): use LC_ALL=C.UTF-8 or "
        "PYTHONUTF8=1"), done.stderr[-2000:]
