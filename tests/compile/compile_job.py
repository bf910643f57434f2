"""One compile job of the test session (started by compile_jobs.py): `trnrt compile` for each
step of the job file in turn, in this one process (one torch import and one set of Inductor's
in-process caches for all its graphs), printing what the command prints.

    python compile_job.py JOB.json   (model, out, owner pid, rc file, steps: preset/flags/dir/only)

Writes the exit status (0, or 1 after the failure's output) to the rc file. A watchdog kills
this process group when the owner (the pytest session) is gone.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback


def _watch(owner: int) -> None:
    while True:
        time.sleep(2)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            os.killpg(0, signal.SIGKILL)  # this job and the compilers it started
        except PermissionError:
            pass


def main(path: str) -> int:
    job = json.loads(open(path).read())
    threading.Thread(target=_watch, args=(job["owner"],), daemon=True).start()
    from trnrt.cli import app

    rc = 0
    for step in job["steps"]:
        args = ["compile", "--preset", step["preset"], "--model", job["model"], "--backend", "cpu",
                "--out", os.path.join(job["out"], step["dir"])]
        args += [f"--{f.replace('_', '-')}" for f in step["flags"]]
        for gid in step["only"]:
            args += ["--only", gid]
        print("$ trnrt " + " ".join(args), flush=True)
        try:  # not standalone: click returns the command's exit code instead of exiting
            r = app(args, standalone_mode=False)
            rc = r if isinstance(r, int) and not isinstance(r, bool) else 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        if rc:
            break
    with open(job["rc"] + ".tmp", "w") as f:
        f.write(str(rc))
    os.replace(job["rc"] + ".tmp", job["rc"])
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
