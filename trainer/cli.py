"""Command line: `tracktron train|eval|predict|config|status|data synth`, also `python -m trainer`.

Bad input ends with one line on stderr and exit status 2. A NaN loss exits 1, a preempted job
128 + the signal number (143 for SIGTERM), after its checkpoint is safe."""
from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path

import click

from trainer.cpu_quota import use_cpu_quota
from trainer.errors import UserError, first_line
from trainer.launch import Stopped, torchrun_environment, train_job
from trainer.logs import check_arguments_are_text, hold_console_descriptors, setup_logging, write_or_drop
from trainer.open_files import check_open_files
from trainer.output_dir import check_output_dir, named_folder
from trainer.redaction import printable, redact_text, remember_url_credentials
from trainer.tracking.runs import settle_uri_variables

log = logging.getLogger("tracktron")


def _set_up(rank: int = 0) -> None:
    """Each command that runs torch: its logging, then torch's threads within the container's CPU quota."""
    setup_logging(logging.INFO if rank == 0 else logging.WARNING)
    use_cpu_quota()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli():
    """Detectron's training loop on PyTorch/torchvision, with every job tracked in MLflow."""


def _opts_option(command):
    """--opts: the trailing KEY VALUE pairs as one string, for launchers that pass a single value
    (MLproject's -P opts=..., `docker run IMAGE`, Kubeflow)."""
    return click.option("--opts", "opts_text", multiple=True, metavar="TEXT",
                        help="More KEY VALUE pairs in one string, split as a shell would (quotes honoured, nothing "
                             "expanded or run); they come after the trailing pairs, so they win. May be given "
                             "more than once, in order.")(command)


def _overrides(opts: tuple[str, ...], opts_text: tuple[str, ...]) -> list[str]:
    words = list(opts)
    for text in opts_text:  # each --opts in turn: a second one adds to the first
        try:
            words += shlex.split(text)
        except ValueError as e:  # an unclosed quote or a trailing backslash
            raise UserError(f"--opts: {e} in {text!r}") from None
    return words


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), required=True,
              help="YAML config (see configs/).")
@click.option("--resume", "resume_run_id", default=None, help="Continue this MLflow run id.")
@click.option("--no-resume", is_flag=True, help="Start a new run even if this job has one.")
@click.option("--dry-run", is_flag=True, help="Run every check of the job, say what it would do, train nothing.")
@_opts_option
@click.argument("opts", nargs=-1, type=click.UNPROCESSED)
def train(config_file, resume_run_id, no_resume, dry_run, opts_text, opts):
    """Train a detector. Trailing KEY VALUE pairs override config keys, as in Detectron:

    tracktron train --config configs/demo.yaml SOLVER.MAX_ITER 200 TRAIN.IMS_PER_BATCH 4
    """
    from trainer.config import load_config

    # torchrun's rank and world size, read before torch is imported (see below)
    rank, world_size = torchrun_environment()
    _set_up(rank)
    cfg = load_config(config_file, _overrides(opts, opts_text))
    set_num_gpus(cfg, world_size, rank)
    if no_resume:
        cfg.TRAIN.AUTO_RESUME = False
    if resume_run_id is not None and not resume_run_id.strip():  # an unset $RUN_ID in a script
        raise UserError("--resume needs a run id (it was empty)")
    if resume_run_id and (no_resume or not cfg.TRACKING.ENABLED):
        raise UserError("--resume RUN_ID continues a tracked run: it needs TRACKING.ENABLED true and no --no-resume")
    train_job(cfg, config_file, resume_run_id, no_resume, dry_run, rank, world_size)


