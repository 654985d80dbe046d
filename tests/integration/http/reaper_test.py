"""The Python fleet harness kills its fleet when the test process dies: a
child process starts a 1P1D fleet through fleet.py, stops its decoder (a
stopped process ignores SIGTERM) and is SIGKILLed; every process of that
fleet must then exit (waited on through pidfds, bounded)."""
import os
import select
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HOLDER = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
import fleet as fl
f = fl.Fleet()
for w in f.state["workers"]:
    if w["role"] == "decode":
        os.kill(w["pid"], signal.SIGSTOP)
print(" ".join(str(p) for p in f.pids + [fl._reaper.pid]), flush=True)
while True:
    time.sleep(3600)  # killed by the test
"""


def main():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, HERE], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        line = holder.stdout.readline()  # bounded by fleet.py's own launch timeout
        pids = [int(p) for p in line.split()]
        assert len(pids) >= 5, f"holder printed {line!r}"  # launcher, proxy, 2 workers, reaper
        fds = {os.pidfd_open(p): p for p in pids}
    finally:
        holder.kill()
        holder.wait()
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    left = dict(fds)
    deadline = time.time() + 20
    while left and time.time() < deadline:
        for fd, _ in poller.poll(1000):
            if fd in left:
                del left[fd]
                poller.unregister(fd)
    for fd, pid in left.items():
        signal.pidfd_send_signal(fd, signal.SIGKILL)  # leave nothing behind
    for fd in fds:
        os.close(fd)
    assert not left, f"processes {sorted(left.values())} outlived the test process that started them"
    print(f"reaper: all {len(pids)} processes of the fleet exited after the test process was killed")


if __name__ == "__main__":
    main()
