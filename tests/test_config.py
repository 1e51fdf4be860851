"""Config: defaults, YAML as Detectron writes it, overrides, and every error path."""
import pytest

from trainer.config import ConfigError, defaults, load_config, write_config
from trainer.errors import UserError
from trainer.job_identity import job_hash, job_hashes


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_key_has_a_default_and_name_comes_from_the_file(tmp_path):
    cfg = load_config(write(tmp_path, "SOLVER:\n  BASE_LR: 0.02\n"))
    assert cfg.SOLVER.BASE_LR == 0.02
    assert cfg.SOLVER.MAX_ITER == 40000 and cfg.SOLVER.WARM_UP_ITERS == 500  # Detectron's defaults
    assert cfg.LOG_PERIOD == 20
    assert cfg.NAME == "job"


def test_detectron_style_tuples_parse(tmp_path):
    cfg = load_config(write(tmp_path, """
TRAIN:
  DATASETS: ('coco_2014_train', 'coco_2014_valminusminival')
  SCALES: (800,)
SOLVER:
  STEPS: [0, 60000, 80000]
"""))
    assert cfg.TRAIN.DATASETS == ["coco_2014_train", "coco_2014_valminusminival"]
    assert cfg.TRAIN.SCALES == [800]
    assert cfg.SOLVER.STEPS == [0, 60000, 80000]


def test_overrides_win_over_the_file_and_are_typed(tmp_path):
    cfg = load_config(write(tmp_path, "SOLVER:\n  MAX_ITER: 10\n"),
                      ["SOLVER.MAX_ITER", "200", "TRAIN.IMS_PER_BATCH", "4", "TRAIN.SCALES", "(400, 500)",
                       "SOLVER.BASE_LR", "1e-2", "DETERMINISTIC", "true", "TRAIN.DATASETS", "a,b"])
    assert cfg.SOLVER.MAX_ITER == 200 and cfg.TRAIN.IMS_PER_BATCH == 4
    assert cfg.TRAIN.SCALES == [400, 500]
    assert cfg.SOLVER.BASE_LR == 0.01 and isinstance(cfg.SOLVER.BASE_LR, float)
    assert cfg.DETERMINISTIC is True
    assert cfg.TRAIN.DATASETS == ["a", "b"]


def test_integer_accepted_where_float_expected():
    assert load_config(None, ["SOLVER.BASE_LR", "1"]).SOLVER.BASE_LR == 1.0


def test_dataset_catalog_takes_user_entries():
    cfg = load_config(None, ["DATASET_CATALOG.mine.IM_DIR", "/data/img", "DATASET_CATALOG.mine.ANN_FN", "/data/a.json"])
    assert cfg.DATASET_CATALOG == {"mine": {"IM_DIR": "/data/img", "ANN_FN": "/data/a.json"}}


@pytest.mark.parametrize("opts, message", [
    (["SOLVER.BASE_LRR", "0.1"], "unknown config key SOLVER.BASE_LRR (did you mean SOLVER.BASE_LR?)"),
    (["SOLVR.MAX_ITER", "1"], "did you mean SOLVER.MAX_ITER?"),
    (["MAX_ITER", "1"], "did you mean SOLVER.MAX_ITER?"),
    (["NOT_A_KEY_AT_ALL", "1"], "unknown config key NOT_A_KEY_AT_ALL"),
    (["SOLVER.MAX_ITER", "ten"], "SOLVER.MAX_ITER must be int"),
    (["SOLVER.MAX_ITER", "1.5"], "SOLVER.MAX_ITER must be int"),
    (["SOLVER.BASE_LR", "fast"], "SOLVER.BASE_LR must be float"),
    (["DETERMINISTIC", "maybe"], "DETERMINISTIC must be bool"),
    (["TRAIN.SCALES", "(big,)"], "TRAIN.SCALES[0] must be int"),
    (["SOLVER.BASE_LR", "-0.1"], "SOLVER.BASE_LR must be > 0"),
    (["SOLVER.STEPS", "[0, 500, 300]"], "SOLVER.STEPS must be increasing"),
    (["TRAIN.SNAPSHOT_ITERS", "0"], "TRAIN.SNAPSHOT_ITERS must be > 0"),
    (["SOLVER.MAX_ITER", "0"], "SOLVER.MAX_ITER must be 1 to 1,000,000,000"),
    (["SOLVER.LR_POLICY", "step_with_decay"], "SOLVER.LR_POLICY must be one of"),
    (["SOLVER.WARM_UP_METHOD", "cubic"], "SOLVER.WARM_UP_METHOD must be one of constant, linear"),
    (["SOLVER.LR_POLICY", "steps_with_lrs", "SOLVER.STEPS", "[0, 10]", "SOLVER.LRS", "[0.1]"], "one rate per step"),
    (["SOLVER.LR_POLICY", "steps_with_decay", "SOLVER.STEPS", "[100, 200]"], "needs SOLVER.STEPS starting at 0"),
    (["SOLVER.MAX_ITER"], "has no value"),
    (["DETERMINISTIC", "true", "CUDNN_BENCHMARK", "true"], "it cannot go with DETERMINISTIC true"),
])
def test_bad_overrides_name_the_problem(opts, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, opts)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="malformed YAML .* line \\d"):
        load_config(write(tmp_path, "SOLVER:\n  BASE_LR: [0.1\n"))
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="unknown config key SOLVER.BASE_LRR"):
        load_config(write(tmp_path, "SOLVER:\n  BASE_LRR: 0.1\n"))


