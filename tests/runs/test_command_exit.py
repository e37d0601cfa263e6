"""flodl's command ends its process as the interpreter's exit would, less the teardown of every module (a
second of each command's end once torch is in): its threads waited for, its exit handlers run, its output
flushed, SystemExit's code and message kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import PYTHON, run

pytestmark = pytest.mark.multiproc

# A command whose job leaves a thread still working, an exit handler and an object only the interpreter's
# teardown would delete; each leaves a file in argv[1] when it runs. argv[2]: how the job ends.
COMMAND = """
import atexit, os, sys, threading, time
from pathlib import Path
from flodl.cli import _run

out, ending = Path(sys.argv[1]), sys.argv[2]


class TornDown:
    def __init__(self, path):  # what __del__ calls, held here: the teardown clears modules and builtins
        self.path, self.open, self.close, self.flags = path, os.open, os.close, os.O_CREAT | os.O_WRONLY

    def __del__(self):
        self.close(self.open(self.path, self.flags))


kept = TornDown(str(out / "torn-down"))
atexit.register((out / "exit-handler").touch)
go = threading.Event()


def late():
    go.wait()
    time.sleep(0.5)  # still working when the command ends
    (out / "thread").touch()


def job():
    threading.Thread(target=late).start()
    print("printed", end="")  # no newline: flushed at the end, not by a line
    go.set()
    if ending == "message":
        sys.exit("flodl: the job failed")
    if ending == "code":
        sys.exit(3)


_run(job)
"""


@pytest.mark.parametrize(
    ("ending", "code", "err"), [("done", 0, ""), ("code", 3, ""), ("message", 1, "flodl: the job failed")]
)
def test_the_command_ends_as_the_interpreter_would_without_its_teardown(
    tmp_path: Path, ending: str, code: int, err: str
) -> None:
    result = run([PYTHON, "-c", COMMAND, str(tmp_path), ending], cwd=tmp_path, timeout=120, apart=True)
    assert (result.code, result.out, result.err.strip()) == (code, "printed", err)
    assert (tmp_path / "thread").is_file()  # waited for, as the interpreter waits for a non-daemon thread
    assert (tmp_path / "exit-handler").is_file()
    assert not (tmp_path / "torn-down").exists()  # the modules were not torn down