def set_num_gpus(cfg, world_size: int, rank: int = 0) -> None:
    """NUM_GPUS follows the world size; a config made for another number of GPUs (Detectron's zoo:
    NUM_GPUS 8) keeps its schedule, made for another batch, and that is said."""
    n, ims = cfg.NUM_GPUS, cfg.TRAIN.IMS_PER_BATCH
    if n > 1 and n != world_size and rank == 0:  # one job, one warning
        procs, each = ("one process", "") if world_size == 1 else (f"{world_size} processes", f" x {world_size}")
        log.warning("NUM_GPUS %d, but this job is %s: each iteration takes %d images (TRAIN.IMS_PER_BATCH%s), not "
                    "the %d its schedule (SOLVER.BASE_LR, STEPS, MAX_ITER) is made for; start it with `torchrun "
                    "--nproc-per-node %d -m trainer train ...`, or set NUM_GPUS %d and scale the schedule (Detectron's linear "
                    "rule: BASE_LR x %d/%d, STEPS and MAX_ITER x %d/%d)", n, procs, ims * world_size, each, ims * n, n,
                    world_size, world_size, n, n, world_size)
    if world_size > 1 and n != world_size:
        log.info("NUM_GPUS set to the world size, %d", world_size)
        cfg.NUM_GPUS = world_size


@cli.command("eval", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), required=True)
@click.option("--weights", required=True,
              help="A checkpoint path, a model folder, runs:/<run_id>/checkpoints/model_final.pth, "
                   "models:/<name>/<version> or models:/<name>@<alias>.")
@_opts_option
@click.argument("opts", nargs=-1, type=click.UNPROCESSED)
def eval_(config_file, weights, opts_text, opts):
    """COCO evaluation (pycocotools) of a checkpoint on TEST.DATASETS; a runs:/ URI gets the metrics."""
    from trainer import distributed
    from trainer.config import load_config
    from trainer.evaluation import eval_command

    _set_up()
    cfg = load_config(config_file, _overrides(opts, opts_text))
    check_output_dir(Path(cfg.OUTPUT_DIR))  # the detections and the per-category table go there
    check_open_files(cfg.DATA_LOADER.NUM_THREADS, cfg.TEST.IMS_PER_BATCH)
    torchrun_environment()
    distributed.check_devices()
    try:
        ctx = distributed.setup()
    except (RuntimeError, ValueError, OSError) as e:  # torch.distributed's rendezvous and store errors
        raise UserError(f"cannot join the job's other processes: {first_line(e)}") from None
    _set_up(ctx.rank)
    try:
        eval_command(cfg, weights, ctx)
    finally:
        distributed.teardown(ctx)


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--weights", required=True,
              help="A checkpoint (model_final.pth), a model folder, runs:/<run_id>/..., models:/<name>/<version> "
                   "or models:/<name>@<alias>.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="YAML config; only its tracking URI is used, for runs:/ and models:/ weights.")
@click.option("--score-threshold", default=0.5, show_default=True, type=float,
              help="Draw the detections scoring at least this (the json has them all).")
