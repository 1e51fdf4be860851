"""The GPU benchmark cannot run here (no GPU), so its CPU smoke mode keeps it from rotting: it goes
through the same engine and tracker calls as on a GPU and writes its table. The CPU benchmarks take
minutes, so here they are only imported (a renamed trainer module breaks that at once), and
loop_overhead's verdict rule is checked on made-up figures."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_gpu_bench_smoke_runs_both_models_bare_and_ours_and_writes_the_table(tmp_path):
    out = tmp_path / "GPU_RESULTS.md"
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_bench", "--allow-cpu", "--models", "fasterrcnn_resnet50_fpn,maskrcnn_resnet50_fpn",
         "--precisions", "fp32", "--batch", "1", "--size", "96x128", "--iters", "1", "--blocks", "1",
         "--warmup", "1", "--num-batches", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "_fpn" in line]
    assert [r.split(" | ")[:2] for r in rows] == [["| fasterrcnn_resnet50_fpn", "fp32"], ["| maskrcnn_resnet50_fpn", "fp32"]]
    for row in rows:
        bare, ours = (float(x) for x in row.split(" | ")[2:4])
        assert bare > 0 and ours > 0
    assert "none (CPU smoke test)" in out.read_text()


def test_gpu_checks_smoke_runs_a_whole_job_check_on_the_cpu_and_writes_its_row(tmp_path):
    """bench/gpu_checks.py runs only where a GPU is lent (rarely): its CPU smoke mode runs one real
    check (two trainer processes, a resume compared tensor by tensor) so a change that breaks the
    script shows here, not in the next GPU session's few minutes."""
    out = tmp_path / "GPU_CHECKS.md"
    result = subprocess.run([sys.executable, "-m", "bench.gpu_checks", "--allow-cpu", "--only", "deterministic_resume_fp32",
                             "--out", str(out), "--logs", str(tmp_path / "logs")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| deterministic_resume_fp32 ")]
    assert "| **PASS** |" in row and "bit-identical" in row
    assert "-> exit 0" in (tmp_path / "logs" / "determ_fp32.log").read_text()


def test_gpu_checks_refuse_an_unknown_check_and_a_cpu_without_allow_cpu(tmp_path):
    unknown = subprocess.run([sys.executable, "-m", "bench.gpu_checks", "--allow-cpu", "--only", "train_amp,warp_drive"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert unknown.returncode == 2 and "unknown checks ['warp_drive']" in unknown.stderr
    if not shutil.which("nvidia-smi"):
        bare = subprocess.run([sys.executable, "-m", "bench.gpu_checks", "--out", str(tmp_path / "x.md")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bare.returncode == 2 and "no CUDA device" in bare.stderr and not (tmp_path / "x.md").exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA GPU")
def test_gpu_sh_without_a_gpu_says_so_in_one_line_and_exits_2():
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert re.fullmatch(r"bench/gpu\.sh: no NVIDIA GPU here \(nvidia-smi not found\); run this on a GPU machine\n",
                        result.stderr)


@pytest.mark.parametrize("name", ["tracking_cost", "loop_overhead", "checkpoint_stall", "resume", "data_pipeline",
                                  "dataset_start", "eval_bench", "big_checkpoint"])
def test_every_benchmark_module_imports(name):
    from bench.run import BENCHMARKS

    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "run" if name in BENCHMARKS else "main"))


def test_dataset_start_times_a_set_a_mask_model_trains_on(tmp_path):
    """Its COCO-sized set, small: every annotation kept, polygons and all (a set the checks refused
    would time an error)."""
    from bench.dataset_start import _write_coco
    from trainer.data import CocoDetection

    image_dir, ann = _write_coco(tmp_path, 20, 60)
    dataset = CocoDetection(image_dir, ann, train=True, masks=True, sizes=(800, 1333, "keys"))
    assert sum(len(r["boxes"]) for r in dataset._records) == 60 and dataset.num_classes == 81


def test_checkpoint_stall_builds_the_loop_state_the_engine_checkpoints(tmp_path):
    """checkpoint_stall makes its own LoopState (no loader, no stats): it must stay what save_snapshot
    reads, or `make bench` fails there after the others ran (it did once LoopState gained categories)."""
    from bench.checkpoint_stall import _Capture, _loop_state_for
    from tests.conftest import DEMO
    from trainer import engine
    from trainer.config import load_config
    from trainer.distributed import Context
    from trainer.job import Job
    from trainer.tracking import create_tracker

    cfg = load_config(DEMO, ["OUTPUT_DIR", str(tmp_path), "TRACKING.ENABLED", "false"])
    capture = _Capture()
    engine.save_snapshot(Job(cfg, Context(), create_tracker(cfg), tmp_path), _loop_state_for(cfg, 4, capture), 7)
    assert capture.state["iteration"] == 7 and len(capture.state["categories"]["categories"]) == 3
    assert capture.state["model"] and capture.state["optimizer"]["state"]


def test_loop_overhead_passes_only_when_both_judged_periods_reach_the_target():
    from bench.common import UNRESOLVED
    from bench.loop_overhead import _judge

    ok, unsure, bad = (0.99, (0.98, 1.0)), (0.97, (0.95, 0.99)), (0.95, (0.93, 0.97))
    assert _judge([ok, ok]) is True
    assert _judge([ok, unsure]) == UNRESOLVED
    assert _judge([unsure, bad]) is False


def test_a_subset_run_replaces_its_sections_and_summary_rows_and_keeps_the_others():
    from bench.common import Section
    from bench.run import merge, render

    def results(*sections):
        return render(list(sections), {"date": "then"}, False, ("1", "1"), 60)

    a, b = Section("a", "A", "how a", "a 1.0x", "a >= 1", True), Section("b", "B", "how b", "b 2.0x", "b <= 3", True)
    old = results(a, b)
    b2, c = Section("b", "B", "how b", "b 4.0x", "b <= 3", False, ["| t |\n| - |"]), Section("c", "C", "how c", "c", "-", None)
    merged = merge(old, results(b2, c), "_rerun now_")
    header, machine = results(b2, c).split("## Machine")[0], old.split("## Machine")[1].split("## Summary")[0]
    assert merged.startswith(header + "## Machine" + machine)  # how to run it now; the machine of the full run
    rows = [line.split(" | ")[:2] for line in merged.split("## Summary")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ") and not line.startswith(("| benchmark", "| ---"))]
    assert rows == [["| a", "a 1.0x"], ["| b", "b 4.0x"], ["| c", "c"]]
    assert merged.count("## a: A") == merged.count("## b: B") == merged.count("## c: C") == 1
    assert "how a" in merged.split("## a: A")[1].split("## b")[0] and "_rerun now_" not in merged.split("## b")[0]
    assert merged.split("## b: B")[1].split("## c")[0].startswith("\n\n_rerun now_\n\nhow b")
    assert "| t |" in merged and "_rerun now_" in merged.split("## c: C")[1]
    assert "\n## " not in merged.replace("\n\n## ", ""), "a section's title right under the last one's text"


def test_a_subset_run_over_a_file_it_did_not_write_says_so_instead_of_merging():
    from bench.common import Section
    from bench.run import merge, render

    fresh = render([Section("b", "B", "how b", "b", "-", None)], {}, False, ("1", "1"), 1)
    for old in ("", "notes by hand\n", "# tracktron benchmarks\n\n## Summary\n\nnothing yet\n"):
        with pytest.raises(ValueError, match="no summary table"):
            merge(old, fresh, "_now_")


def test_strict_fails_a_missed_target_or_a_broken_benchmark_but_not_one_within_the_noise():
    """.ci/nightly runs `bench.run --quick --strict`: red for a target missed (or a benchmark that
    broke), green for UNRESOLVED, and without --strict a run always ends 0 (its file says the rest)."""
    from bench.common import UNRESOLVED, Section
    from bench.run import exit_status

    def sections(*verdicts):
        return [Section(f"s{i}", "S", "how", "h", "-", v) for i, v in enumerate(verdicts)]

    assert exit_status(sections(True, UNRESOLVED, None), strict=True) == 0
    assert exit_status(sections(True, False), strict=True) == 1
    assert exit_status(sections(True, False), strict=False) == 0