def test_written_config_loads_back_identically(tmp_path):
    cfg = load_config(write(tmp_path, "NAME: demo\n"), ["SOLVER.MAX_ITER", "7", "TRAIN.SCALES", "(96,)"])
    write_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


def test_job_hash_ignores_where_the_job_runs_but_not_what_it_trains():
    base = job_hash(defaults())
    assert job_hash(load_config(None, ["OUTPUT_DIR", "/elsewhere", "TRACKING.URI", "http://x",
                                       "DATA_LOADER.NUM_THREADS", "8"])) == base
    # how fast cuDNN runs is not what is trained: a job may turn it on at a restart (and a job
    # hashed before the key existed is still found)
    assert job_hash(load_config(None, ["CUDNN_BENCHMARK", "true"])) == base
    assert job_hash(load_config(None, ["SOLVER.BASE_LR", "0.02"])) != base


def test_the_default_jobs_hash_is_the_one_earlier_tracktrons_tagged_runs_with():
    """AUTO_RESUME finds a job's run by this hash (since 2026-12-04): a key added to the config must go
    into job_identity._LATER_KEYS (or _NOT_IN_JOB), or every job started before is no longer found."""
    assert job_hashes(defaults()) == ("52255b03308b94d7", "5a060fe110d75f1c")


def test_every_shipped_config_loads():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
    assert len(configs) >= 5
    for path in configs:
        cfg = load_config(path)
        assert cfg.TRAIN.DATASETS and cfg.SOLVER.MAX_ITER > 0, path