@click.option("--out", "out_dir", required=True, help="Folder for <image>.png and <image>.json.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="IMAGE... [KEY VALUE]...")
def predict(weights, config_file, score_threshold, out_dir, args):
    """Detect objects in image files: a drawing and a json of the detections per image.

    \b
    tracktron predict --weights output/demo/model_final.pth --out preds a.jpg b.png [KEY VALUE ...]
    """
    from trainer.predict import predict_command, split_args

    _set_up()
    images, opts = split_args(args)
    predict_command(weights, images, out_dir, config_file, score_threshold, tuple(opts))


@cli.command("config", context_settings={"ignore_unknown_options": True})
@click.option("--config", "config_file", type=click.Path(dir_okay=False), required=True,
              help="A tracktron or Detectron YAML config.")
@_opts_option
@click.argument("opts", nargs=-1, type=click.UNPROCESSED)
def config_(config_file, opts_text, opts):
    """The resolved config, how a Detectron config's keys map, and the network it builds with its
    parameter count (random init, on CPU; no data read, nothing written)."""
    from trainer.config import load_config_explained
    from trainer.explain import explain

    _set_up()
    cfg, translation = load_config_explained(config_file, _overrides(opts, opts_text))
    click.echo(redact_text(explain(cfg, translation, config_file)))  # a URL's password in the mapping too


@cli.command()
@click.option("--experiment", default=None, help="Only this experiment (default: every one).")
@click.option("--uri", default=None, help="Tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db).")
@click.option("--timeout", default=120, show_default=True, type=click.IntRange(1, 86400),
              help="Seconds for the whole answer: a server that has not sent it all by then is given up on.")
def status(experiment, uri, timeout):
    """The jobs on the tracking server: status, iteration, checkpoint, loss, ETA, UI link."""
    from trainer.status import job_rows, render

    setup_logging(logging.WARNING)  # redacted and escaped like every command's lines; no INFO in a table's way
    if experiment is not None and not experiment.strip():  # an unset $EXPERIMENT in a script: not "every one"
        raise UserError("--experiment needs a name (it was empty); leave it out for every experiment")
    if uri is not None and not uri.strip():  # an unset $URI: not silently the environment's or ./mlflow.db
        raise UserError("--uri needs a tracking URI (it was empty); leave it out for MLFLOW_TRACKING_URI or "
                        "sqlite:///mlflow.db")
    click.echo(render(job_rows(uri, experiment, timeout)))


@cli.group()
def data():
    """Datasets."""


@data.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True)
@click.option("--num-images", default=64, show_default=True, type=click.IntRange(1, 1_000_000))  # synth.MAX_IMAGES
@click.option("--size", "image_size", default=128, show_default=True, type=click.IntRange(17, 4096),
              help="Image side in pixels (17 to 4096).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**32 - 1))
def synth(out_dir, num_images, image_size, seed):
    """Write the synthetic shapes dataset (COCO json + PNG) used by the demo and the tests."""
    from trainer.data.synth import ANNOTATIONS, write_synthetic_dataset

    out = named_folder(out_dir, "--out")
    if (out / ANNOTATIONS).is_file():
        click.echo(f"{out} already holds a dataset ({ANNOTATIONS}): nothing written")
        return
    path = write_synthetic_dataset(out, num_images=num_images, image_size=image_size, seed=seed, stoppable=True)
    click.echo(f"wrote {num_images} images and annotations to {path}")


def main(argv=None) -> None:
    hold_console_descriptors()
    try:
        args = sys.argv[1:] if argv is None else argv
        check_arguments_are_text(args)
        check_temporary_folder()
        check_home_folder()
        settle_uri_variables()
        for arg in args:  # `--uri`, `--weights`, an override: a password as typed is hidden in every line
            remember_url_credentials(arg)
        cli.main(args=argv, prog_name="tracktron", standalone_mode=False)
    except Stopped as e:  # within the grace period: torch's and MLflow's teardown takes seconds
        _flush_and_exit(e.code)
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, EOFError):  # click takes any EOFError for an ended prompt: here it is a fault
            raise e.__cause__ from None
        sys.exit(130)
    except (UserError, click.ClickException) as e:  # click's own usage errors: one line too, with the same prefix
        text = e.format_message() if isinstance(e, click.ClickException) else str(e)
        write_or_drop(sys.stderr, f"error: {_one_line(redact_text(text))}\n")
        if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):  # torchrun SIGTERMs the other ranks once one
            _flush_and_exit(2)  # exits: all of them end now, with their own status, not -15 in their teardown
        sys.exit(2)


def check_temporary_folder() -> None:
    """torch, MLflow and tracktron write temporary files: a folder for them is found before anything starts."""
    try:
        tempfile.gettempdir()  # tries each by writing a file; the first that takes one is kept
    except FileNotFoundError:
        raise UserError("no folder for temporary files: TMPDIR, /tmp, /var/tmp and the working folder are not "
                        "writable; set TMPDIR to a writable folder (a volume, on a read-only root file system)") from None


def check_home_folder() -> None:
    """MLflow's import asks for the home folder (Path.home()): one is known before anything starts."""
    if os.path.expanduser("~") == "~":
        raise UserError(f"no home folder: HOME is not set and this user (id {os.getuid()}) has no entry in the passwd "
                        "file (a container run as an arbitrary user); set HOME to a writable folder")


def _flush_and_exit(code: int) -> None:
    """Exit now, without the interpreter's teardown (torch's and MLflow's take seconds): everything
    of ours has finished, only the console is flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a console that is gone (a pipe, a hung-up terminal)
            stream.flush()
    os._exit(code)


def _one_line(text: str, limit: int = 2000) -> str:
    """An error is one line that a shell, a log scraper or a pipeline UI shows whole."""
    line = printable(text)
    return line if len(line) <= limit else f"{line[:limit]}... ({len(line) - limit} more characters)"
