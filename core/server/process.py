"""A `layerzoo serve` child process on 127.0.0.1 and a free port: for tests and ``bench/serve.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from layerzoo.distributed.net import free_port


class ServerProcess:
    """Starts ``layerzoo serve <flags>`` and waits until ``/health`` answers 200 (or the child dies).

    Without ``--model`` among the flags it serves the embedded tiny model (``serve`` alone would
    pick the demo model, SmolLM2, where its package is installed). What the child prints goes to a
    file (a pipe nobody reads would stall it once full), read back by `output`."""

    def __init__(self, *flags: str, start_timeout: float = 180, env: dict[str, str] | None = None):
        from layerzoo.loading.model_packages import DEFAULT_MODEL

        if "--model" not in flags:
            flags = ("--model", str(DEFAULT_MODEL), "--served-model-name", "layerzoo", *flags)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **os.environ, **(env or {})}
        fd, self.log_path = tempfile.mkstemp(prefix="layerzoo-serve-", suffix=".log")
        os.close(fd)
        with open(self.log_path, "ab") as log:  # appending: the child's writes never overwrite
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "layerzoo.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *flags],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + start_timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"layerzoo serve exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                printed = self.output()
                self.stop()
                raise RuntimeError(f"layerzoo serve did not answer /health within {start_timeout:.0f} s:\n{printed}")
            time.sleep(0.3)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def output(self) -> str:
        """What the server printed so far (stdout and stderr)."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """The unlabelled ``layerzoo:*`` samples of ``/metrics``."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("layerzoo:") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
