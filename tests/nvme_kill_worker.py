"""`zeroflax train` with a slow disk, for tests/test_nvme_runs.py: the test kills this process inside the window
a slow operation opens, so that the kill lands where it means to (in the middle of a step's update, or of a
checkpoint's snapshot) rather than wherever the clock happens to be.

    python tests/nvme_kill_worker.py {update|snapshot|none} <zeroflax train arguments>

update: every record written after the first few takes 20 ms, so a step's update lasts long enough to be
        killed in; snapshot: the renaming that completes a snapshot waits 2 s after the copy.
"""
import os
import sys
import time

from zeroflax.cli import main
from zeroflax.disk import files


def slow_writes():
    write = files.RecordFile.write
    count = {"n": 0}

    def slow(self, i, buf):
        count["n"] += 1
        if count["n"] > 8:
            time.sleep(0.02)
        return write(self, i, buf)

    files.RecordFile.write = slow


def slow_snapshot_rename():
    rename = os.rename

    def slow(source, target, *args, **kwargs):
        if str(source).endswith(".tmp") and os.path.basename(os.path.dirname(str(target))).startswith("nvme_"):
            time.sleep(2.0)
        return rename(source, target, *args, **kwargs)

    files.os.rename = slow


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "update":
        slow_writes()
    elif mode == "snapshot":
        slow_snapshot_rename()
    sys.exit(main(args))
