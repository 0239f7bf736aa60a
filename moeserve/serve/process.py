"""`moeserve serve` in a child process, for tests, benchmarks and notebooks: started on a free loopback port,
returned once GET /health answers 200, stopped on exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 180  # the demo loads in seconds; a busy 2-core machine may take much longer
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # this checkout first on the child's path


class ServerProcess:
    """`python -m moeserve serve --port 0 ARGS`; the port it picked is read from its first status line, its
    stderr kept in `log`. A context manager, or call stop()."""

    def __init__(self, *args: str, timeout: float = START_TIMEOUT_S, host: str = "127.0.0.1", ranks: int = 1):
        """ranks > 1: under torchrun (`torch.distributed.run --standalone`), one process per rank; pass the
        matching --ep/--tp in args."""
        path = os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
        launch = [sys.executable, "-m", "moeserve"] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
            "moeserve"]
        self.proc = subprocess.Popen([*launch, "serve", "--host", host, "--port", "0", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.url = ""
        self._listening = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            found = re.search(r"listening on (http://\S+?);", line)
            if found and not self.url:
                self.url = found.group(1)
                self._listening.set()
        self._listening.set()  # the process ended: stop waiting

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._listening.wait(timeout)
        while time.monotonic() < deadline and self.url:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"not ready in {timeout} s"
        raise RuntimeError(f"moeserve serve {state}: {''.join(self.log)[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
