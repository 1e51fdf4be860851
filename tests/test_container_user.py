"""The trainer as a container platform runs it: an arbitrary user id with no passwd entry (OpenShift's
`runAsUser: 1000770000`), HOME unset or naming a folder it cannot write, caches it cannot make
(helper-83). A user id without a passwd entry is played by a subprocess whose `pwd` knows no one
(what `getpwuid` says in such a container), so that the tests need not run as root."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import DEMO, ROOT

# `python -m trainer ...` in a process whose passwd file has no entry for its user.
NO_PASSWD_ENTRY = ("import pwd, runpy, sys\n"
                   "def getpwuid(uid):\n"
                   "    raise KeyError(f'getpwuid(): uid not found: {uid}')\n"
                   "pwd.getpwuid = getpwuid\n"
                   "sys.argv[0] = 'tracktron'\n"
                   "runpy.run_module('trainer', run_name='__main__', alter_sys=True)\n")


def run_as_arbitrary_user(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("HOME", "USER", "LOGNAME") and not k.startswith("MLFLOW_")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", NO_PASSWD_ENTRY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**base, **env})


def last_line(done: subprocess.CompletedProcess) -> str:
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def test_no_home_folder_is_one_line_before_anything_is_made(tmp_path, data_dir):
    """HOME unset (`env -i`, a launcher that passes no environment) for a user id with no passwd entry:
    MLflow's import asks for the home folder, and the job ended in a 40-line traceback
    (`RuntimeError: Could not determine home directory.`) after its checks had passed."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    for command in (["train", "--config", str(DEMO), "DATA_DIR", str(data_dir), "OUTPUT_DIR", str(cwd / "out")],
                    ["status"]):
        done = run_as_arbitrary_user(command, cwd, {})
        assert done.returncode == 2, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert last_line(done) == ("error: no home folder: HOME is not set and this user (id "
                                   f"{os.getuid()}) has no entry in the passwd file (a container run as an arbitrary "
                                   "user); set HOME to a writable folder"), done.stderr[-3000:]
        assert sorted(p.name for p in cwd.iterdir()) == []
