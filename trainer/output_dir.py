"""OUTPUT_DIR checked before a run is made for the job, without writing anything: a folder that
cannot be made or written, or that holds what a job would trip over, is the user's to fix."""
from __future__ import annotations

import os
from pathlib import Path

from trainer.atomic_write import write_probe
from trainer.checkpoint.files import links_written_through, not_files
from trainer.errors import UserError, first_line, leads_back, user_path

_NAMES_INSIDE = 200  # bytes for the longest path the job writes under OUTPUT_DIR (temporary files, the model)


def named_folder(text: str, option: str) -> Path:
    """A folder the user names on the command line (`--out`): not empty (Path("") is the working
    directory), printable as OUTPUT_DIR must be, its ~ expanded."""
    if not text.strip():
        raise UserError(f"{option} must name a folder, got an empty value")
    if not text.isprintable():
        raise UserError(f"{option} must be printable (no newline or control character), got {text!r}")
    return user_path(text, option)


def check_output_dir(path: Path) -> None:
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        dangling = next((p for p in (path, *path.parents) if p.is_symlink() and not p.exists()), None)
    except (OSError, ValueError) as e:  # a NUL in the name, a name too long
        raise UserError(f"cannot use OUTPUT_DIR {path}: {e}") from None
    if dangling is not None:  # mkdir would fail on it after the run was made
        target = os.readlink(dangling)
        why = "links that lead back to themselves" if leads_back(dangling) else "which does not exist"
        raise UserError(f"cannot make OUTPUT_DIR {path}: {dangling} is a link to {target}, {why}")
    if not existing.is_dir():
        raise UserError(f"cannot write to OUTPUT_DIR {path}: {existing} is a file")
    longest = os.pathconf(existing, "PC_PATH_MAX") - _NAMES_INSIDE
    if (length := len(os.fsencode(path.absolute()))) > longest:  # its files' names would not fit, once the run is made
        raise UserError(f"OUTPUT_DIR is too long: {length} bytes, where at most {longest} leave room for the names "
                        "of the files the job writes in it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to OUTPUT_DIR {path}: permission denied on {existing}")
    if odd := not_files(path):
        raise UserError(f"cannot use OUTPUT_DIR {path}: {odd[0].name} there is not a regular file "
                        f"(a folder, a pipe, a device or a broken link); move it away")
    if linked := links_written_through(path):
        raise UserError(f"cannot use OUTPUT_DIR {path}: {linked[0].relative_to(path)} there is a link to "
                        f"{os.readlink(linked[0])}, which the job would write through; move it away")


def make_writable(path: Path, name: str) -> None:
    """`path` made and written once, after every check and before the first result."""
    try:
        write_probe(path)
    except OSError as e:
        raise UserError(f"{name}: cannot write there ({e.strerror or first_line(e)})") from None


def check_config_file_kept(config_file: str | None, output_dir: Path) -> None:
    """The job writes its resolved config (redacted) as OUTPUT_DIR/config.yaml: a --config that is
    that file (a job rerun from its output's config) was replaced, its comments and secrets gone."""
    if config_file and Path(config_file).resolve() == (output_dir / "config.yaml").resolve():
        raise UserError(f"--config {config_file} is the file this job writes its resolved config to "
                        f"(OUTPUT_DIR/config.yaml): copy it elsewhere and give that copy")
