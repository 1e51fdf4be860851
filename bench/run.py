"""Run every CPU benchmark and rewrite bench/RESULTS.md.

    python -m bench.run [--quick] [--only NAME[,NAME...]] [--out bench/RESULTS.md] [--keep DIR]

Servers (moto's S3, `mlflow server` proxying artifacts to it) and the synthetic datasets are made
once in a scratch folder and shared by the benchmarks; everything is removed at the end (unless
--keep). Each benchmark reports ratios measured side by side, interleaved, in this one run. The GPU
benchmark is separate: bench/gpu.sh on a machine with an NVIDIA GPU. With --only, the file keeps
the other benchmarks' sections: the subset's summary rows and sections replace theirs, stamped.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from bench.common import Env, Section, loadavg, machine_info, md_table, quiet_logging, verdict

BENCHMARKS = ["tracking_cost", "loop_overhead", "checkpoint_stall", "resume", "data_pipeline", "dataset_start",
              "big_checkpoint"]
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and iterations (a few minutes)")
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    p.add_argument("--out", default=str(RESULTS), help="the markdown file to (re)write")
    p.add_argument("--keep", default="", help="work in this folder and keep it (servers' logs, checkpoints)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads, here and in the trainer processes started (default 1: see "
                        "set_threads)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a benchmark misses its target or breaks (.ci/nightly)")
    return p.parse_args(argv)


def exit_status(sections: list[Section], strict: bool) -> int:
    """0, or with --strict 1 when a benchmark failed (its whole 95% CI past the target) or broke:
    a scheduled run shows red. UNRESOLVED (within this machine's noise) is not a failure."""
    return int(strict and any(s.passed is False for s in sections))


def set_threads(n: int) -> None:
    """Pin torch's intra-op threads (and OpenMP's, for the trainer processes started) to `n`.

    On a shared machine whose cores are all busy, two OpenMP threads that wait on each other at every
    parallel region spin while the other one is descheduled: a demo iteration then takes 1-13 s
    instead of 0.26 s, at random. One thread keeps each side's arithmetic the same and the ratios
    meaningful; the trainer's background threads still compete with it for the cores.
    """
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def run_one(name: str, env: Env) -> Section:
    module = importlib.import_module(f"bench.{name}")
    print(f"== {name} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        section = module.run(env)
    except Exception as e:  # one broken benchmark does not lose the others
        traceback.print_exc()
        section = Section(name, name, (module.__doc__ or "").split("\n\n")[1] if module.__doc__ else "",
                          f"ERROR: {type(e).__name__}: {e}", "-", False,
                          notes=["```\n" + traceback.format_exc()[-3000:] + "```"])
    section.seconds = time.perf_counter() - t0
    print(f"== {name}: {verdict(section.passed)} in {section.seconds:.0f}s: {section.headline}",
          file=sys.stderr, flush=True)
    return section


RERUN_NOTE = "The machine and load of the last full run; a section rerun alone since (`--only`) says when, under its title."


def render(sections: list[Section], info: dict, quick: bool, load: tuple[str, str], total_s: float) -> str:
    out = ["# tracktron benchmarks", "",
           "Written by `python -m bench.run" + (" --quick" if quick else "") + "`; do not edit by hand "
           "(the next run rewrites it). Every figure is a ratio of two things measured side by side in "
           "the same run, interleaved, so it holds on a shared machine whose absolute speed moves with the "
           "load. GPU figures come from `bench/gpu.sh` (not part of this file).", "",
           "Run: `.venv/bin/python -m bench.run` (20-30 minutes on 2 cores, most of it loop_overhead's 4,200 "
           "demo iterations and big_checkpoint's 1 GB transfers; `--quick` about 4; `--only "
           "loop_overhead,resume` for a subset, whose sections (stamped) replace theirs here; "
           "`python -m bench.<name>` prints one benchmark without touching this file). Torch runs with one "
           "intra-op thread (`--threads`), see bench/run.py.", "",
           "## Machine", ""]
    rows = [[k, v] for k, v in info.items()]
    rows.append(["load average (1, 5, 15 min) at start / end", f"{load[0]} / {load[1]}"])
    rows.append(["mode", ("--quick" if quick else "full") + f", {total_s / 60:.1f} min in all"])
    out += [md_table(["", ""], rows, "ll"), "", RERUN_NOTE, "", "## Summary", ""]
    out.append(md_table(["benchmark", "result", "target", "verdict", "time"],
                        [[s.name, s.headline, s.target, verdict(s.passed), f"{s.seconds:.0f} s"] for s in sections],
                        "lllll"))
    for s in sections:
        out += ["", f"## {s.name}: {s.title}", "", " ".join(s.what.split()), ""]
        for table in s.tables:
            out += [table, ""]
        out += [f"**Target:** {s.target}. **Verdict:** {verdict(s.passed)}.", ""]
        for note in s.notes:
            out += [f"- {note}" if not note.startswith("```") else note]
    return "\n".join(out).rstrip() + "\n"


def merge(old: str, fresh: str, stamp: str) -> str:
    """`old` (a RESULTS.md) with the summary rows and sections that `fresh` (one rendered by a run of a
    subset) has replaced by those, each such section stamped with when it was rerun; the rest (the
    machine, the other benchmarks) kept as they were."""
    fresh_parts = fresh.rstrip("\n").split("\n## ")  # header, Machine, Summary, then one per benchmark
    new_sections = {part.split(":", 1)[0]: part for part in fresh_parts[3:]}
    new_rows = {_row_name(line): line for line in fresh_parts[2].split("\n")[4:] if line.startswith("| ")}
    parts = old.rstrip("\n").split("\n## ")
    if not any(p.startswith("Summary") and "\n| " in p for p in parts):
        raise ValueError("it has no summary table")
    parts[0] = fresh_parts[0]  # how to run it, as bench.run now says
    for i, part in enumerate(parts):
        name = part.split(":", 1)[0]
        if part.startswith("Summary"):
            lines = [new_rows.pop(_row_name(line), line) if line.startswith("| ") else line
                     for line in part.split("\n")]
            last = max(j for j, line in enumerate(lines) if line.startswith("| "))
            parts[i] = "\n".join(lines[:last + 1] + list(new_rows.values()) + lines[last + 1:])
        elif part.startswith("Machine") and RERUN_NOTE not in part:
            parts[i] = f"{part.rstrip()}\n\n{RERUN_NOTE}\n"
        elif name in new_sections:
            parts[i] = _stamped(new_sections.pop(name), stamp)
    parts += [_stamped(part, stamp) for part in new_sections.values()]
    return "\n## ".join(part.rstrip("\n") + "\n" for part in parts).rstrip("\n") + "\n"  # a blank line before each


def _row_name(line: str) -> str:
    return line.split(" | ", 1)[0].removeprefix("| ")


def _stamped(section: str, stamp: str) -> str:
    title, _, body = section.partition("\n\n")
    return f"{title}\n\n{stamp}\n\n{body.rstrip()}"


def main(argv=None) -> int:
    args = parse(argv)
    quiet_logging()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or BENCHMARKS
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    keep = Path(args.keep) if args.keep else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    set_threads(args.threads)
    info = machine_info()
    load_start = loadavg()
    env = Env(args.quick, keep)
    t0 = time.perf_counter()
    sections = []
    try:
        env.ensure_datasets()
        for name in names:
            sections.append(run_one(name, env))
    finally:
        env.close()
    total_s, load = time.perf_counter() - t0, (load_start, loadavg())
    out = Path(args.out)
    if args.only and out.is_file():  # a subset: its sections replace theirs, the others stay as they were
        stamp = (f"_Rerun alone with `python -m bench.run --only {args.only}` on {info['date']}, load average "
                 f"{load[0]} at start and {load[1]} at the end; {total_s / 60:.1f} min._")
        try:
            text = merge(out.read_text(), render(sections, info, args.quick, load, total_s), stamp)
        except ValueError as e:  # a file bench.run did not write: this run's results are not lost for it
            print(f"{args.out} is not a results file ({e}): rewritten with this run's benchmarks only",
                  file=sys.stderr)
            text = render(sections, info, args.quick, load, total_s)
    else:
        text = render(sections, info, args.quick, load, total_s)
    out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return exit_status(sections, args.strict)


def main_single(run_fn, argv=None) -> None:
    """`python -m bench.<name> [--quick]`: one benchmark, printed, RESULTS.md untouched."""
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keep", default="")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    set_threads(args.threads)
    quiet_logging()
    env = Env(args.quick, Path(args.keep) if args.keep else None)
    try:
        env.ensure_datasets()
        t0 = time.perf_counter()
        section = run_fn(env)
        section.seconds = time.perf_counter() - t0
    finally:
        env.close()
    print(render([section], machine_info(), args.quick, (loadavg(), loadavg()), section.seconds))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
