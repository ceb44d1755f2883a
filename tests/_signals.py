"""The one way the tests stop a command at an event: start it as a user does, wait for something it does (a line it
prints, a file it writes, or a hold it reaches), then signal it. Never a sleep: on a fast machine the run ends before
the sleep does, on a slow one the signal lands somewhere else.

A hold (`RNN_DARTS_HOLD`, `rnn_darts.core.hold_at`) keeps the process at a named point until the signal comes, so a
signal that must land inside a stage or an epoch cannot come too late: `RUN batch N` (the fit in the run folder `RUN`,
after its Nth training batch in that process) or `RUN scores saved` (a random search's scoring)."""
import os, subprocess, sys, threading, time, uuid
from pathlib import Path
from rnn_darts.core import HOLD_ENV

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 300.   # seconds an awaited event may take: the bound of a hang, never what decides an outcome

class Job:
    "`rnn-darts ARGV` (or `python SCRIPT ARGV`) as a user starts it, unbuffered, its output read as it runs; `hold`: where it waits for a signal"
    def __init__(self, argv, hold:str|None=None, tmp=None, script=None, group=False, env=None):
        env = {**os.environ, 'PYTHONPATH': str(ROOT), 'PYTHONUNBUFFERED': '1', **(env or {})}
        self.hold_file = None
        if hold is not None:
            self.hold_file = Path(tmp)/f'held-{uuid.uuid4().hex[:8]}'
            env[HOLD_ENV] = f"{hold}@{self.hold_file}"
        cmd = [sys.executable, str(script)] if script else [sys.executable, '-m', 'rnn_darts.cli']
        self.p = subprocess.Popen([*cmd, *map(str, argv)], cwd=ROOT, env=env, start_new_session=group, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err, self.new = [], [], threading.Condition()
        self.readers = [threading.Thread(target=self._read, args=(f, to), daemon=True) for f, to in ((self.p.stdout, self.out), (self.p.stderr, self.err))]
        for t in self.readers: t.start()

    def _read(self, f, to):
        for line in f:
            with self.new: to.append(line); self.new.notify_all()
        with self.new: self.new.notify_all()

    @property
    def said(self) -> str: return ''.join(self.out)

    def _ended(self, what) -> AssertionError:
        self.finish()
        return AssertionError(f"the command ended (exit {self.p.returncode}) before {what}:\n{self.said[-2000:]}\n{''.join(self.err)[-2000:]}")

    def wait_line(self, text:str, limit:float=LIMIT) -> str:
        "The first line of stdout that holds `text`, once printed"
        t0 = time.monotonic()
        with self.new:
            while True:
                hit = next((l for l in self.out if text in l), None)
                if hit is not None: return hit
                if not self.readers[0].is_alive(): break
                assert time.monotonic() - t0 < limit, f"no line with {text!r} after {limit} s"
                self.new.wait(1.)
        raise self._ended(f"a line with {text!r}")

    def wait_file(self, path, limit:float=LIMIT) -> Path:
        "`path`, once it exists (a file the command writes: checked every 10 ms)"
        t0, path = time.monotonic(), Path(path)
        while not path.exists():
            if self.p.poll() is not None: raise self._ended(f"{path} was written")
            assert time.monotonic() - t0 < limit, f"no {path} after {limit} s"
            time.sleep(0.01)
        return path

    def held(self, limit:float=LIMIT) -> int:
        "The pid of the process that reached the hold (the command, or a worker it started), once it has"
        return int(self.wait_file(self.hold_file, limit).read_text())

    def signal(self, sig, to=None):
        "Send `sig` to the command (`to=None`), its process group (`'group'`: Ctrl-C in a terminal) or the process `to`"
        if to == 'group': os.killpg(self.p.pid, sig)
        else: os.kill(self.p.pid if to is None else to, sig)

    def finish(self, timeout:float=LIMIT) -> tuple:
        "(exit status, stdout, stderr), once the command has ended"
        self.p.wait(timeout)
        for t in self.readers: t.join(timeout)
        for f in (self.p.stdout, self.p.stderr): f.close()
        return self.p.returncode, self.said, ''.join(self.err)

def stop_at(argv, hold:str, sig, tmp, **kw) -> tuple:
    "Run `rnn-darts ARGV` until it reaches the hold `hold`, send `sig` to the process held there: (exit status, stdout, stderr)"
    job = Job(argv, hold=hold, tmp=tmp, **kw)
    job.signal(sig, to=job.held())
    return job.finish()
