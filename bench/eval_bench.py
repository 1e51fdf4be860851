"""Where evaluation time goes: inference images/s of the demo model, and COCOeval's phases.

    python -m bench.eval_bench [--config configs/demo.yaml] [--weights PATH_OR_URI] [--threads 1,2]
                               [--repeat 3] [KEY VALUE ...]

Weights: --weights, else OUTPUT_DIR/model_final.pth when the demo was trained, else random init
(which answers every image with DETECTIONS_PER_IMAGE boxes: COCOeval's worst case). The test set is
TEST.DATASETS[0] (synth_shapes_val, generated under DATA_DIR on first use). Prints markdown.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from pycocotools.cocoeval import COCOeval

from trainer.config import load_config
from trainer.data import CocoDetection, build_test_loader, resolve_dataset
from trainer.data.images import as_float
from trainer.evaluation import _eval_mode, _oks_sigmas, detections_to_coco, iou_types_for, load_model_for_eval, \
    load_results
from trainer.models import build_model, set_test_size

warnings.filterwarnings("ignore", category=DeprecationWarning)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.eval_bench", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--weights", default="")
    p.add_argument("--threads", default="1,2", help="torch intra-op thread counts to compare")
    p.add_argument("--repeat", type=int, default=3, help="passes over the test set per measurement")
    p.add_argument("opts", nargs="*", help="KEY VALUE config overrides")
    return p.parse_args(argv)


def load_model(cfg, weights: str):
    probe = CocoDetection(*resolve_dataset(cfg, cfg.TEST.DATASETS[0]), train=False)
    default = Path(cfg.OUTPUT_DIR) / "model_final.pth"
    weights = weights or (str(default) if default.is_file() else "")
    if not weights:
        torch.manual_seed(cfg.RNG_SEED)
        return build_model(cfg, probe.num_classes, probe.num_keypoints), "random init"
    return load_model_for_eval(cfg, weights, probe.num_classes, probe.num_keypoints), weights


def time_inference(model, loader, dataset, repeat: int) -> dict:
    """Seconds in loading batches, in the model, in converting to COCO json; over `repeat` passes."""
    t = {"data": 0.0, "model": 0.0, "to_coco": 0.0, "images": 0, "results": []}
    with _eval_mode(model) as net, torch.inference_mode():
        for _ in range(repeat):
            results, tic = [], time.perf_counter()
            for images, targets in loader:
                t0 = time.perf_counter()
                outputs = net([as_float(im) for im in images])  # the loader's uint8 pixels, as _infer takes them
                t1 = time.perf_counter()
                results += detections_to_coco(outputs, [x["image_id"] for x in targets], dataset.label_to_cat_id)
                t2 = time.perf_counter()
                t["data"] += t0 - tic
                t["model"] += t1 - t0
                t["to_coco"] += t2 - t1
                t["images"] += len(images)
                tic = time.perf_counter()
            t["results"] = results
    return t


def time_cocoeval(coco_gt, results, iou_type: str) -> dict:
    """loadRes, evaluate, accumulate, summarize: seconds each (pycocotools' printing silenced)."""
    t, tic = {}, time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        coco_dt = load_results(coco_gt, results, iou_type)
        t["loadRes"] = time.perf_counter() - tic
        ev = COCOeval(coco_gt, coco_dt, iou_type)
        if iou_type == "keypoints":
            ev.params.kpt_oks_sigmas = _oks_sigmas(coco_gt)
        for phase in ("evaluate", "accumulate", "summarize"):
            tic = time.perf_counter()
            getattr(ev, phase)()
            t[phase] = time.perf_counter() - tic
    t["AP"] = ev.stats[0]
    return t


def inference_table(rows: list) -> str:
    lines = ["| torch threads | images/s | data s | model s | to COCO json s | model share |",
             "|---:|---:|---:|---:|---:|---:|"]
    for threads, t in rows:
        total = t["data"] + t["model"] + t["to_coco"]
        lines.append(f"| {threads} | {t['images'] / total:.1f} | {t['data']:.2f} | {t['model']:.2f} | "
                     f"{t['to_coco']:.3f} | {100 * t['model'] / total:.0f}% |")
    return "\n".join(lines)


def cocoeval_table(rows: list, n_results: int) -> str:
    lines = ["| iou type | detections | loadRes s | evaluate s | accumulate s | summarize s | "
             "evaluate + accumulate s | AP |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for iou_type, t in rows:
        lines.append(f"| {iou_type} | {n_results} | {t['loadRes']:.3f} | {t['evaluate']:.3f} | "
                     f"{t['accumulate']:.3f} | {t['summarize']:.3f} | {t['evaluate'] + t['accumulate']:.3f} | "
                     f"{t['AP']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse(argv)
    cfg = load_config(args.config, args.opts + ["TRACKING.ENABLED", "false"])
    model, source = load_model(cfg, args.weights)
    name = cfg.TEST.DATASETS[0]
    loader, dataset = build_test_loader(cfg, name)
    set_test_size(model, cfg)
    rows = []
    for threads in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(threads)
        time_inference(model, loader, dataset, 1)  # warm-up: allocator, loader worker, first-call costs
        rows.append((threads, time_inference(model, loader, dataset, args.repeat)))
    results = rows[-1][1]["results"]
    evals = [(t, time_cocoeval(dataset.coco, results, t)) for t in iou_types_for(cfg.MODEL.TYPE)]
    print(f"### {cfg.MODEL.TYPE} ({cfg.NAME}) on {name}: {len(dataset)} images x {args.repeat} passes, "
          f"TEST.SCALE {cfg.TEST.SCALE}, TEST.IMS_PER_BATCH {cfg.TEST.IMS_PER_BATCH}, "
          f"DATA_LOADER.NUM_THREADS {cfg.DATA_LOADER.NUM_THREADS}")
    print(f"weights: {source}; torch {torch.__version__}, {platform.machine()}, python {sys.version.split()[0]}\n")
    print(inference_table(rows) + "\n")
    print(cocoeval_table(evals, len(results)))


if __name__ == "__main__":
    main()