def test_a_key_given_twice_in_a_file_is_an_error_not_a_silent_replacement(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("SOLVER:\n  BASE_LR: 0.01\nTRAIN:\n  IMS_PER_BATCH: 2\nSOLVER:\n  MAX_ITER: 10\n")
    with pytest.raises(ConfigError, match=rf"^{path}: duplicate key SOLVER \(line 5\)$"):
        load_config(path)
    path.write_text("SOLVER:\n  BASE_LR: 0.01\n  BASE_LR: 0.02\n")
    with pytest.raises(ConfigError, match="duplicate key BASE_LR"):
        load_config(path)


def test_yaml_aliases_are_refused(tmp_path):
    path = tmp_path / "alias.yaml"  # the start of a "billion laughs": each level refers to the one before
    path.write_text("DATASET_CATALOG:\n  a: &a [x, x, x, x]\n  b: &b [*a, *a, *a, *a]\n  c: [*b, *b, *b, *b]\n")
    with pytest.raises(ConfigError, match=r"YAML aliases are not allowed in a config \(line 3\)"):
        load_config(path)


@pytest.mark.parametrize("key, written", [("TRACKING.EXPERIMENT", "12:30"), ("TRACKING.RUN_NAME", "010"),
                                          ("TRACKING.RUN_NAME", "1e3"), ("TRACKING.EXPERIMENT", "2024-01-01"),
                                          ("NAME", "0x1F")])
def test_string_keys_keep_what_was_written(tmp_path, key, written):
    section, leaf = key.split(".") if "." in key else (None, key)
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {leaf}: {written}\n" if section else f"{leaf}: {written}\n")
    from_file = load_config(path)
    from_override = load_config(None, [key, written])
    for cfg in (from_file, from_override):
        node = cfg[section] if section else cfg
        assert node[leaf] == written
    assert load_config(None, ["SOLVER.MAX_ITER", "200", "SOLVER.BASE_LR", "1e-2"]).SOLVER.BASE_LR == 0.01
    write_config(from_file, tmp_path / "out.yaml")  # plain data: dumps, hashes
    assert job_hash(from_file) == job_hash(load_config(path))


@pytest.mark.parametrize("key, written, message", [
    ("SOLVER.BASE_LR", "1" * 400, "SOLVER.BASE_LR is out of range: larger than a float holds (1.8e+308)"),
    ("SOLVER.LRS", f"[0.1, {'1' * 400}]", "SOLVER.LRS[1] is out of range: larger than a float holds (1.8e+308)"),
    ("SOLVER.MAX_ITER", "0x" + "f" * 5000,  # hex has no 4,300-digit limit, but str() of it has
     "SOLVER.MAX_ITER is out of range: a number of about 6,021 digits (at most 9,007,199,254,740,992)"),
])
def test_numbers_past_a_float_or_a_printable_int_are_one_error_naming_the_key(tmp_path, key, written, message):
    """OverflowError (int too large to convert to float) and ValueError (int to str) tracebacks."""
    section, leaf = key.split(".")
    for source in (lambda: load_config(None, [key, written]),
                   lambda: load_config(write(tmp_path, f"{section}:\n  {leaf}: {written}\n"))):
        with pytest.raises(ConfigError) as refused:
            source()
        assert str(refused.value) == message


def test_an_integer_past_pythons_4300_digits_is_one_error(tmp_path):
    """PyYAML's int() raised ValueError (Exceeds the limit (4300 digits)...), which no one caught."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["SOLVER.MAX_ITER", "1" * 5000])
    assert str(refused.value) == "SOLVER.MAX_ITER: a 5,000-digit number is out of range for any config key"
    path = write(tmp_path, f"SOLVER:\n  STEPS: [0, {'1' * 5000}]\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value) == f"{path}: a 5,000-digit number is out of range for any config key"


def test_the_name_limits_are_mlflows():
    from mlflow.store.tracking.dbmodels.models import SqlRun
    from mlflow.utils.validation import MAX_EXPERIMENT_NAME_LENGTH

    from trainer import config_checks

    assert config_checks.MAX_EXPERIMENT_NAME == MAX_EXPERIMENT_NAME_LENGTH
    assert config_checks.MAX_RUN_NAME == SqlRun.name.type.length  # VARCHAR(250): PostgreSQL, MySQL refuse more


@pytest.mark.parametrize("opts, message", [
    (["TRACKING.EXPERIMENT", "e" * 501], "TRACKING.EXPERIMENT is 501 characters; MLflow takes an experiment name of at most 500"),
    (["NAME", "n" * 501, "TRACKING.RUN_NAME", "r"],
     "NAME, the experiment's name, is 501 characters; MLflow takes an experiment name of at most 500"),
    (["TRACKING.RUN_NAME", "r" * 251], "TRACKING.RUN_NAME is 251 characters; MLflow takes a run name of at most 250"),
    (["NAME", "n" * 235],
     "NAME, the run's name with -YYYYmmdd-HHMMSS, is 251 characters; MLflow takes a run name of at most 250"),
])
def test_names_mlflow_would_refuse_are_refused_with_the_config(opts, message):
    """An experiment name over 500 characters failed after a new tracking store was made."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, opts)
    assert str(refused.value) == message
    load_config(None, ["TRACKING.EXPERIMENT", "e" * 500, "TRACKING.RUN_NAME", "r" * 250])  # at the limits
    load_config(None, ["NAME", "n" * 234])
    load_config(None, ["TRACKING.ENABLED", "false", *opts])  # untracked: no name is given to MLflow


def test_two_test_sets_evaluated_under_one_name_are_refused():
    """/x/a/val and /x/b/val are both evaluated as `val`: the second's eval/val/ files and its metrics
    overwrote the first's."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["TEST.DATASETS", "(/x/a/val, synth_shapes_val, /x/b/val)"])
    assert str(refused.value) == ("TEST.DATASETS '/x/a/val' and '/x/b/val' are both 'val' in evaluation (eval/val/ and "
                                  "its metrics would overwrite each other's): rename a folder or give it a "
                                  "DATASET_CATALOG name")
    with pytest.raises(ConfigError, match="^TEST.DATASETS lists 'synth_shapes_val' twice$"):
        load_config(None, ["TEST.DATASETS", "(synth_shapes_val, synth_shapes_val)"])
    load_config(None, ["TEST.DATASETS", "(/x/a/val, /x/b/val2, synth_shapes_val)"])
    load_config(None, ["TEST.DATASETS", "('~no-such-user/val', '/x/a\\0b')"])  # no folder, found when read


@pytest.mark.parametrize("opts, benchmark", [([], False), (["CUDNN_BENCHMARK", "true"], True),
                                             (["DETERMINISTIC", "true"], False)])
def test_cudnn_benchmark_is_off_unless_asked_as_in_detectron2(opts, benchmark):
    """Detection batches come in many shapes (each padded batch follows its images' aspect ratios),
    and cuDNN's benchmark mode times its algorithms again for each new one: on by default, it was."""
    import torch

    from trainer.preflight import seed_everything

    before = torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled()
    try:
        torch.backends.cudnn.benchmark = not benchmark
        seed_everything(load_config(None, opts))
        assert torch.backends.cudnn.benchmark is benchmark
    finally:
        torch.backends.cudnn.benchmark = before[0]
        torch.use_deterministic_algorithms(before[1])


def test_a_home_relative_output_dir_is_the_home_folders(monkeypatch, tmp_path):
    """DATA_DIR, the datasets, TRAIN.WEIGHTS and --out expanded ~; OUTPUT_DIR made ./~/runs and said
    `~/runs/model_final.pth`, where nothing was (helper-47's red team)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["OUTPUT_DIR", "~/runs/demo"])
    assert cfg.OUTPUT_DIR == str(tmp_path / "runs" / "demo")
    with pytest.raises(UserError, match="OUTPUT_DIR ~nobody-tracktron/x: no home folder is known"):
        load_config(None, ["OUTPUT_DIR", "~nobody-tracktron/x"])


@pytest.mark.parametrize("written, as_bool", [("true", True), ("'true'", True), ("'False'", False), ("yes", True),
                                              ("off", False), ("True", True)])
def test_a_bool_key_in_a_file_takes_yamls_words_and_the_quoted_string(tmp_path, written, as_bool):
    assert load_config(write(tmp_path, f"DETERMINISTIC: {written}\n")).DETERMINISTIC is as_bool


@pytest.mark.parametrize("written, text", [("null", ""), ("~", ""), ("2024", "2024"), ("true", "true"), ("yes", "yes"),
                                           ("True", "True"), ("off", "off")])
def test_a_string_key_in_a_file_keeps_null_booleans_and_numbers_as_written(tmp_path, written, text):
    """RUN_NAME: yes was 'true' (YAML 1.1's boolean, lowered), where the override TRACKING.RUN_NAME yes is 'yes'."""
    from_file = load_config(write(tmp_path, f"TRACKING:\n  RUN_NAME: {written}\n"))
    assert from_file.TRACKING.RUN_NAME == text == load_config(None, ["TRACKING.RUN_NAME", written]).TRACKING.RUN_NAME
    assert type(from_file.TRACKING.RUN_NAME) is str  # torch.load(weights_only=True) of a checkpoint takes plain data only
    assert job_hash(from_file) == job_hash(load_config(None, ["TRACKING.RUN_NAME", written]))  # plain data: dumps, hashes


def test_a_bool_key_given_a_word_that_is_no_boolean_is_one_error(tmp_path):
    with pytest.raises(ConfigError) as refused:
        load_config(write(tmp_path, "DETERMINISTIC: 'maybe'\n"))
    assert "DETERMINISTIC must be bool, got 'maybe'" in str(refused.value)
